"""One engine per rank, kept in lock-step (chapter 09).

With tensor parallelism every rank runs a full copy of the engine: its own scheduler, radix cache, page table and
KV pool (holding only its own KV heads). The model's collectives make every rank take part in every forward pass,
so the ranks must schedule *exactly* the same batches in the same order. We get that without sending batches
around, from two facts:

1. the scheduler is deterministic: the same requests, added at the same points, give the same decisions;
2. every rank samples the same tokens (the logits are all-gathered, and :class:`RankZeroTokens` makes rank 0's
   tokens authoritative anyway, so a rounding difference can never split the ranks apart).

So only rank 0 (the **leader**) talks to the outside world. Whatever changes the engine's state between two
steps (a new request, an abort, a cache flush) it records as an *op*; at the top of every step it broadcasts the
ops of the step to the **followers**, which replay them on their own engines and then step too. A step with no
news costs one 8-byte broadcast. Only rank 0 reports results.

::

    rank 0 (leader)                          rank 1..N-1 (followers)
    add_request / abort  -> record op
    step():  broadcast(ops)  ---------------> ops = broadcast()
             Engine.step()                     replay ops; Engine.step()
             (all-reduces inside the model <-> all-reduces inside the model)

:class:`TPEngine` is the engine for both roles; :mod:`minisgl_ref.tp.group` starts the ranks and joins the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl_ref.core.request import LogprobRequest, Req
from minisgl_ref.distributed.group import broadcast_object, peer_failures
from minisgl_ref.distributed.parallel_state import broadcast_tensor, get_tp_info
from minisgl_ref.engine.engine import Engine, LaunchFailed, StepEvent
from minisgl_ref.sampling.params import SamplingParams


@dataclass(frozen=True)
class ReqSpec:
    """Everything a follower needs to rebuild a leader's request exactly (the tokenizer state aside, which it
    rebuilds from its own tokenizer: stop strings must end a request on every rank at the same token)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    context_len: int | None
    sampling_seed: int
    stop_strings: bool  # whether the leader's request checks stop strings (it has a detokenizer with stops)
    # These change what a step computes (the cached prefix, prompt logits), so every rank must know them.
    cache_salt: str | None = None
    logprobs: LogprobRequest | None = None  # the question only (LogprobRequest.fresh): answers are rank 0's

    @classmethod
    def of(cls, req: Req) -> ReqSpec:
        has_stops = req.detokenizer is not None and bool(req.params.stop or req.params.stop_regex)
        return cls(req.rid, list(req.input_ids), req.params, req.eos_token_ids, req.context_len,
                   req.sampling_seed, has_stops, req.cache_salt,
                   req.logprobs.fresh() if req.logprobs is not None else None)

    def build(self, tokenizer: Any) -> Req:
        detok = None
        if self.stop_strings:
            from minisgl_ref.tokenizer import IncrementalDetokenizer

            if tokenizer is None:
                raise RuntimeError(f"request {self.rid} has stop strings but this rank has no tokenizer")
            detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=self.params.skip_special_tokens,
                                           stop=self.params.stop, stop_regex=self.params.stop_regex,
                                           prompt_ids=self.input_ids)
        return Req(input_ids=list(self.input_ids), params=self.params, eos_token_ids=self.eos_token_ids,
                   detokenizer=detok, context_len=self.context_len, rid=self.rid, sampling_seed=self.sampling_seed,
                   cache_salt=self.cache_salt, logprobs=self.logprobs.fresh() if self.logprobs is not None else None)


class RankZeroTokens:
    """Wraps the sampler: every rank samples, then takes rank 0's tokens (one [B] int64 broadcast per step).

    The all-gathered logits are the same on every rank, so the tokens already agree; the broadcast is cheap
    insurance that a nondeterministic kernel can never make two schedulers disagree about a request's tokens,
    which would desynchronise the ranks' collectives and hang the group."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, info: Any) -> torch.Tensor:
        return self.sample(logits, info)[0]

    def sample(self, logits: torch.Tensor, info: Any, top_logprobs: int = -1) -> tuple[torch.Tensor, Any]:
        tokens, logprobs = self.sampler.sample(logits, info, top_logprobs)  # only rank 0's logprobs are reported
        return broadcast_tensor(tokens.contiguous(), src=0), logprobs


class FollowerFailed(RuntimeError):
    """A follower rank failed (its own error is in the message): the group cannot run another step without it."""


class TPEngine(Engine):
    """An :class:`Engine` that is one rank of a tensor-parallel group: the leader (rank 0) broadcasts each step's
    ops, the followers replay them (see the module docstring). At tp=1 it is never used."""

    def __init__(self, *args: Any, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = get_tp_info()
        self.is_leader = self.tp.rank == 0
        self.tokenizer = tokenizer
        self._ops: list[tuple[Any, ...]] = []
        self._stopped = False
        # Every rank samples, then takes rank 0's tokens: the runner's sampler is a part the engine composes.
        self.runner.sampler = RankZeroTokens(self.runner.sampler)

    # ------------------------------------------------------------------------------------------ leader side

    def add_request(self, req: Req) -> None:
        if self.is_leader and not req.finished:
            self._ops.append(("add", ReqSpec.of(req)))
        super().add_request(req)

    def abort(self, req: Req, message: str = "aborted") -> None:
        if self.is_leader:
            self._ops.append(("abort", req.rid, message))
        super().abort(req, message)

    def flush_cache(self) -> bool:
        ok = super().flush_cache()
        if ok and self.is_leader:
            self._ops.append(("flush",))
        return ok

    def step(self) -> list[StepEvent]:
        if not self.is_leader:
            return super().step()
        ops, self._ops = self._ops, []
        try:
            broadcast_object(ops or None)
            return super().step()
        except Exception as e:
            self._raise_if_a_follower_failed(e)
            raise

    def _recover(self, failed: LaunchFailed) -> list[StepEvent]:
        # A collective that failed because a follower is gone is nobody's request's fault: stop, saying why.
        self._raise_if_a_follower_failed(failed.error)
        return super()._recover(failed)

    def _raise_if_a_follower_failed(self, error: BaseException) -> None:
        """After a failed broadcast or collective on the leader: if a follower left its reason in the group's
        store before it exited (:func:`~minisgl_ref.distributed.group.report_failure`), raise that reason
        instead of the bare "connection closed by peer" that the leader's own socket saw."""
        failures = peer_failures() if self.is_leader else []
        if failures:
            raise FollowerFailed("a tensor-parallel rank failed, so the group cannot go on: "
                                 + "; ".join(failures)) from error

    def stop_followers(self) -> None:
        """Tell every follower to leave :meth:`follow` (the leader's part of shutting down)."""
        if self.is_leader and not self._stopped:
            self._stopped = True
            broadcast_object([("stop",)])

    # ---------------------------------------------------------------------------------------- follower side

    def follow(self) -> None:
        """A follower's whole life: receive the step's ops, replay them, step; until the leader says stop.

        Each turn, ``broadcast_object(None)`` returns the leader's ops for its next step: a list, or None when
        nothing happened (a step with no news, which the follower must take all the same). Replay them in order,
        with the :class:`Engine` methods (``super().add_request`` and so on: this class's own ``add_request``
        records ops for the leader to send):

        * ``("add", spec)``: ``spec.build(self.tokenizer)`` rebuilds the leader's request (same rid, sampling seed,
          stop rules); add it;
        * ``("abort", rid, message)``: abort this rank's request with that rid, if it is still running here;
        * ``("flush",)``: flush the cache;
        * ``("stop",)``: return at once, without another step;
        * anything else: raise ``RuntimeError("unknown op from the leader: ...")`` (a follower that skipped it would
          drift out of step with the leader).

        Then take exactly one ``super().step()``, as the leader does after sending the ops. Keep a rid -> request
        map for the aborts, and drop a request from it once a step reports it finished."""
        assert not self.is_leader, "rank 0 leads; only ranks 1..N-1 follow"
        # BEGIN TASK 9.2: replay the leader's ops, then step
        reqs: dict[str, Req] = {}
        while True:
            ops = broadcast_object(None) or []
            for op in ops:
                kind = op[0]
                if kind == "stop":
                    return
                if kind == "add":
                    req = op[1].build(self.tokenizer)
                    reqs[req.rid] = req
                    super().add_request(req)
                elif kind == "abort":
                    _, rid, message = op
                    # The leader aborts only requests it still runs, and so does this rank, in lock-step.
                    if rid in reqs:
                        super().abort(reqs.pop(rid), message)
                elif kind == "flush":
                    super().flush_cache()
                else:
                    raise RuntimeError(f"unknown op from the leader: {op!r}")
            for event in super().step():
                if event.finished:
                    reqs.pop(event.req.rid, None)
        # END TASK 9.2
