"""Chapter 00's engine oracle and the offline API: the naive loop against transformers' own generate."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.core.request import Req

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three prime numbers.",
    "Explain what a GPU is in one sentence.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The chapter-00 oracle engine: these tests grade it (tasks 0.2, 0.3)."""
    return LLM(device="cpu", engine="naive")


@pytest.fixture(scope="module")
def paged_llm() -> LLM:
    return LLM(device="cpu")


@pytest.mark.task("0.3")
def test_greedy_tokens_match_transformers_generate(llm):
    """32 greedy tokens per prompt, batched together, equal HF's generate run one prompt at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.float32).eval()
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    # min_new_tokens keeps EOS masked in both engines, so each produces exactly 32 tokens to compare.
    params = SamplingParams(temperature=0, max_new_tokens=32, min_new_tokens=32)
    ours = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )[0, len(prompt):].tolist()
        assert out.output_ids == ref
        assert out.completion_tokens == 32 and out.finish_reason == "length"


def test_paged_engine_matches_transformers_too(llm, paged_llm):
    """The real engine (chapters 03-06) against the same oracle, all four prompts in one continuous batch."""
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_new_tokens=32, min_new_tokens=32)
    naive = llm.generate(prompts, params, use_tqdm=False)
    paged = paged_llm.generate(prompts, params, use_tqdm=False)
    assert [o.output_ids for o in paged] == [o.output_ids for o in naive]


def test_capital_of_france_says_paris(paged_llm):
    llm = paged_llm
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_new_tokens=48), use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.prompt_tokens > 0 and out.completion_tokens == len(out.output_ids)


@pytest.mark.task("0.2")
def test_eos_stops_with_reason_stop_and_is_not_in_text(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_new_tokens=200),
                   use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.matched_stop in llm.eos_token_ids
    assert out.output_ids[-1] == out.matched_stop
    assert "<|im_end|>" not in out.text


@pytest.mark.task("0.2")
def test_stop_string_trims_and_reports_match(llm):
    free = llm.generate("The numbers from one to ten are: one, two,", SamplingParams(temperature=0, max_new_tokens=24),
                        use_tqdm=False)[0]
    word = "five"
    assert word in free.text, free.text  # the setup this test depends on
    out = llm.generate("The numbers from one to ten are: one, two,",
                       SamplingParams(temperature=0, max_new_tokens=24, stop=[word]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.matched_stop == word
    assert out.text == free.text[: free.text.index(word)]


@pytest.mark.task("0.2")
def test_stop_token_ids_and_max_new_tokens(llm):
    base = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=12), use_tqdm=False)[0]
    assert base.finish_reason == "length" and base.completion_tokens == 12
    target = base.output_ids[5]
    out = llm.generate("Once upon a time",
                       SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[target]), use_tqdm=False)[0]
    first = base.output_ids.index(target)
    assert out.output_ids == base.output_ids[: first + 1]
    assert out.finish_reason == "stop" and out.matched_stop == target


def test_max_new_tokens_zero_and_context_limit(llm):
    out = llm.generate("Hi", SamplingParams(max_new_tokens=0), use_tqdm=False)[0]
    assert out.output_ids == [] and out.finish_reason == "length"
    short = Req([1, 2, 3], SamplingParams(max_new_tokens=100, temperature=0), context_len=6)
    llm.engine.run([short])
    assert len(short.output_ids) == 3 and short.finish_reason.kind == "length"
    with pytest.raises(ValueError, match="context window"):
        Req(list(range(6)), SamplingParams(), context_len=6)


def test_seeded_sampling_is_reproducible_and_n_gives_n_outputs(llm):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1234, n=3)
    a = llm.generate("Tell me a story.", params, use_tqdm=False)
    b = llm.generate(["Tell me a story.", "Another prompt"], params, use_tqdm=False)
    assert len(a) == 3 and len(b) == 6
    assert [o.output_ids for o in a] == [o.output_ids for o in b[:3]]
    unseeded = llm.generate("Tell me a story.", SamplingParams(temperature=1.0, max_new_tokens=8, n=4), use_tqdm=False)
    assert len({tuple(o.output_ids) for o in unseeded}) > 1


@pytest.mark.parametrize(
    "prompt,params,fragment",
    [
        ([[]], {}, "prompt"),
        ([1, -3], {}, "token ids"),
        ("hi", {"temperature": -1}, "temperature"),
        ("hi", {"bogus": 1}, "bogus"),
    ],
)
def test_bad_offline_input_names_the_problem(llm, prompt, params, fragment):
    with pytest.raises(ValueError, match=fragment):
        llm.generate(prompt, params, use_tqdm=False)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minisgl_ref", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_answers():
    res = run_cli("generate", "What is the capital of France?", "--max-new-tokens", "32", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["generate", "hi", "--model-path", "/no/such/folder"], "does not exist"),
        (["generate", "hi", "--temperature", "-2"], "temperature"),
    ],
)
def test_cli_errors_are_one_line(args, fragment):
    res = run_cli(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], res.stderr


def test_cli_chat_reset(tmp_path):
    script = "What is the capital of France?\n/reset\nAnd what did I just ask you?\n"
    res = subprocess.run([sys.executable, "-m", "minisgl_ref", "chat", "--temperature", "0", "--max-new-tokens", "24",
                          "--device", "cpu"], input=script, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout and "(history cleared)" in res.stdout
