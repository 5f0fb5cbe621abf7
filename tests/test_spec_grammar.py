"""Speculative decoding for requests that follow a grammar or want log probabilities (chapters 12 and 13).

Such a request drafts like any other: its verify row is checked under the grammar's mask at every drafted
offset (the matcher accepts the path's tokens, fills the mask, rolls back), and the log probability of each token
it appends is computed from the verify row's logits at the offset the token was chosen at. What is checked here:
a greedy request gives exactly the tokens (and, within float tolerance, the log probabilities) of the same engine
without speculation, whatever is drafted (the n-gram proposer, or a script that drafts tokens the grammar forbids);
sampled requests under a grammar draft, accept drafts and stay valid; and the engine ends idle.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.constrained.extension import StructuredOutput
from minisgl_ref.constrained.spec import GrammarSpec
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import LogprobRequest, Req
from minisgl_ref.engine.engine import Engine
from minisgl_ref.speculative.config import SpeculativeConfig
from minisgl_ref.speculative.extension import SpeculativeExtension
from minisgl_ref.speculative.ngram import NgramProposer
from minisgl_ref.speculative.tree import DraftTree
from tests.engine_fixtures import assert_pool_accounting
from tests.spec_fixtures import TruthScript, step_until_done

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "country": {"type": "string", "maxLength": 8}},
          "required": ["city", "country"]}
REGEX = r"(red|green|blue)( and (red|green|blue)){0,2}\."
FORBIDDEN = 1  # <|im_start|>: a special token, which no grammar ever allows
#: How far a log probability may move when its logits come from a verify row instead of a decode row: the same
#: float32 model, but an extend pass over several positions (other matmul shapes, another attention kernel) sums
#: in another order. Seen on CPU: ~4e-6; a real difference (another mask, penalty or temperature) is >1e-2.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


def _backend(llm: LLM):
    found = llm.engine.extensions.find(StructuredOutput)
    assert found is not None and found.backend is not None
    return found.backend


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.chat_prompt_ids([{"role": "user", "content": text}])


def _workload(llm: LLM) -> list[tuple[list[int], SamplingParams]]:
    """Greedy: a JSON schema, a regex, a free request; short outputs (CPU)."""
    schema_prompt = _chat(llm, f"Reply with a JSON value for this JSON schema, nothing else:\n{json.dumps(SCHEMA)}")
    return [(schema_prompt, SamplingParams(temperature=0, max_new_tokens=40, json_schema=json.dumps(SCHEMA))),
            (_chat(llm, "Name some colors."), SamplingParams(temperature=0, max_new_tokens=24, regex=REGEX)),
            (llm.tokenizer.encode("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"), SamplingParams(temperature=0, max_new_tokens=16))]


class TruthProposer(TruthScript):
    """Drafts from a known run of each request (``truth``: prompt + output without speculation): where the
    request's tokens so far are a prefix of it, the true continuation, else what followed the last occurrence of
    the request's last token there. The script, cycled per request, then spoils it: ``right`` leaves it,
    ``forbidden`` drafts a token no grammar allows in the middle (the true tokens around it), ``tree`` offers a
    forbidden token first and the right chain as a sibling branch."""

    def __init__(self, truth: dict[str, list[int]], script: tuple[str, ...] = ("right",)) -> None:
        super().__init__(truth, script)
        self.forbidden_drafted = 0

    def _continuation(self, rid: str, n: int) -> list[int]:
        known, seq = self.known[rid], self.truth[rid]
        if seq[: len(known)] == known:
            return seq[len(known) : len(known) + n]
        last = max((i for i, t in enumerate(seq[:-1]) if t == known[-1]), default=None)
        return [] if last is None else seq[last + 1 : last + 1 + n]

    def propose(self, rids, max_tokens):
        out = []
        for rid in rids:
            right = self._continuation(rid, max_tokens)
            mode = self.next_mode(rid)
            if not right:
                out.append(None)
            elif mode == "forbidden" and len(right) >= 2:
                half = len(right) // 2
                self.forbidden_drafted += 1
                out.append(DraftTree.chain(right[:half] + [FORBIDDEN] + right[half + 1 :]))
            elif mode == "tree" and len(right) >= 2:
                self.forbidden_drafted += 1
                n = len(right)
                out.append(DraftTree((FORBIDDEN, *right[: n - 1]), (-1, -1, *range(1, n - 1))))
            else:
                out.append(DraftTree.chain(right))
        return out


def _run(llm: LLM, work, *, truths=None, script=("right",), logprobs=(), constrained=True, **config):
    """Run ``work`` on a fresh engine with structured output and, given ``truths`` (one token sequence per request,
    or "ngram"), speculation with a :class:`TruthProposer` and ``script`` (or the n-gram proposer); check the
    engine's invariants after every step and its idle state at the end. Returns (requests, speculation, proposer)."""
    reqs = [llm.make_request(p, sp) for p, sp in work]
    so = StructuredOutput(_backend(llm))
    extensions: list = [so]
    spec = proposer = None
    if truths is not None:
        proposer = (NgramProposer() if truths == "ngram"
                    else TruthProposer({r.rid: seq for r, seq in zip(reqs, truths)}, script))
        spec = SpeculativeExtension(proposer, SpeculativeConfig("NGRAM"), constraint=so if constrained else None)
        extensions.append(spec)
    engine = Engine(llm.model, llm.config, EngineConfig(max_total_tokens=2048, **config), device="cpu",
                    context_length=llm.context_length, extensions=extensions)
    for i, r in enumerate(reqs):
        r.sampling_seed = 1234 + i
        if i in logprobs:  # ``logprobs``: request index -> the first prompt position to report (-1: none)
            r.logprobs = LogprobRequest(top=3, start=dict(logprobs)[i])
        engine.add_request(r)
    step_until_done(engine, 300)
    assert_pool_accounting(engine)
    return reqs, spec, proposer


_PLAIN: dict[tuple, list[Req]] = {}


def _plain(llm: LLM, work, logprobs=(), **config) -> list[Req]:
    """The same requests without speculation (memoized per workload)."""
    key = (tuple((tuple(p), repr(sp)) for p, sp in work), tuple(dict(logprobs).items()),
           tuple(sorted(config.items())))
    if key not in _PLAIN:
        _PLAIN[key] = _run(llm, work, logprobs=logprobs, **config)[0]
    return _PLAIN[key]


def _assert_same(plain: list[Req], spec: list[Req]) -> None:
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert b.output_ids == a.output_ids, f"request {i}: {b.output_text!r} != {a.output_text!r}"
        assert b.output_text == a.output_text and b.finish_reason == a.finish_reason, (i, b.finish_reason)


def _assert_valid(reqs: list[Req]) -> None:
    """Each constrained output is complete and valid for its grammar."""
    for req in reqs:
        if req.params.json_schema is not None:
            assert req.finish_reason.kind == "stop", (req.finish_reason, req.output_text)
            jsonschema.validate(json.loads(req.output_text), json.loads(req.params.json_schema))
        if req.params.regex is not None:
            assert req.finish_reason.kind == "stop", (req.finish_reason, req.output_text)
            assert re.fullmatch(req.params.regex, req.output_text), req.output_text


def _truths(reqs: list[Req]) -> list[list[int]]:
    return [r.input_ids + r.output_ids for r in reqs]


def _assert_logprobs_match(plain: Req, spec: Req) -> None:
    assert plain.logprobs is not None and spec.logprobs is not None
    assert spec.logprobs.prompt == plain.logprobs.prompt  # the prefill's, before any draft
    assert len(spec.logprobs.output) == len(spec.output_ids) == len(plain.logprobs.output)
    for k, (a, b) in enumerate(zip(plain.logprobs.output, spec.logprobs.output)):
        assert abs(a.logprob - b.logprob) <= LOGPROB_TOLERANCE, (k, a, b)
        assert [t for t, _ in b.top] == [t for t, _ in a.top], (k, a, b)
        assert all(abs(x - y) <= LOGPROB_TOLERANCE for (_, x), (_, y) in zip(a.top, b.top)), (k, a, b)


# --------------------------------------------------------------------------------------------------- tests


def test_allowed_after_is_the_mask_of_the_advanced_matcher_and_leaves_it_alone(llm):
    """The seam speculation asks: the mask after a path equals the fill of a matcher that accepted the path,
    and the request's matcher is where it was (it accepts the same next token as before)."""
    backend = _backend(llm)
    compiled = backend.compile(GrammarSpec("regex", REGEX))
    state = backend.matcher(compiled, llm.tokenizer.eos_token_ids)
    path = llm.tokenizer.encode("red and")
    scratch = xgr.allocate_token_bitmask(1, backend.vocab_size)
    mask = state.allowed_after(path, scratch)
    fresh = backend.matcher(compiled, llm.tokenizer.eos_token_ids)
    assert fresh.accepts(path)
    words = xgr.allocate_token_bitmask(1, backend.vocab_size)
    fresh.fill(words, 0)
    logits = torch.zeros(1, backend.vocab_size)
    xgr.apply_token_bitmask_inplace(logits, words)
    assert mask is not None and torch.equal(mask, logits[0] > float("-inf"))
    assert state.num_accepted == 0 and state.accepts(path)  # untouched: it still starts at the beginning
    with pytest.raises(ValueError, match="not allowed"):
        state.allowed_after([FORBIDDEN], scratch)


def test_a_dead_end_reached_inside_a_run_ends_it_at_the_stop_id(llm):
    """Stop ids that are text can corner the grammar (chapter 12). Inside a run of appended tokens no fill
    marks the dead end; accepting the stop id there still ends the grammar, as after a fill."""
    tok, backend = llm.tokenizer, _backend(llm)
    vocab = backend.vocab_size
    digits = [t for t in range(len(tok.hf)) if (text := tok.decode([t])).isascii() and text.isdigit()]
    state = backend.matcher(backend.compile(GrammarSpec("regex", "a[0-9]+")), [*tok.eos_token_ids, *digits])
    a = tok.encode("a")
    assert len(a) == 1
    scratch = xgr.allocate_token_bitmask(1, vocab)
    after_a = state.allowed_after(a, scratch)  # the dead end: only the stop ids are allowed
    assert after_a is not None and sorted(after_a.nonzero().flatten().tolist()) == sorted({*tok.eos_token_ids,
                                                                                            *digits})
    assert state.allowed_after([*a, digits[0]], scratch) is None  # the stop id ended it: nothing follows
    assert state.accept(a[0]) and not state.at_dead_end  # no fill in between, as in a verified run
    assert state.accept(digits[0]) and state.is_terminated


@pytest.mark.parametrize("proposer", ["ngram", "forbidden", "tree"])
def test_greedy_grammar_requests_draft_and_give_the_plain_output(llm, proposer):
    """A JSON schema, a regex and a free request, greedy: the same tokens, text and finish reasons as without
    speculation, whether the drafts come from the n-gram proposer or a script that drafts tokens the grammar
    forbids (in a chain, or as a tree's first branch); every constrained request drafted."""
    work = _workload(llm)
    plain = _plain(llm, work)
    if proposer == "ngram":
        reqs, spec, made = _run(llm, work, truths="ngram")
    else:
        script = ("forbidden", "right") if proposer == "forbidden" else ("tree",)
        reqs, spec, made = _run(llm, work, truths=_truths(plain), script=script)
    _assert_same(plain, reqs)
    _assert_valid(reqs)
    if proposer != "ngram":
        assert made.forbidden_drafted > 0
        for r in reqs[:2]:  # the constrained ones drafted, and kept the right drafts
            s = spec.stats[r.rid]
            assert s.verify_ct > 0 and s.accepted_tokens > 0, (r.rid, s)
    else:
        assert spec.verify_ct > 0


def test_sampled_grammar_requests_draft_and_stay_valid(llm):
    """Seeded sampled requests under a schema and a regex draft, accept drafts, and end valid; replayed, the
    same seeds give the same outputs."""
    schema_prompt, regex_prompt = (p for p, _ in _workload(llm)[:2])
    work = [(schema_prompt, SamplingParams(temperature=0.5, top_p=0.9, seed=5, max_new_tokens=40,
                                           json_schema=json.dumps(SCHEMA))),
            (regex_prompt, SamplingParams(temperature=0.5, seed=6, max_new_tokens=24, regex=REGEX))]
    # Drafts from the greedy schema run (mostly what a cool sample says too) and from a long list of colors.
    truths = [_truths(_plain(llm, _workload(llm)[:2]))[0], regex_prompt + llm.tokenizer.encode("red and blue and green.")]
    runs = []
    for _ in range(2):
        reqs, spec, _ = _run(llm, work, truths=truths)
        _assert_valid(reqs)
        for r in reqs:
            s = spec.stats[r.rid]
            assert s.verify_ct > 0 and s.accepted_tokens > 0, (r.rid, s)
        runs.append([r.output_ids for r in reqs])
    assert runs[0] == runs[1]


def test_log_probability_requests_draft_and_get_the_plain_log_probabilities(llm):
    """Greedy requests that want log probabilities (top 3), with and without a grammar, beside a plain one and
    a sampled one: the same tokens as without speculation, one log probability per output token, equal within
    float tolerance, the same top alternatives (and the same prompt log probabilities, which the prefill
    computes); the log-probability requests drafted."""
    work = _workload(llm) + [(llm.tokenizer.encode("The capital of France is"),
                              SamplingParams(temperature=0.8, seed=3, max_new_tokens=12))]
    logprobs = {0: -1, 2: 4}  # the schema request; the free greedy one, with its prompt's from position 4
    plain = _plain(llm, work, logprobs=logprobs)
    reqs, spec, _ = _run(llm, work, truths=_truths(plain), script=("right", "forbidden"), logprobs=logprobs)
    _assert_same(plain[:3], reqs[:3])  # the sampled one draws differently under speculation
    _assert_valid(reqs)
    for i in logprobs:
        _assert_logprobs_match(plain[i], reqs[i])
        s = spec.stats[reqs[i].rid]
        assert s.verify_ct > 0 and s.accepted_tokens > 0, s
    assert reqs[1].logprobs is None and reqs[3].logprobs is None


def test_grammar_requests_do_not_draft_without_the_constraint_or_with_jump_forward(llm):
    """Without the engine's constraint speculation cannot mask a drafted path, and under jump-forward the
    grammar appends forced text between the tokens of a run: either way a constrained request does not draft,
    and its output is the plain one."""
    work = _workload(llm)[1:]  # the regex request and the free one
    plain = _plain(llm, work)
    reqs, spec, _ = _run(llm, work, truths=_truths(plain), constrained=False)
    _assert_same(plain, reqs)
    assert reqs[0].rid not in spec.stats and spec.stats[reqs[1].rid].verify_ct > 0
    plain = _plain(llm, work, enable_jump_forward=True)
    reqs, spec, _ = _run(llm, work, truths=_truths(plain), enable_jump_forward=True)
    _assert_same(plain, reqs)
    _assert_valid(reqs)
    assert reqs[0].rid not in spec.stats and spec.stats[reqs[1].rid].verify_ct > 0
