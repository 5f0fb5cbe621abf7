"""What the speculative-decoding engine tests share: proposers scripted from each request's known true tokens."""

from __future__ import annotations

import itertools


class TruthScript:
    """The bookkeeping of a scripted proposer: each request's true sequence (``truth``: prompt + its output without
    speculation), the tokens the engine has told the proposer so far (``known``), a cycle of the script's modes per
    request (``next_mode``: what to draft this time, e.g. right or spoiled) and the requests finished, in order.
    Subclasses write ``propose``."""

    def __init__(self, truth: dict[str, list[int]], script: tuple[str, ...]) -> None:
        self.truth, self.script = truth, script
        self.known: dict[str, list[int]] = {}
        self.modes: dict[str, itertools.cycle] = {}
        self.finished: list[str] = []

    def start(self, rid, tokens):
        self.known[rid] = list(tokens)
        self.modes.setdefault(rid, itertools.cycle(self.script))

    def extend(self, rid, tokens):
        self.known[rid] += tokens

    def next_mode(self, rid: str) -> str:
        return next(self.modes[rid])

    def finish(self, rid):
        self.finished.append(rid)


def step_until_done(engine, max_steps: int) -> int:  # type: ignore[no-untyped-def]
    """Step ``engine`` until it has no work, asserting the KV invariants after every step (a verify row's drafted
    tokens are not the request's, so ``engine_fixtures.drive``'s fed-token check does not apply); return the
    number of steps."""
    from tests.engine_fixtures import check_live_invariants

    steps = 0
    while engine.has_work:
        engine.step()
        check_live_invariants(engine)
        steps += 1
        assert steps < max_steps, "the engine did not finish"
    return steps
