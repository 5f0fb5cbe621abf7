"""SGLang's own client, unchanged, against our native API (chapter 10).

SGLang's frontend language (``sglang.lang``: ``@sgl.function`` programs with ``gen``, ``select``, ``fork`` and chat
roles, run through ``sgl.RuntimeEndpoint``) talks to a server only through ``/get_model_info`` and ``/generate``.
Here the real package (installed without its runtime: ``scripts/setup.sh dev``) drives a real ``serve``
subprocess with the embedded SmolLM2-135M-Instruct. Two things it relies on are checked field by field on
``/generate`` itself too:

* **Prefill-only requests.** ``select`` scores each choice with ``max_new_tokens: 0`` and ``logprob_start_len``:
  the server runs the prefill and answers with the prompt's log probabilities, and no output token. Without
  ``logprob_start_len`` (SGLang's -1) each prompt reports its own last token, which
  ``unconditional_likelihood_normalized`` relies on.
* **Streams with log probabilities.** Each event carries the text so far but only the *new* output tokens'
  log probabilities, and ``output_token_logprobs_length`` (= ``completion_tokens``) counts them all.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest

from tests.server_utils import parse_sse, running_server, wait_idle

sgl = pytest.importorskip("sglang", reason="SGLang's frontend language: scripts/setup.sh dev installs it")

pytestmark = pytest.mark.slow
#: How far apart the same log probability may come out of two batches: the scheduler groups a request's rows into
#: steps as they arrive, and a row computed beside others rounds differently in float32 (by up to ~2e-5 on values
#: around -9 here; test_server.py's LP_TOL is the same bound). A wrong position would be off by whole units.
BATCH_TOL = 1e-4
IP = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


@pytest.fixture(scope="module")
def server():
    with running_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def backend(server):
    return sgl.RuntimeEndpoint(server.url)


def generate(server, **body):
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(server, text: str) -> list[int]:
    """The prompt ids the server uses for ``text`` (a prefill-only request answers with them)."""
    out = generate(server, text=text, sampling_params={"max_new_tokens": 0, "temperature": 0}, return_logprob=True,
                   logprob_start_len=0)
    return [t for _, t, _ in out["meta_info"]["input_token_logprobs"]]


# ------------------------------------------------------------------------------------------ frontend programs


@sgl.function
def capital(s):
    s += "The capital of France is" + sgl.select("city", choices=[" Paris", " London", " Berlin"])


def test_select_picks_the_likeliest_choice(server, backend):
    state = capital.run(backend=backend)
    assert state["city"] == " Paris"
    meta = state.get_meta_info("city")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == 3 and all(math.isfinite(x) for x in scores)
    assert scores.index(max(scores)) == 0 and len(set(scores)) == 3
    for entries in meta["input_token_logprobs"]:
        assert entries and all(math.isfinite(lp) for lp, _, _ in entries)
    assert meta["output_token_logprobs"] == [[], [], []]
    # The scores are the prompt log probabilities of our prefill-only requests (the batch select sends; up to
    # float32 rounding, see below).
    prompt_len = len(tokenize(server, "The capital of France is"))
    outs = generate(server, text=["The capital of France is" + c for c in (" Paris", " London", " Berlin")],
                    return_logprob=True, logprob_start_len=prompt_len - 2,
                    sampling_params={"max_new_tokens": 0, "temperature": 0})
    for out, score in zip(outs, scores):
        values = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
        assert score == pytest.approx(sum(values) / len(values), abs=BATCH_TOL)
    # Temperature 0: the same program decides the same way. Its numbers agree up to float32 rounding: the three
    # scoring requests reach the scheduler in one or several steps, as they happen to arrive, and a prefill row
    # computed beside others rounds differently in the last bits.
    again = capital.run(backend=backend)
    assert again["city"] == " Paris"
    assert again.get_meta_info("city")["normalized_prompt_logprobs"] == pytest.approx(scores, abs=BATCH_TOL)


def test_select_normalized_by_unconditional_likelihood(server, backend):
    """``choices_method=unconditional_likelihood_normalized`` asks a third question: how likely is each choice's
    last token given only the few tokens scored with it, without the prompt before them? It sends those token ids
    with ``return_logprob`` and no ``logprob_start_len``, and reads the one entry SGLang's default (-1: from the
    last prompt token on) gives."""
    choices = [" cold", " blue", " fast"]

    @sgl.function
    def opposite(s):
        s += "The opposite of hot is" + sgl.select("word", choices=choices,
                                                   choices_method=sgl.unconditional_likelihood_normalized)

    def run_uncached():  # the same computation each time: no prefix comes from the cache of earlier requests
        wait_idle(server)  # (a flush is refused while requests run)
        assert server.post("/flush_cache").status_code == 200
        return opposite.run(backend=backend)

    state = run_uncached()
    meta = state.get_meta_info("word")
    scores = meta["normalized_unconditional_prompt_logprobs"]
    assert len(scores) == 3 and all(math.isfinite(x) for x in scores)
    assert state["word"] == " cold" == choices[scores.index(max(scores))]
    # Each unconditional answer is the last token of the choice's scored ids, as the same ids report it when the
    # whole of them is asked for; the score is the conditional entries' mean less that one value.
    id_lists = [[t for _, t, _ in conditional] for conditional in meta["input_token_logprobs"]]
    wholes = generate(server, input_ids=id_lists, return_logprob=True, logprob_start_len=0,
                      sampling_params={"max_new_tokens": 0})
    for conditional, unconditional, whole, score in zip(meta["input_token_logprobs"],
                                                        meta["unconditional_token_logprobs"], wholes, scores):
        ids = [t for _, t, _ in conditional]
        assert len(ids) > 1 and len(unconditional) == 1 and unconditional[0][1] == ids[-1]
        assert unconditional[0][0] == pytest.approx(whole["meta_info"]["input_token_logprobs"][-1][0],
                                                    abs=BATCH_TOL)
        assert score == pytest.approx(sum(lp for lp, _, _ in conditional) / len(conditional) - unconditional[0][0],
                                      abs=1e-9)  # the frontend's own arithmetic on the numbers it was sent
    again = run_uncached()
    assert again["word"] == " cold"
    assert again.get_meta_info("word")["normalized_unconditional_prompt_logprobs"] == pytest.approx(scores,
                                                                                                   abs=BATCH_TOL)


def test_select_over_batched_programs(backend):
    @sgl.function
    def sentiment(s, text):
        s += f"Review: {text}\nThe review is" + sgl.select("label", choices=[" positive", " negative"])

    states = sentiment.run_batch([{"text": "I loved it, wonderful film."}, {"text": "Awful. I hated every minute."}],
                                 backend=backend)
    assert all(st["label"] in (" positive", " negative") for st in states)
    assert all(all(math.isfinite(x) for x in st.get_meta_info("label")["normalized_prompt_logprobs"])
               for st in states)


def test_regex_gen(backend):
    @sgl.function
    def dns(s):
        s += "Q: What is the IP address of the Google DNS servers?\nA: " + sgl.gen("answer", temperature=0, regex=IP)

    assert re.fullmatch(IP, dns.run(backend=backend)["answer"])


def test_fork_runs_every_branch(server, backend):
    prefixes = [" apples", " rivers", " music"]

    @sgl.function
    def facts(s):
        s += "Three short facts.\n"
        forks = s.fork(len(prefixes))
        for f, p in zip(forks, prefixes):
            f += f"A fact about{p}:" + sgl.gen("fact", max_tokens=12, temperature=0)
        forks.join()
        for i, f in enumerate(forks):
            s += f"{i + 1}." + f["fact"] + "\n"

    state = facts.run(backend=backend)
    # Each branch's answer is what the server gives for that branch's text alone (greedy).
    for i, p in enumerate(prefixes):
        alone = generate(server, text=f"Three short facts.\nA fact about{p}:",
                         sampling_params={"max_new_tokens": 12, "temperature": 0})["text"]
        assert f"{i + 1}.{alone}\n" in state.text()


def test_multi_turn_chat_matches_the_chat_route(server):
    """SmolLM2's chat template is ChatML, which the frontend knows by name: a two-turn program gives the answers
    that /v1/chat/completions gives for the same conversation."""
    chatml = sgl.RuntimeEndpoint(server.url, chat_template_name="chatml")

    @sgl.function
    def chat(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("first", max_tokens=12, temperature=0))
        s += sgl.user("And of Italy?")
        s += sgl.assistant(sgl.gen("second", max_tokens=12, temperature=0))

    state = chat.run(backend=chatml)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    for name, follow_up in (("first", "And of Italy?"), ("second", None)):
        r = server.post("/v1/chat/completions", json={"model": "default", "messages": messages, "max_tokens": 12,
                                                      "temperature": 0})
        answer = r.json()["choices"][0]["message"]["content"]
        assert state[name] == answer
        messages += [{"role": "assistant", "content": answer}] + ([{"role": "user", "content": follow_up}]
                                                                   if follow_up else [])
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]


def test_streamed_gen_with_logprobs(server, backend):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("answer", max_tokens=20, temperature=0, return_logprob=True)

    whole = story.run(backend=backend)
    final_ids = [t for _, t, _ in whole.get_meta_info("answer")["output_token_logprobs"]]
    assert len(final_ids) == 20

    async def chunks():
        state = story.run(backend=backend, stream=True)
        return [c async for c in state.text_async_iter("answer", return_meta_data=True)]

    got = asyncio.run(chunks())
    assert "".join(text for text, _ in got) == whole["answer"]
    for _, meta in got:
        n = meta["completion_tokens"]
        assert meta["output_token_logprobs_length"] == n
        # This frontend keeps the latest event's meta_info, so an event may be skipped, never repeated: each
        # holds the log probabilities of the tokens it added, the newest ones.
        new = meta["output_token_logprobs"]
        assert 1 <= len(new) <= n and [t for _, t, _ in new] == final_ids[n - len(new):n]

    # The backend's own stream, event by event: the new entries add up to the non-streamed answer's.
    sampling = sgl.lang.ir.SglSamplingParams(max_new_tokens=20, temperature=0, return_logprob=True,
                                             logprob_start_len=None, top_logprobs_num=None,
                                             return_text_in_logprobs=None)
    executor = sgl.lang.interpreter.StreamExecutor(backend, {}, sampling, None, False)
    executor.text_ = "Once upon a time"
    events = list(backend.generate_stream(executor, sampling))
    entries = [e for _, meta in events for e in meta["output_token_logprobs"]]
    assert [t for _, t, _ in entries] == final_ids
    assert [m["output_token_logprobs_length"] for _, m in events] == [m["completion_tokens"] for _, m in events]
    executor.end()


# ------------------------------------------------------------------------------- /generate, field by field


def test_prefill_only_request_answers_with_the_prompt_logprobs(server):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenize(server, text)
    start = 3
    scored = generate(server, text=text, return_logprob=True, logprob_start_len=start, top_logprobs_num=2,
                      return_text_in_logprobs=True, sampling_params={"max_new_tokens": 0, "temperature": 0})
    meta = scored["meta_info"]
    assert scored["text"] == "" and scored["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 0)
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[start:]
    assert all(math.isfinite(lp) and isinstance(name, str) for lp, _, name in meta["input_token_logprobs"])
    # The same prompt asked for one token reports the same prompt entries.
    one = generate(server, text=text, return_logprob=True, logprob_start_len=start, top_logprobs_num=2,
                   return_text_in_logprobs=True, sampling_params={"max_new_tokens": 1, "temperature": 0})
    assert one["meta_info"]["completion_tokens"] == 1
    for key in ("input_token_logprobs", "input_top_logprobs"):
        assert meta[key] == one["meta_info"][key], key
    # As select sends them: a batch of texts; and as token ids.
    batch = generate(server, text=[text, text + " again"], return_logprob=True, logprob_start_len=start,
                     sampling_params={"max_new_tokens": 0, "temperature": 0})
    lengths = [len(ids), len(tokenize(server, text + " again"))]
    assert [len(b["meta_info"]["input_token_logprobs"]) for b in batch] == [n - start for n in lengths]
    by_ids = generate(server, input_ids=[ids], return_logprob=True, logprob_start_len=0,
                      sampling_params={"max_new_tokens": 0})
    assert [t for _, t, _ in by_ids[0]["meta_info"]["input_token_logprobs"]] == ids
    assert by_ids[0]["meta_info"]["input_token_logprobs"][0][0] is None


def test_default_logprob_start_is_each_prompts_last_token(server):
    """SGLang's ``logprob_start_len`` -1, the default: each prompt reports its log probabilities from its *own*
    last token on, so a batch of prompts of different lengths gets one prompt entry each, the same entry that prompt
    reports when it is scored whole. With ``max_new_tokens: 0`` that makes a prefill-only request."""
    prompts = ["The quick brown fox jumps over the lazy dog", "Hello there"]
    ids = [tokenize(server, p) for p in prompts]
    assert len(ids[0]) != len(ids[1])
    whole = [generate(server, input_ids=i, return_logprob=True, logprob_start_len=0,
                      sampling_params={"max_new_tokens": 0})["meta_info"]["input_token_logprobs"] for i in ids]

    def check_last(entries: list[list], k: int) -> None:
        assert len(entries) == 1 and entries[0][1] == ids[k][-1] == whole[k][-1][1]
        assert math.isfinite(entries[0][0]) and entries[0][0] == pytest.approx(whole[k][-1][0], abs=BATCH_TOL)

    for extra in ({}, {"logprob_start_len": -1}):
        batch = generate(server, text=prompts, return_logprob=True, **extra,
                         sampling_params={"max_new_tokens": 0, "temperature": 0})
        for k, out in enumerate(batch):
            assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
            check_last(out["meta_info"]["input_token_logprobs"], k)
    # Generating too, streamed or not: the same one prompt entry, beside the output's.
    body = dict(text=prompts, return_logprob=True, sampling_params={"max_new_tokens": 3, "temperature": 0})
    for k, out in enumerate(generate(server, **body)):
        assert len(out["meta_info"]["output_token_logprobs"]) == 3
        check_last(out["meta_info"]["input_token_logprobs"], k)
    events = parse_sse(server.post("/generate", json={**body, "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert {e["index"] for e in events[:-1]} == {0, 1}
    for e in events[:-1]:
        check_last(e["meta_info"]["input_token_logprobs"], e["index"])
    # A one-token prompt's last token is its first, which nothing precedes: no value, as with logprob_start_len 0.
    one = generate(server, input_ids=ids[0][:1], return_logprob=True, sampling_params={"max_new_tokens": 0})
    assert one["meta_info"]["input_token_logprobs"] == [[None, ids[0][0], None]]


def test_select_cache_request_answers_at_once_with_the_prompt_length(server):
    """select's first request (``max_new_tokens: 0``, no log probabilities) only needs ``prompt_tokens`` back."""
    text = "Pick a colour:"
    out = generate(server, text=text, sampling_params={"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["prompt_tokens"] == len(tokenize(server, text))
    assert out["meta_info"]["completion_tokens"] == 0 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_streamed_logprobs_are_incremental(server):
    body = dict(text="Write a list of colours:", return_logprob=True, logprob_start_len=2, top_logprobs_num=3,
                return_text_in_logprobs=True, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                               "ignore_eos": True})
    whole = generate(server, **body)
    r = server.post("/generate", json={**body, "stream": True})
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and len(events) > 3
    events = events[:-1]
    prev = 0
    for e in events:
        meta = e["meta_info"]
        n = meta["completion_tokens"]
        assert meta["output_token_logprobs_length"] == n
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == n - prev > 0
        assert e["output_ids"] == whole["output_ids"][:n] and whole["text"].startswith(e["text"])
        # The prompt's entries come whole in every event, as SGLang sends them.
        assert meta["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
        assert meta["input_top_logprobs"] == whole["meta_info"]["input_top_logprobs"]
        prev = n
    assert events[-1]["text"] == whole["text"] and prev == whole["meta_info"]["completion_tokens"] == 24
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert [x for e in events for x in e["meta_info"][key]] == whole["meta_info"][key], key
    assert "output_token_logprobs_length" not in whole["meta_info"]  # the non-streamed answer is unchanged
    # A streamed prefill-only request: one event, the prompt's entries, nothing generated.
    r = server.post("/generate", json={**body, "stream": True, "sampling_params": {"max_new_tokens": 0}})
    (only, done) = parse_sse(r.text)
    assert done == "[DONE]" and only["meta_info"]["output_token_logprobs_length"] == 0
    assert only["meta_info"]["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]


def test_rid_names_the_request_in_meta_info(server):
    one = generate(server, text="Hi", rid="my-request", sampling_params={"max_new_tokens": 2})
    assert one["meta_info"]["id"] == "my-request"
    batch = generate(server, text=["Hi", "Hello"], rid=["a", "b"], sampling_params={"max_new_tokens": 2})
    assert [b["meta_info"]["id"] for b in batch] == ["a", "b"]
    samples = generate(server, text="Hi", rid="s", sampling_params={"max_new_tokens": 2, "n": 2})
    assert [b["meta_info"]["id"] for b in samples] == ["s_0", "s_1"]
    r = server.post("/generate", json={"text": "Hi", "rid": "streamed", "stream": True,
                                       "sampling_params": {"max_new_tokens": 3}})
    assert {e["meta_info"]["id"] for e in parse_sse(r.text)[:-1]} == {"streamed"}
    for bad, fragment in (({"text": ["Hi", "Hello"], "rid": ["a"]}, "rid has 1 entries for 2 prompts"),
                          ({"text": "Hi", "rid": 7}, "rid")):
        r = server.post("/generate", json={**bad, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "rid"


def test_frontend_requests_use_only_fields_we_honour(server):
    """What ``gen`` sends by default (SGLang's skip_special_tokens and spaces_between_special_tokens, every
    sampling field of the frontend) is accepted: none of it is refused or ignored."""
    sampling = sgl.lang.ir.SglSamplingParams(max_new_tokens=4, temperature=0)
    body = {"text": "Hello", "sampling_params": {"skip_special_tokens": True,
                                                 "spaces_between_special_tokens": True, **sampling.to_srt_kwargs()}}
    r = server.post("/generate", json=json.loads(json.dumps(body)))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4
