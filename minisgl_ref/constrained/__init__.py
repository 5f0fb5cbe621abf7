"""Structured output: constrained decoding with xgrammar (chapter 12).

A request can ask that its output be valid JSON for a schema, match a regular expression, or be a sentence of a
grammar. The engine then bans, at every step, each token that would make the output leave the grammar: before
sampling, the logits of the forbidden tokens become ``-inf``. xgrammar (SGLang's default grammar backend) does the
grammar work; this package adapts it to the engine, one mechanism per module:

=================================  ==============================================================================
:mod:`~.spec`                      which grammar a request asks for (kind + source), and error messages
:mod:`~.validate`                  the admission check: is the grammar valid? (no model or tokenizer needed)
:mod:`~.schema_support`            which JSON-schema keywords the grammar enforces; the refusal of the others
:mod:`~.structural_tag`            SGLang's structural tag (free text, triggered structures) as xgrammar's
:mod:`~.backend`                   compiling grammars for the model's vocabulary: cached, on a thread pool
:mod:`~.matcher`                   one request's position in its grammar: accept, mask row, termination, jump
:mod:`~.bitmask`                   packing the batch's masks and applying them to the logits on their device
:mod:`~.jump_forward`              appending forced text without decode steps, with retokenization
:mod:`~.extension`                 the engine extension: what the engine's loop does for a constrained request
=================================  ==============================================================================

**Asking for a grammar** (SGLang's sampling-parameter names, on :class:`~minisgl_ref.sampling.params.SamplingParams`;
at most one per request, else ``ValueError`` naming the fields):

* ``json_schema``: a JSON schema as a JSON string (offline, a dict is serialised for you);
* ``json_schema=ANY_JSON`` (the string ``"$$ANY$$"``, SGLang's own sentinel): any JSON object, with any
  properties and values. This is what OpenAI's ``response_format={"type": "json_object"}`` maps to; spelling
  it as a sentinel keeps "whatever object the model likes" apart from a user's schema in logs and caches;
* ``regex``: the whole output matches this regular expression;
* ``ebnf``: the output is a sentence of this grammar (xgrammar's EBNF dialect, start rule ``root``);
* ``structural_tag``: free text until a trigger, then one of the listed structures (begin string, JSON for a
  schema, end string), then free text again (:mod:`~.structural_tag`). This is how strict tools are honoured
  under ``tool_choice: "auto"``: every call the model chooses to write fits its function's schema.

A server maps OpenAI's ``response_format`` this way: ``{"type": "json_schema", "json_schema": {"schema": S}}`` ->
``json_schema=json.dumps(S)``; ``{"type": "json_object"}`` -> ``json_schema=ANY_JSON``; ``{"type": "text"}`` ->
nothing. Forcing a tool call is a JSON schema too (the call's arguments schema, or an ``anyOf`` over the tools).

**Rejecting bad grammars early.** ``validate_grammar(params)`` raises ``ValueError`` (message: the field name and
xgrammar's reason) for a schema, regex or grammar xgrammar cannot parse, and for a JSON schema that uses a keyword
xgrammar would silently skip (``uniqueItems``, ``not``, ``allOf`` of several subschemas, ...: the message names
the keyword and its place in the schema, see :mod:`~.schema_support`); the server calls it at admission and
answers HTTP 400. It needs no tokenizer and caches its verdicts. Offline, ``LLM.generate`` calls it before
anything runs. A grammar that still fails to compile in the engine aborts only its own request (finish reason
``abort`` with the message).
"""

from minisgl_ref.constrained.spec import GrammarSpec, grammar_error, spec_of
from minisgl_ref.constrained.validate import validate_grammar
from minisgl_ref.sampling.params import ANY_JSON, GRAMMAR_FIELDS

__all__ = ["ANY_JSON", "GRAMMAR_FIELDS", "GrammarSpec", "grammar_error", "spec_of", "validate_grammar"]
