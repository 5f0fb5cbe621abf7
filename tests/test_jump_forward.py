"""Jump-forward decoding's plan (chapter 12, task 12.1): which tokens replace the end of the output, and the matcher.

The unit tests drive :func:`~minisgl_ref.constrained.jump_forward.plan_jump` with SmolLM2's tokenizer and a real
xgrammar matcher, on one compact JSON schema (``{"name": <string>, "age": <integer>}``) at chosen points of its
output: at the start (the forced ``{"name": "`` is appended but for its last token), inside a string (nothing is
forced), right after ``"Ada"`` (the forced ``, "age":`` merges with the closing quote: one token is rolled back),
with no room to roll back, with only whitespace or a single token forced, and with a matcher that refuses the
plan. The engine test runs the
embedded model greedily with and without jump-forward (radix cache, overlap and chunking off, so that only the
earlier chapters' basic paths run) and checks outputs and step counts.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.constrained.backend import GrammarBackend
from minisgl_ref.constrained.extension import StructuredOutput
from minisgl_ref.constrained.jump_forward import Jump, plan_jump
from minisgl_ref.constrained.matcher import GrammarState
from minisgl_ref.constrained.spec import GrammarSpec
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.engine.engine import Engine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tokenizer():
    from minisgl_ref.models.embedded import embedded_model_path
    from minisgl_ref.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(embedded_model_path())


@pytest.fixture(scope="module")
def compiled(tokenizer):
    backend = GrammarBackend(tokenizer.hf, len(tokenizer.hf), stop_token_ids=tokenizer.eos_token_ids)
    yield backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    backend.shutdown()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.hf.encode(text, add_special_tokens=False)


def _state_after(compiled, tokenizer, text: str) -> tuple[GrammarState, list[int]]:
    """A matcher that has accepted ``text``'s canonical tokens, and those tokens (the output so far)."""
    state = GrammarState(compiled, tokenizer.eos_token_ids)
    ids = _encode(tokenizer, text)
    assert state.accepts(ids), text
    return state, ids


def _allowed(state: GrammarState, vocab: int) -> list[int]:
    """The packed mask of the tokens ``state`` allows next (to compare two states)."""
    mask = xgr.allocate_token_bitmask(1, vocab)
    state.fill(mask, 0)
    return mask[0].tolist()


@pytest.mark.task("12.1")
def test_forced_text_at_the_start_is_appended_but_its_last_token(compiled, tokenizer):
    """Nothing sampled yet: of the forced prefix ``{"name": "`` (tokens ``{"`` ``name`` ``":`` `` "``), all but the
    last token are appended, no rollback, matcher advanced; `` "`` is left to the model (it may write `` "A``)."""
    state = GrammarState(compiled, tokenizer.eos_token_ids)
    jump = plan_jump(state, tokenizer.hf, [], max_rollback=4)
    assert _encode(tokenizer, '{"name": "')[:-1] == _encode(tokenizer, '{"name":')
    assert jump == Jump(0, _encode(tokenizer, '{"name":'), '{"name":', _encode(tokenizer, '{"name":'))
    assert state.num_accepted == len(jump.tokens)
    assert state.jump_forward_string() == ' "'  # still forced, and the model's to sample
    assert state.accepts(_encode(tokenizer, ' "Ada", "age": 36}'))


@pytest.mark.task("12.1")
def test_forced_text_is_retokenized_with_the_tail_and_one_token_rolled_back(compiled, tokenizer):
    """After ``"Ada"`` the grammar forces ``, "age": ``. The space is left to the model, and so is the last token
    ``":``; the rest, ``, "age``, tokenized with the tail, turns the closing ``"`` and the ``,`` into one token
    ``",``: roll back one, append three."""
    state, out = _state_after(compiled, tokenizer, '{"name": "Ada"')
    assert state.jump_forward_string() == ', "age": '
    jump = plan_jump(state, tokenizer.hf, out, max_rollback=4)
    assert jump is not None
    assert (jump.rollback, jump.text, jump.text_ids) == (1, ', "age', _encode(tokenizer, ', "age'))
    assert jump.tokens == _encode(tokenizer, '", "age') and len(jump.tokens) == 3
    new_out = out[: len(out) - jump.rollback] + jump.tokens
    assert new_out == _encode(tokenizer, '{"name": "Ada", "age')  # the canonical tokens of the whole text
    assert state.num_accepted == len(new_out)  # the matcher follows the new tokens
    assert state.jump_forward_string() == '": '  # the held-back token is still forced
    assert state.accepts(_encode(tokenizer, '": 36}')) and state.accept(sorted(tokenizer.eos_token_ids)[0])
    assert state.is_terminated


@pytest.mark.task("12.1")
def test_no_rollback_allowed_appends_the_forced_text_alone(compiled, tokenizer):
    """``max_rollback=0`` (the tail's KV is shared): the forced text's own tokens, the last held back, go after the
    output as it is."""
    state, out = _state_after(compiled, tokenizer, '{"name": "Ada"')
    jump = plan_jump(state, tokenizer.hf, out, max_rollback=0)
    alone = _encode(tokenizer, ', "age')
    assert jump == Jump(0, alone, ', "age', alone)
    assert state.num_accepted == len(out) + len(alone)


@pytest.mark.task("12.1")
def test_nothing_whitespace_or_one_token_forced_gives_no_jump(compiled, tokenizer):
    """Inside a string the model has a choice; after ``"age":`` only a space is forced, which is the model's to
    sample; after ``"age": 36`` only ``}`` is forced, a single token, which is held back. All: no jump, and the
    matcher is left exactly where it was."""
    for text in ('{"name": "Ad', '{"name": "Ada", "age":', '{"name": "Ada", "age": 36'):
        state, out = _state_after(compiled, tokenizer, text)
        before = (state.num_accepted, state.jump_forward_string(), _allowed(state, len(tokenizer.hf)))
        assert plan_jump(state, tokenizer.hf, out, max_rollback=4) is None, text
        assert (state.num_accepted, state.jump_forward_string(), _allowed(state, len(tokenizer.hf))) == before


class _Refusing:
    """A matcher that refuses the first batch of tokens offered to it, and is otherwise the real one."""

    def __init__(self, state: GrammarState) -> None:
        self.state, self.refused = state, False

    def jump_forward_string(self) -> str:
        return self.state.jump_forward_string()

    def rollback(self, n: int) -> None:
        self.state.rollback(n)

    def accepts(self, ids: list[int]) -> bool:
        if not self.refused:
            self.refused = True
            return False
        return self.state.accepts(ids)


@pytest.mark.task("12.1")
def test_a_refused_plan_puts_the_matcher_back(compiled, tokenizer):
    """If the matcher refuses the new tokens, the plan is dropped and the matcher ends where it started: the
    tokens rolled back are accepted again."""
    state, out = _state_after(compiled, tokenizer, '{"name": "Ada"')
    before = (state.num_accepted, state.jump_forward_string(), _allowed(state, len(tokenizer.hf)))
    assert plan_jump(_Refusing(state), tokenizer.hf, out, max_rollback=4) is None
    assert (state.num_accepted, state.jump_forward_string(), _allowed(state, len(tokenizer.hf))) == before


@pytest.fixture(scope="module")
def llm():
    """The embedded model, run on one torch thread: on a small shared CPU two threads that wait for each other
    at every matmul make a decode step many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(device="cpu")
    torch.set_num_threads(before)


@pytest.mark.task("12.1")
def test_engine_jumps_forward_with_valid_outputs_and_fewer_steps(llm):
    """Greedy decoding of two schemas with fixed keys, with jump-forward on and off: both outputs are valid
    instances whose text is the decode of their tokens, and the jumping engine appended forced tokens and
    took fewer steps."""
    schemas = [SCHEMA, {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                        "required": ["x", "y"]}]
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in
               ("Describe Ada Lovelace as JSON with her name and age.", "Give a point on a grid as JSON.")]
    backend = llm.engine.extensions.find(StructuredOutput).backend  # the compile cache is shared
    steps, structured = {}, {}
    for jump in (False, True):
        engine = Engine(llm.model, llm.config, EngineConfig(
            disable_radix_cache=True, disable_overlap_schedule=True, chunked_prefill_size=-1,
            enable_jump_forward=jump), device="cpu", context_length=llm.context_length,
            extensions=[StructuredOutput(backend)])
        reqs = [llm.make_request(p, SamplingParams(temperature=0, max_new_tokens=40, json_schema=json.dumps(s)))
                for p, s in zip(prompts, schemas)]
        for r in reqs:
            engine.add_request(r)
        engine.run_until_done()
        for schema, r in zip(schemas, reqs):
            assert r.finish_reason.kind == "stop", (r.finish_reason, r.output_text)
            jsonschema.validate(json.loads(r.output_text), schema)
            assert r.output_text == llm.tokenizer.decode(r.output_ids)
        steps[jump], structured[jump] = engine.stats.steps, engine.extensions.find(StructuredOutput)
    assert structured[True].jump_forwards > 0 and structured[True].jump_forward_tokens > 0
    assert structured[False].jump_forwards == 0
    assert steps[True] < steps[False], steps
