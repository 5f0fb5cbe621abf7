"""Log probabilities (chapter 10), checked against HF transformers on the same weights.

The oracle: a greedy request's output tokens and its prompt tokens from ``logprob_start_len`` on must carry
``log_softmax`` of the transformers model's logits at the position before them (float32 on the CPU, 1e-4), and
their top alternatives must be that distribution's best tokens. Sampled tokens carry the log probability of
the distribution they were drawn from: the logits divided by the temperature. Chunked prefill, the radix cache
(which must not hide a prompt position whose log probability was asked for) and overlap scheduling must not
change any number.
"""

from __future__ import annotations

import random

import pytest
import torch

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.core.request import MAX_TOP_LOGPROBS, LogprobRequest, Req, TokenLogprob
from tests.engine_fixtures import tiny_engine_path  # noqa: F401 - fixture

VOCAB = 320
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_engine_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_engine_path, dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), V]: row p is the distribution of the token at position p + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def check_entry(entry, token: int, ref_row: torch.Tensor, k: int) -> None:
    logprob, tok, top = entry
    assert tok == token
    assert abs(logprob - ref_row[token].item()) < TOL, (logprob, ref_row[token].item())
    assert len(top) == k
    ref_top = ref_row.topk(k)
    assert [round(v, 3) for _, v in top] == [round(v, 3) for v in ref_top.values.tolist()]
    for tid, value in top:
        assert abs(value - ref_row[tid].item()) < TOL


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 23)] + [
        [rng.randrange(3, VOCAB) for _ in range(57)]]


@pytest.mark.parametrize("config", [
    dict(),
    dict(chunked_prefill_size=16, disable_overlap_schedule=True),
    dict(chunked_prefill_size=16, page_size=4),
    dict(disable_radix_cache=True),
], ids=["default", "chunked", "chunked-paged", "no-radix"])
def test_greedy_logprobs_match_transformers(tiny_engine_path, hf_model, config):
    llm = LLM(tiny_engine_path, device="cpu", **config)
    k = 5
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    batch = prompts()
    # A first run caches the shared prefix: the second must still compute (not reuse) what it reports.
    llm.generate(batch[:1], params, use_tqdm=False)
    starts = [0, 30, 50]
    outs = [llm.generate(p, params, use_tqdm=False, return_logprob=True, top_logprobs_num=k,
                         logprob_start_len=s)[0] for p, s in zip(batch, starts)]
    for prompt, start, out in zip(batch, starts, outs):
        ref = hf_logprobs(hf_model, prompt + out.output_ids)
        assert out.output_ids == ref[len(prompt) - 1 :].argmax(-1).tolist()[: len(out.output_ids)]
        assert len(out.output_token_logprobs) == len(out.output_ids)
        for j, entry in enumerate(out.output_token_logprobs):
            check_entry(entry, out.output_ids[j], ref[len(prompt) - 1 + j], k)
        assert len(out.input_token_logprobs) == len(prompt) - start
        for j, entry in enumerate(out.input_token_logprobs):
            pos = start + j
            if pos == 0:
                assert entry == (None, prompt[0], [])
            else:
                check_entry(entry, prompt[pos], ref[pos - 1], k)
    # -1 (the default) reports the output only
    only_out = llm.generate(batch[0], params, use_tqdm=False, return_logprob=True)[0]
    assert only_out.input_token_logprobs == [] and len(only_out.output_token_logprobs) == 10
    assert all(top == [] for _, _, top in only_out.output_token_logprobs)
    plain = llm.generate(batch[0], params, use_tqdm=False)[0]
    assert plain.output_token_logprobs is None and plain.output_ids == only_out.output_ids


def test_sampled_logprobs_are_of_the_tempered_distribution(tiny_engine_path, hf_model):
    llm = LLM(tiny_engine_path, device="cpu")
    prompt = prompts()[2]
    params = SamplingParams(temperature=0.7, max_new_tokens=8, ignore_eos=True, seed=7)
    out = llm.generate(prompt, params, use_tqdm=False, return_logprob=True, top_logprobs_num=3)[0]
    ref = hf_logprobs(hf_model, prompt + out.output_ids, temperature=0.7)
    for j, entry in enumerate(out.output_token_logprobs):
        check_entry(entry, out.output_ids[j], ref[len(prompt) - 1 + j], 3)
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.output_ids == out.output_ids  # asking for logprobs does not change what is sampled


def test_logit_bias_and_its_logprobs(tiny_engine_path, hf_model):
    """A bias of -100 bans a token in practice; +100 forces it. The log probabilities describe the biased
    distribution (what the token was drawn from)."""
    llm = LLM(tiny_engine_path, device="cpu")
    prompt = prompts()[0]
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    plain = llm.generate(prompt, greedy, use_tqdm=False)[0]
    banned = plain.output_ids[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True,
                                              logit_bias={str(banned): -100}),
                       use_tqdm=False, return_logprob=True)[0]
    assert banned not in out.output_ids
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True,
                                                 logit_bias={17: 100}), use_tqdm=False)[0]
    assert forced.output_ids == [17] * 6
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    logits[banned] -= 100
    ref = torch.log_softmax(logits, -1)
    assert abs(out.output_token_logprobs[0][0] - ref[out.output_ids[0]].item()) < TOL


@pytest.mark.parametrize("bad, fragment", [
    (dict(top_logprobs_num=21), "top_logprobs_num"),
    (dict(logprob_start_len=500), "logprob_start_len"),
    (dict(logprob_start_len=-2), "logprob_start_len"),
])
def test_bad_logprob_options_name_the_field(tiny_engine_path, bad, fragment):
    llm = LLM(tiny_engine_path, device="cpu")
    with pytest.raises(ValueError, match=fragment):
        llm.generate([5, 6, 7], SamplingParams(max_new_tokens=2), use_tqdm=False, return_logprob=True, **bad)


@pytest.mark.parametrize("top, start, fragment", [
    (MAX_TOP_LOGPROBS + 1, -1, "logprobs.top"),
    (-1, -1, "logprobs.top"),
    (0, -2, "logprobs.start"),
    (0, 3, "logprobs.start"),  # the prompt below has 3 tokens: positions 0..2
])
def test_bad_logprob_request_names_the_field(top, start, fragment):
    """A request's log-probability question is checked where it is made: ``top`` and the lower bound of ``start``
    by :class:`LogprobRequest` itself, ``start`` against the prompt's length by the :class:`Req` that holds it."""
    with pytest.raises(ValueError, match=fragment):
        Req(input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=2), logprobs=LogprobRequest(top, start))


def test_logprob_request_holds_the_question_and_the_answers():
    """One object per request that asks (none for one that does not); position 0 has its answer at once, since
    nothing precedes it; and a fresh copy, what a tensor-parallel follower rebuilds, shares no answer list."""
    plain = Req(input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=2))
    assert plain.logprobs is None and not plain.return_logprob and not plain.wants_prompt_logprobs
    asked = Req(input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=2),
                logprobs=LogprobRequest.asked(True, top_logprobs_num=MAX_TOP_LOGPROBS, logprob_start_len=0))
    assert asked.logprobs is not None and asked.logprobs.top == MAX_TOP_LOGPROBS
    assert asked.logprobs.prompt == [TokenLogprob(None, [])] and asked.logprobs.output == []
    assert asked.wants_prompt_logprobs  # positions 1 and 2 still need a forward pass
    assert asked.reusable_prefix_len == 0  # position 1 is predicted by position 0, which must be computed
    copy = asked.logprobs.fresh()
    assert (copy.top, copy.start, copy.prompt) == (MAX_TOP_LOGPROBS, 0, [TokenLogprob(None, [])])
    assert copy.prompt is not asked.logprobs.prompt and copy.output is not asked.logprobs.output
    assert LogprobRequest.asked(False, top_logprobs_num=5, logprob_start_len=1) is None


# ---------------------------------------------------------------------------------------- prefill-only requests
#
# max_new_tokens=0 with prompt log probabilities asked for is a scoring request (SGLang's select, likelihood
# evaluation): it runs its prefill and ends there, with no output token, and its prompt entries are exactly those
# of the same prompt asked with max_new_tokens=1.

SCORING_CONFIGS = [
    dict(),
    dict(disable_overlap_schedule=True),
    dict(chunked_prefill_size=16),
    dict(chunked_prefill_size=16, disable_overlap_schedule=True, page_size=4),
    dict(disable_radix_cache=True),
]
SCORING_IDS = ["overlap", "no-overlap", "chunked-overlap", "chunked-paged-no-overlap", "no-radix"]


@pytest.mark.parametrize("config", SCORING_CONFIGS, ids=SCORING_IDS)
def test_prefill_only_requests_score_the_prompt(tiny_engine_path, hf_model, config):
    llm = LLM(tiny_engine_path, device="cpu", **config)
    batch = prompts()
    # Every prompt is cached whole first: a cached prefix must not hide a position whose log probability is wanted.
    llm.generate(batch, SamplingParams(temperature=0, max_new_tokens=2), use_tqdm=False)
    score = SamplingParams(temperature=0, max_new_tokens=0)
    one = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    k = 3
    for prompt, start in zip(batch, [0, 30, 50]):
        opts = dict(use_tqdm=False, return_logprob=True, top_logprobs_num=k, logprob_start_len=start)
        scored = llm.generate(prompt, score, **opts)[0]
        assert (scored.output_ids, scored.completion_tokens, scored.finish_reason) == ([], 0, "length")
        assert scored.output_token_logprobs == [] and scored.text == ""
        assert len(scored.input_token_logprobs) == len(prompt) - start
        assert scored.input_token_logprobs == llm.generate(prompt, one, **opts)[0].input_token_logprobs
        ref = hf_logprobs(hf_model, prompt)
        for j, entry in enumerate(scored.input_token_logprobs):
            pos = start + j
            if pos == 0:
                assert entry == (None, prompt[0], [])
            else:
                check_entry(entry, prompt[pos], ref[pos - 1], k)


@pytest.mark.parametrize("config", SCORING_CONFIGS, ids=SCORING_IDS)
def test_prefill_only_requests_beside_generating_ones(tiny_engine_path, config):
    """Scoring requests in the same steps as requests that generate (one prefilled in chunks): each scoring
    request ends after its prefill, and the others' tokens are those they get alone."""
    llm = LLM(tiny_engine_path, device="cpu", **config)
    batch = prompts(seed=5) + prompts(seed=6)
    gen = SamplingParams(temperature=0, max_new_tokens=7, ignore_eos=True)
    score = SamplingParams(temperature=0, max_new_tokens=0)
    alone = [llm.generate(p, gen, use_tqdm=False)[0].output_ids for p in batch[::2]]
    scores = [llm.generate(p, score, use_tqdm=False, return_logprob=True, logprob_start_len=1)[0]
              for p in batch[1::2]]
    outs = llm.generate(batch, [gen, score] * 3, use_tqdm=False, return_logprob=True, logprob_start_len=1)
    assert [o.output_ids for o in outs[::2]] == alone
    for prompt, out, single in zip(batch[1::2], outs[1::2], scores):
        assert (out.output_ids, out.finish_reason, out.output_token_logprobs) == ([], "length", [])
        assert len(out.input_token_logprobs) == len(single.input_token_logprobs) == len(prompt) - 1
        assert [(t, top) for _, t, top in out.input_token_logprobs] == \
            [(t, top) for _, t, top in single.input_token_logprobs]
        for (a, _, _), (b, _, _) in zip(out.input_token_logprobs, single.input_token_logprobs):
            assert abs(a - b) < TOL  # another batch shape may round differently
    assert not llm.engine.has_work and llm.engine.cache.available_tokens == llm.engine.max_total_tokens


def test_max_new_tokens_zero_without_prompt_logprobs_finishes_on_arrival(tiny_engine_path):
    """Nothing to generate and nothing to score (no prompt log probabilities asked for, or all of them known
    without a forward pass: a one-token prompt's only entry is None): done at once, no step taken."""
    llm = LLM(tiny_engine_path, device="cpu")
    zero = SamplingParams(max_new_tokens=0)
    cases = [(list(range(5, 25)), {}), (list(range(5, 25)), dict(logprobs=LogprobRequest())),
             ([7], dict(logprobs=LogprobRequest(start=0)))]
    for prompt, opts in cases:
        req = llm.make_request(prompt, zero, **opts)
        assert req.finished and req.finish_reason.kind == "length", opts
    steps = llm.engine.stats.steps
    out = llm.generate([7], zero, use_tqdm=False, return_logprob=True, logprob_start_len=0)[0]
    assert out.input_token_logprobs == [(None, 7, [])] and out.output_ids == []
    assert llm.engine.stats.steps == steps
    scoring = llm.make_request(list(range(5, 25)), zero, logprobs=LogprobRequest(start=3))
    assert scoring.prefill_only and not scoring.finished
