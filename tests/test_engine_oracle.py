"""Chapter 00: the stop rules of a request (task 0.2), the naive loop (task 0.3), and the whole oracle engine
against transformers' own generate.

The graded tests run on stand-ins whose every output is known in advance: a detokenizer over a one-character
vocabulary and a "model" whose greedy next token is a simple function of the sequence. So they need nothing from
the later chapters (no real model, tokenizer or sampler knobs), and a wrong answer shows exactly which rule broke.
The tests with the embedded SmolLM2 model then check the engine as a whole.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.core.request import Req
from minisgl_ref.engine.naive import NaiveEngine

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three prime numbers.",
    "Explain what a GPU is in one sentence.",
]

# ------------------------------------------------------------------------------------------------ stand-ins

# Token t decodes to ALPHABET[t]; token 0 is a special token (an EOS) that decodes to nothing.
ALPHABET = ["", "a", "b", "c", "#", ".", "x", "y"]
EOS, A, B, C, HASH, DOT, X, Y = range(8)


class CharDetokenizer:
    """A stand-in for chapter 02's ``IncrementalDetokenizer`` over ``ALPHABET``: ``step`` returns the text that
    became final and holds back any tail that could still grow into a stop string; when a stop string completes
    it sets ``matched_stop`` and returns the text before it; ``finish`` flushes what was held back."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop, self.text, self.emitted = stop, "", 0
        self.matched_stop: str | None = None
        self.fed: list[int] = []

    def step(self, ids: list[int]) -> str:
        assert self.matched_stop is None, "fed a token after the stop string matched"
        self.fed += ids
        self.text += "".join(ALPHABET[t] for t in ids)
        for stop in self.stop:
            at = self.text.find(stop)
            if at >= 0:
                self.matched_stop = stop
                out, self.emitted = self.text[self.emitted : at], len(self.text)
                return out
        keep = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        out, self.emitted = self.text[self.emitted : len(self.text) - keep], len(self.text) - keep
        return out

    def finish(self) -> str:
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out

    @property
    def output_text(self) -> str:
        return self.text[: self.emitted]


def char_req(max_new_tokens: int = 16, stop: tuple[str, ...] = (), context_len: int | None = None,
             detokenize: bool = True, **params) -> Req:  # type: ignore[no-untyped-def]
    return Req([A, B], SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **params),
               eos_token_ids=frozenset({EOS}), detokenizer=CharDetokenizer(stop) if detokenize else None,
               context_len=context_len)


def feed(req: Req, tokens: list[int]) -> str:
    """Append ``tokens`` one at a time until the request finishes; return the text they produced."""
    text = ""
    for t in tokens:
        if req.finished:
            break
        text += req.append_token(t)
    return text


# -------------------------------------------------------------------------------------- task 0.2: stop rules


@pytest.mark.task("0.2")
def test_max_new_tokens_ends_the_request_on_exactly_that_token():
    req = char_req(max_new_tokens=3)
    assert req.append_token(A) == "a" and req.append_token(B) == "b"
    assert not req.finished  # two tokens of three: still running
    assert req.append_token(C) == "c"
    assert req.finished and req.finish_reason.kind == "length" and req.finish_reason.matched is None
    assert req.output_ids == [A, B, C]
    one = char_req(max_new_tokens=1)
    assert one.append_token(X) == "x" and one.finished and one.finish_reason.kind == "length"


@pytest.mark.task("0.2")
def test_eos_stops_unless_ignore_eos():
    req = char_req()
    assert feed(req, [A, B, EOS, C]) == "ab"
    assert req.finish_reason.kind == "stop" and req.finish_reason.matched == EOS
    assert req.output_ids == [A, B, EOS]  # the stop token is an output token, but not text
    ignoring = char_req(ignore_eos=True)
    assert feed(ignoring, [A, EOS, B]) == "ab" and not ignoring.finished  # EOS is an ordinary token now
    # ignore_eos is about EOS only: the request's own stop tokens still end it.
    own = char_req(ignore_eos=True, stop_token_ids=[C])
    assert feed(own, [A, EOS, C, B]) == "a" and own.finish_reason.matched == C and own.output_ids == [A, EOS, C]


@pytest.mark.task("0.2")
def test_stop_token_text_is_not_output_but_held_text_is():
    """A stop token's own text never reaches the client; text the detokenizer was holding back does."""
    req = char_req(stop_token_ids=[DOT], stop=("##",))
    assert feed(req, [A, HASH, DOT, B]) == "a#"  # "#" was held (it might have become "##"), then released
    assert req.finish_reason.kind == "stop" and req.finish_reason.matched == DOT
    assert req.output_ids == [A, HASH, DOT] and req.detokenizer.fed == [A, HASH]


@pytest.mark.task("0.2")
def test_min_new_tokens_defers_stop_tokens():
    req = char_req(min_new_tokens=3, stop_token_ids=[DOT])
    assert req.append_token(EOS) == "" and not req.finished  # 1 < 3: an ordinary (textless) token
    assert req.append_token(DOT) == "." and not req.finished  # 2 < 3: an ordinary token, with its text
    req.append_token(EOS)  # 3 >= 3: a stop token again
    assert req.finished and req.finish_reason.kind == "stop" and req.finish_reason.matched == EOS
    later = char_req(min_new_tokens=2)
    assert feed(later, [A, B, EOS]) == "ab" and later.output_ids == [A, B, EOS] and later.finish_reason.kind == "stop"


@pytest.mark.task("0.2")
def test_stop_string_spanning_tokens_ends_the_request():
    """"#b#" is three tokens: only the detokenizer, which sees the text, can tell when it completes."""
    req = char_req(stop=("#b#",))
    assert feed(req, [A, HASH, B, HASH, C]) == "a"
    assert req.finish_reason.kind == "stop" and req.finish_reason.matched == "#b#"
    assert req.output_ids == [A, HASH, B, HASH]
    # A stop string that completes on the last allowed token is still a stop, not a length finish.
    last = char_req(max_new_tokens=3, stop=("xy",))
    assert feed(last, [A, X, Y]) == "a" and last.finish_reason.kind == "stop" and last.finish_reason.matched == "xy"


@pytest.mark.task("0.2")
def test_length_finish_flushes_held_back_text():
    req = char_req(max_new_tokens=3, stop=("##",))
    assert feed(req, [A, B, HASH]) == "ab#"  # "#" could have become "##", but the request is over
    assert req.finish_reason.kind == "length"


@pytest.mark.task("0.2")
def test_context_window_ends_the_request():
    req = char_req(max_new_tokens=100, context_len=5)  # a 2-token prompt leaves room for 3 tokens
    assert feed(req, [A, B, C, X, Y]) == "abc"
    assert req.output_ids == [A, B, C] and req.finish_reason.kind == "length"


@pytest.mark.task("0.2")
def test_without_a_detokenizer_only_ids_count():
    req = char_req(max_new_tokens=4, detokenize=False, stop_token_ids=[DOT])
    assert feed(req, [A, B, DOT, C]) == "" and req.output_ids == [A, B, DOT] and req.finish_reason.matched == DOT
    req = char_req(max_new_tokens=2, detokenize=False)
    assert feed(req, [A, B, C]) == "" and req.output_ids == [A, B] and req.finish_reason.kind == "length"


# ------------------------------------------------------------------------------------ task 0.3: the naive loop

VOCAB = 8


def known_next(sequence: list[int]) -> int:
    """The stand-in model's greedy choice after ``sequence``: (sum of the ids + last position) mod VOCAB."""
    return (sum(sequence) + len(sequence) - 1) % VOCAB


def known_continuation(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(known_next(seq))
    return seq[len(prompt) :]


class ArithmeticModel(nn.Module):
    """A "language model" whose logits are known: at position p of a sequence s it scores ``known_next(s[:p+1])``
    highest. Like a real model it reads the flat batch and splits it per request with ``batch.extend_lens_cpu``
    (that is attention's job), and it records the sequences it was fed."""

    def __init__(self) -> None:
        super().__init__()
        self.fed: list[list[list[int]]] = []

    def forward(self, input_ids, positions, batch):  # type: ignore[no-untyped-def]
        assert not any(batch.prefix_lens_cpu), "the naive loop feeds whole sequences: nothing is cached"
        ids, pos = input_ids.tolist(), positions.tolist()
        sequences, start = [], 0
        for n in batch.extend_lens_cpu:
            sequences.append(ids[start : start + n])
            assert pos[start : start + n] == list(range(n)), "positions restart at 0 for every request"
            start += n
        self.fed.append(sequences)
        rows = [known_next(seq[: p + 1]) for seq in sequences for p in range(len(seq))]
        hidden = torch.full((len(rows), VOCAB), -1.0)
        hidden[torch.arange(len(rows)), torch.tensor(rows)] = 1.0
        return hidden  # [T, VOCAB]: here the hidden state already is the logits

    def compute_logits(self, hidden):  # type: ignore[no-untyped-def]
        return hidden.float() * torch.linspace(1.0, 1.1, VOCAB)  # distinct values: a unique argmax per row


def greedy_req(prompt: list[int], max_new_tokens: int, **params) -> Req:  # type: ignore[no-untyped-def]
    return Req(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **params))


def run_bounded(engine: NaiveEngine, reqs: list[Req], limit: int = 50) -> int:
    """Step until every request finished (at most ``limit`` steps, so that a loop that never ends fails)."""
    for steps in range(limit):
        if not engine.step(reqs):
            return steps
    raise AssertionError(f"the requests were still running after {limit} steps")


@pytest.mark.task("0.3")
def test_naive_step_appends_one_token_to_each_running_request():
    engine = NaiveEngine(ArithmeticModel(), VOCAB)
    a, b = greedy_req([3, 1, 4], 5), greedy_req([1, 5, 6, 2, 6, 5, 3], 5)
    done = greedy_req([2, 7], 0)  # finished on arrival
    out = engine.step([a, done, b])
    assert [r for r, _ in out] == [a, b] and all(text == "" for _, text in out)
    assert a.output_ids == known_continuation([3, 1, 4], 1)
    assert b.output_ids == known_continuation([1, 5, 6, 2, 6, 5, 3], 1)
    assert done.output_ids == []


@pytest.mark.task("0.3")
def test_naive_loop_generates_the_known_continuation():
    engine = NaiveEngine(ArithmeticModel(), VOCAB)
    prompts = [[3, 1, 4, 1, 5], [2, 6], [7, 7, 1, 0, 2, 3, 5, 1, 1]]
    reqs = [greedy_req(p, n) for p, n in zip(prompts, (6, 9, 3))]
    assert run_bounded(engine, reqs) == 9
    for req, prompt, n in zip(reqs, prompts, (6, 9, 3)):
        assert req.output_ids == known_continuation(prompt, n)
        assert req.finish_reason.kind == "length"


@pytest.mark.task("0.3")
def test_naive_step_feeds_every_whole_sequence():
    """No cache: each step feeds prompt and output so far, of every running request, in order."""
    model = ArithmeticModel()
    engine = NaiveEngine(model, VOCAB)
    reqs = [greedy_req([1, 2, 3], 2), greedy_req([4], 3)]
    run_bounded(engine, reqs)
    full = [r.input_ids + r.output_ids for r in reqs]
    assert model.fed == [
        [full[0][:3], full[1][:1]],
        [full[0][:4], full[1][:2]],
        [full[1][:3]],  # the first request finished after two tokens
    ]


@pytest.mark.task("0.3")
def test_naive_step_returns_each_token_text_and_applies_stop_rules():
    engine = NaiveEngine(ArithmeticModel(), VOCAB)
    prompt = [2, 7]  # the stand-in continues 2, 5, 3, 7, 7: "b.cyy" over ALPHABET
    assert "".join(ALPHABET[t] for t in known_continuation(prompt, 5)) == "b.cyy"
    stops = Req(prompt, SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=[C]),
                detokenizer=CharDetokenizer())
    runs = Req(prompt, SamplingParams(max_new_tokens=4, temperature=0), detokenizer=CharDetokenizer())
    texts = []
    while out := engine.step([stops, runs]):
        texts.append([("stops" if r is stops else "runs", text) for r, text in out])
        assert len(texts) <= 4, "the requests should have finished"
    assert texts == [[("stops", "b"), ("runs", "b")], [("stops", "."), ("runs", ".")],
                     [("stops", ""), ("runs", "c")], [("runs", "y")]]
    assert stops.finish_reason.matched == C and runs.finish_reason.kind == "length"


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The chapter-00 oracle engine on the embedded model."""
    return LLM(device="cpu", engine="naive")


@pytest.fixture(scope="module")
def paged_llm() -> LLM:
    return LLM(device="cpu")


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


def test_eos_stops_with_reason_stop_and_is_not_in_text(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_new_tokens=200),
                   use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.matched_stop in llm.eos_token_ids
    assert out.output_ids[-1] == out.matched_stop
    assert "<|im_end|>" not in out.text


def test_stop_string_trims_and_reports_match(llm):
    free = llm.generate("The numbers from one to ten are: one, two,", SamplingParams(temperature=0, max_new_tokens=24),
                        use_tqdm=False)[0]
    word = "five"
    assert word in free.text, free.text  # the setup this test depends on
    out = llm.generate("The numbers from one to ten are: one, two,",
                       SamplingParams(temperature=0, max_new_tokens=24, stop=[word]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.matched_stop == word
    assert out.text == free.text[: free.text.index(word)]


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
    # The model ends this raw prompt at once with probability 0.37, so four unseeded one-token answers would all
    # be the same one time in fifty; eight forced tokens make four equal samples practically impossible.
    unseeded_params = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, ignore_eos=True)
    unseeded = llm.generate("Tell me a story.", unseeded_params, use_tqdm=False)
    assert all(len(o.output_ids) == 8 for o in unseeded)
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
