"""Tool calling on the chat API: OpenAI's ``tools`` and ``tool_choice`` for a model that can only write text
(chapter 10).

A language model never calls a function. It writes text, and a *convention* turns some of that text into a
call: the prompt describes the functions and asks for a call in a fixed shape, and the server recognises that
shape in the output and returns it as structured ``tool_calls`` instead of ``content``. This module holds the
four pieces of that convention:

1. **The prompt** (:func:`tool_prompt`, :func:`render_messages`). A chat template that knows about tools
   (Qwen2.5, Llama 3.1, ...) renders them itself, from ``apply_chat_template(..., tools=...)``. A template that
   does not (the embedded SmolLM2's) gets a system prompt written here, in the Hermes / Qwen style that many
   open models were trained on: the functions as JSON inside ``<tools>``, each call as
   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Earlier turns are rewritten the same way: an
   assistant's ``tool_calls`` become ``<tool_call>`` text, and a ``tool`` message (a function's result) becomes a
   user turn holding ``<tool_response>`` text, because such a template knows no other roles.
2. **The grammar** (:func:`call_schema`). ``tool_choice: "required"`` and a named function are *promises*: the
   answer is a call, and its arguments fit the function's JSON schema. A prompt cannot promise anything to a
   135M-parameter model, so these two modes constrain decoding with a JSON schema built from the tools (see
   :mod:`minisgl_ref.constrained`): the output *is* the JSON of the calls, valid by construction. The promise is
   only as good as the grammar, so in these two modes a tool whose parameters use a JSON-schema keyword the
   grammar would not enforce (:mod:`minisgl_ref.constrained.schema_support`) is refused by name. In ``"auto"``
   a schema is only text in the prompt -- unless a tool is ``strict``: then the answer is constrained by a
   *structural tag* (:func:`call_structural_tag`), free text until ``<tool_call>`` and from there a call head
   naming one of the functions, arguments that fit its schema and the closing tag, so every call the model
   chooses to make is valid (SGLang's way; the same keyword check applies).
3. **The parser** (:class:`ToolCallParser`). ``"auto"`` leaves the choice to the model, so whether to call is
   never constrained: the parser finds ``<tool_call>`` blocks in whatever the model wrote, returns them as calls and the rest as
   content. If the model called nothing, the whole text is the content.
4. **Streaming.** The same parser runs on the streamed text, one chunk at a time, and says what can be sent so
   far: content up to (not into) anything that may be the start of a ``<tool_call>`` tag, a call's id and name as
   soon as its head ``{"name": "f", "arguments": `` has been read, then its arguments as they are written. The
   non-streaming answer is the same parser fed the whole text at once, so the two always agree, however the
   text was split into chunks (tests/test_server_structured.py checks that with arbitrary splits).

``tool_choice: "none"`` leaves the tools out of the prompt altogether: the model is not invited to call them, and
whatever it writes is content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import regex

from minisgl_ref.constrained.schema_support import hoist_definitions
from minisgl_ref.server.protocol import APIError

# ---------------------------------------------------------------------------------------------- the tools


@dataclass(frozen=True)
class Function:
    """One function the model may call (OpenAI's ``tools[i].function``, after validation)."""

    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of the arguments object

    def spec(self) -> dict[str, Any]:
        """The function as the prompt shows it: OpenAI's own shape, which is also what Hermes-style models read."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


#: A function's arguments when its ``parameters`` are left out: OpenAI's meaning is "takes no arguments".
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's ``tools`` and ``tool_choice`` mean for this answer."""

    functions: tuple[Function, ...]
    mode: Mode
    named: str | None = None  # the one function to call, in mode "named"
    parallel: bool = True  # parallel_tool_calls: may one answer hold several calls?

    @property
    def active(self) -> bool:
        """Does the answer go through the tool-call parser (any mode but "none")?"""
        return self.mode != "none"

    @property
    def constrained(self) -> bool:
        """Is the answer forced to be calls, by a grammar?"""
        return self.mode in ("required", "named")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)


def plan_tools(functions: Sequence[Function], tool_choice: Any, parallel: bool = True) -> ToolPlan:
    """Check ``tool_choice`` against the tools and decide the mode; a 400 naming the field for any mismatch.

    OpenAI's defaults: ``"auto"`` when tools are given, ``"none"`` when not."""
    names = [f.name for f in functions]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise APIError(400, f"tools: the function name {dup!r} appears more than once", param="tools")
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or "
                                f'{{"type": "function", "function": {{"name": ...}}}} (got {tool_choice!r})',
                           param="tool_choice")
        if tool_choice != "none" and not functions:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools, and the request gives none",
                           param="tool_choice")
        return ToolPlan(tuple(functions), tool_choice, parallel=parallel)  # type: ignore[arg-type]
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, 'tool_choice must be a string or {"type": "function", "function": {"name": ...}} '
                            f"(got {json.dumps(tool_choice)[:80]})", param="tool_choice")
    if name not in names:
        known = ", ".join(repr(n) for n in names) or "none"
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools ({known})",
                       param="tool_choice")
    return ToolPlan(tuple(functions), "named", named=name, parallel=False)


def call_schema(plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema that the output of a ``"required"`` or named-function answer must follow.

    One call is ``{"name": <the name>, "arguments": <that function's parameters>}``, with ``name`` pinned by
    ``const`` so that the arguments' schema is the one of the function named (``anyOf`` over the functions when
    there are several). The properties come in that order (the grammar keeps the schema's order), so that the
    parser can send the name before the arguments are written. With ``parallel_tool_calls`` (OpenAI's default),
    ``"required"`` asks for a non-empty array of calls; otherwise for exactly one call.

    A function's parameters are nested two levels down here, and a ``$ref`` is resolved from the root of the
    whole schema: each function's ``$defs`` / ``definitions`` therefore move to the root, under names that start
    with the function's (``get_weather.Address``), with its references rewritten to match
    (:func:`~minisgl_ref.constrained.schema_support.hoist_definitions`). That is what a tool made from a pydantic
    model with nested models needs (``openai.pydantic_function_tool``); two tools may use the same names."""
    functions = plan.functions if plan.mode == "required" else [f for f in plan.functions if f.name == plan.named]
    defs: dict[str, Any] = {}
    calls = [{"type": "object",
              "properties": {"name": {"const": f.name}, "arguments": hoist_definitions(f.parameters, f.name, defs)},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1} if plan.mode == "required" and plan.parallel else one
    return {**schema, "$defs": defs} if defs else schema


def call_structural_tag(plan: ToolPlan) -> dict[str, Any]:
    """The structural tag that keeps an ``"auto"`` answer's calls to their functions' schemas (strict tools).

    The text stays free until the model writes ``<tool_call>``; from there it must go on with one of the
    functions' call heads, exactly as the prompt teaches it and the parser reads it (``<tool_call>`` newline
    ``{"name": "f", "arguments": ``), then arguments that fit that function's parameters, then ``}`` newline
    ``</tool_call>``; after that the text is free again. Every function gets its structure, strict or not, once
    one of them is strict: the model picks the function after the trigger, so the grammar must know them all."""
    structures = [{"begin": f"{CALL_OPEN}\n{{\"name\": {json.dumps(f.name, ensure_ascii=False)}, \"arguments\": ",
                   "schema": f.parameters, "end": f"}}\n{CALL_CLOSE}"} for f in plan.functions]
    return {"type": "structural_tag", "structures": structures, "triggers": [CALL_OPEN]}


# ------------------------------------------------------------------------------------------------ the prompt

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def tool_prompt(plan: ToolPlan) -> str:
    """The system prompt that describes the tools, for a chat template that cannot render them itself.

    Its last paragraph tells the model the shape its answer must take in this mode: tagged calls when it may
    choose (``"auto"``), or the bare JSON that the grammar of ``"required"`` / a named function will force."""
    listing = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in plan.functions)
    lines = [
        "# Tools",
        "",
        "You can call functions to help you answer. Each function is described by a JSON object inside the "
        "<tools></tools> tags:",
        "<tools>",
        listing,
        "</tools>",
        "",
    ]
    if plan.mode == "auto":
        lines += [
            "To call a function, write a JSON object with its name and its arguments between <tool_call> and "
            "</tool_call> tags:",
            f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n{CALL_CLOSE}',
            "The arguments must follow the function's parameters schema. "
            + ("You may make several calls, one pair of tags each. " if plan.parallel else
               "Make at most one call. ")
            + "If no function is needed, answer the user directly, without tags.",
        ]
    elif plan.mode == "named":
        lines += [f"Call the function {plan.named!r} now. Answer with the call alone, as one JSON object:",
                  f'{{"name": "{plan.named}", "arguments": <the arguments as a JSON object>}}']
    else:
        shape = '{"name": <function name>, "arguments": <the arguments as a JSON object>}'
        if plan.parallel:
            lines += ["Call one or more of the functions now. Answer with the calls alone, as a JSON array of "
                      f"objects: [{shape}, ...]"]
        else:
            lines += [f"Call one of the functions now. Answer with the call alone, as one JSON object: {shape}"]
    return "\n".join(lines)


def template_renders_tools(tokenizer: Any) -> bool:
    """Does the tokenizer's chat template use a ``tools`` variable? (A dict of templates, transformers' way of
    shipping a separate ``tool_use`` one, counts if any of them does.)"""
    import jinja2
    import jinja2.meta

    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template]
    env = jinja2.Environment()
    for source in sources:
        if not isinstance(source, str):
            continue
        try:
            if "tools" in jinja2.meta.find_undeclared_variables(env.parse(source)):
                return True
        except jinja2.TemplateSyntaxError:
            continue
    return False


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, template_tools: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the ``tools`` argument for ``apply_chat_template``.

    ``messages`` are already checked: plain strings as content, assistant ``tool_calls`` in OpenAI's shape, tool
    results with ``role: "tool"``. A template that renders tools (``template_tools``) gets them as they are
    (arguments decoded to objects, which is what such templates expect) and the tools as its ``tools`` argument;
    any other template gets the text conventions of the module docstring, with the tool prompt in the system
    message (after the client's own system text, if any)."""
    active = plan is not None and plan.active
    if template_tools:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                            "arguments": _decoded(c["function"]["arguments"])}}
                                         for c in m["tool_calls"]]}
            out.append(m)
        return out, [f.spec() for f in plan.functions] if active else None

    out = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                "arguments": _decoded(c["function"]["arguments"])},
                                               ensure_ascii=False) + f"\n{CALL_CLOSE}"
                for c in m["tool_calls"])
            text = m.get("content") or ""
            m = {"role": "assistant", "content": f"{text}\n{calls}" if text else calls}
        else:
            m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if active:
        prompt = tool_prompt(plan)  # type: ignore[arg-type]
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _decoded(arguments: str) -> Any:
    """Arguments as a template wants them: the object, if the string is JSON (it should be), else the string."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------------------ the parser


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the JSON text of the arguments object, as the model wrote it

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls[i]``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What one :meth:`ToolCallParser.feed` made ready to send: content, and tool-call pieces in the shape of
    OpenAI's streamed ``delta.tool_calls`` entries (``index`` always; ``id``, ``type`` and ``name`` in a call's
    first piece; ``arguments`` fragments after)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    #: The same content (as strings) and tool-call pieces, in the order the text held them. Chat keeps content and
    #: calls in separate fields and needs no order; the Responses API makes them one list of output items.
    pieces: list[str | dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


#: The start of a call object, up to the ``{`` that opens its arguments. Matched with ``partial=True``: while the
#: text read so far could still become such a head, the parser waits for more.
_HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\x00-\x1f]|\\.)*)"\s*,\s*"arguments"\s*:\s*\{')
_ARRAY_START = regex.compile(r"\s*\[")
_TAIL = regex.compile(r"\s*\}\s*</tool_call>")
_WS = " \t\n\r"

Form = Literal["tagged", "object", "array"]


class ToolCallParser:
    """Splits a model's output into content and tool calls, incrementally.

    ``form`` is the shape of the output: ``"tagged"`` for free text with ``<tool_call>`` blocks (mode ``"auto"``),
    ``"object"`` for one bare call object and ``"array"`` for a JSON array of them (what the grammar of
    ``"required"`` / a named function produces). Call :meth:`feed` with each piece of text and :meth:`finish`
    at the end; each returns the :class:`Delta` that became certain. :attr:`content` and :attr:`calls` hold the
    whole answer so far.

    A call is sent as soon as its head has been read, if it names one of ``names``, and its arguments are then
    passed through as written, up to the ``}`` that closes them (found by tracking strings and nesting, not by
    parsing). A block whose head is shaped differently (``arguments`` before ``name``, say) is kept back until
    it closes and then parsed whole. A block that is not a valid call of a known function is content: the client
    sees exactly what the model wrote.

    Whitespace next to a call block is not content (a model puts newlines around its tags); other whitespace is
    sent once something else follows it, so that a stream and a whole answer agree on it.
    """

    def __init__(self, names: Collection[str], form: Form = "tagged") -> None:
        self.names = frozenset(names)
        self.form = form
        self.content = ""
        self.calls: list[ToolCall] = []
        self._buf = ""  # text read but not yet decided
        self._ws = ""  # whitespace held back (see the class docstring)
        self._after_call = False  # whitespace right after a call block is dropped
        self._state = {"tagged": "text", "object": "head", "array": "array_start"}[form]
        self._depth = 0  # nesting inside the arguments being passed through
        self._in_string = self._escaped = False
        self._out = Delta()

    # -------------------------------------------------------------------------------------- public

    def feed(self, text: str) -> Delta:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> Delta:
        self._run(final=True)
        state = self._state
        if state == "text":
            self._text(self._buf, final=True)
        elif state in ("head", "block"):  # a call block the output ended inside
            raw = self._buf
            if self.form == "tagged":
                self._whole_block(raw, closed=False)
            else:
                self._whole_bare(raw)
        self._buf = ""
        self._state = "done"
        return self._take()

    # ------------------------------------------------------------------------------------ machinery

    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out

    def _run(self, final: bool) -> None:
        progress = True
        while progress and self._buf:
            progress = getattr(self, "_step_" + self._state)(final)

    def _step_text(self, final: bool) -> bool:
        i = self._buf.find(CALL_OPEN)
        if i >= 0:
            self._text(self._buf[:i], final=False)  # whitespace before the tag waits: dropped if it is a call
            self._buf = self._buf[i + len(CALL_OPEN):]
            self._state = "head"
            return True
        keep = _partial_suffix(self._buf, CALL_OPEN)  # may be the start of a tag: wait
        self._text(self._buf[: len(self._buf) - keep], final=False)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _step_array_start(self, final: bool) -> bool:
        m = _ARRAY_START.match(self._buf, partial=True)
        if m is None:  # not the array the grammar promised: parse what there is at the end
            self._state = "block"
            return True
        if m.partial:
            return False
        self._buf = self._buf[m.end():]
        self._state = "head"
        return True

    def _step_head(self, final: bool) -> bool:
        m = _HEAD.match(self._buf, partial=True)
        if m is not None and m.partial:
            return False
        name = _json_string(m.group(1)) if m is not None else None
        if name is None or name not in self.names:
            self._state = "block"  # parse it whole once it ends
            return True
        call = ToolCall(new_call_id(), name, "")
        self.calls.append(call)
        self._ws = ""  # whitespace before a call is not content
        self._emit_call_piece({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
        self._buf = self._buf[m.end() - 1:]  # from the "{" that opens the arguments
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        return True

    def _step_arguments(self, final: bool) -> bool:
        """Pass the arguments through up to the ``}`` that closes them."""
        end = None
        for j, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "<" and self.form == "tagged":  # never in JSON outside a string: the arguments are
                end = j  # broken off (by a closing tag, say); skip to the end of the block
                break
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = j + 1
                    break
        piece = self._buf if end is None else self._buf[:end]
        self._arguments(piece)
        self._buf = "" if end is None else self._buf[end:]
        if end is not None:
            self._state = "tail"
        return end is not None

    def _step_tail(self, final: bool) -> bool:
        """After the arguments: skip the rest of the call, up to its closing tag (or the call object's ``}``).

        A tagged call usually ends ``}</tool_call>``. If the model closes the object and then writes something
        else, the call ends at that ``}`` and the rest is content again; other keys after the arguments are
        skipped up to the closing tag."""
        if self.form != "tagged":
            i = self._buf.find("}")
            if i < 0:
                self._buf = ""
                return False
            self._buf = self._buf[i + 1:]
            self._end_call("done" if self.form == "object" else "array_next")
            return True
        m = _TAIL.match(self._buf, partial=True)
        if m is not None and m.partial:
            return False
        if m is not None:
            self._buf = self._buf[m.end():]
        elif self._buf.lstrip(_WS).startswith("}"):  # closed, but no tag follows: the call ends here
            self._buf = self._buf.lstrip(_WS)[1:]
        else:
            i = self._buf.find(CALL_CLOSE)
            if i < 0:
                return False
            self._buf = self._buf[i + len(CALL_CLOSE):]
        self._end_call("text")
        return True

    def _end_call(self, state: str) -> None:
        self._after_call = True
        self._state = state

    def _step_array_next(self, final: bool) -> bool:
        rest = self._buf.lstrip(_WS)
        if not rest:
            self._buf = ""
            return False
        if rest[0] == ",":
            self._buf = rest[1:]
            self._state = "head"
        else:  # "]", or anything the grammar would not have allowed: the answer is over
            self._buf = ""
            self._state = "done"
        return True

    def _step_block(self, final: bool) -> bool:
        if self.form != "tagged":
            return False  # a bare answer is parsed whole by finish()
        i = self._buf.find(CALL_CLOSE)
        if i < 0:
            return False
        self._whole_block(self._buf[:i], closed=True)
        self._buf = self._buf[i + len(CALL_CLOSE):]
        self._state = "text"
        return True

    def _step_done(self, final: bool) -> bool:
        self._buf = ""  # the grammar has ended the answer; nothing more can follow
        return False

    # ---------------------------------------------------------------------------------- output

    def _text(self, text: str, final: bool) -> None:
        """Content, with whitespace at its end held back until something else follows (or dropped at a tag)."""
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_call = False
        if final:
            if not self.calls:  # an answer without calls is the model's text, all of it
                text = self._ws + text
            elif text:
                text = self._ws + text.rstrip(_WS)
            self._ws = ""
            self._emit_content(text)
            return
        body = text.rstrip(_WS)
        if body:
            self._emit_content(self._ws + body)
            self._ws = text[len(body):]
        else:
            self._ws += text

    def _emit_content(self, text: str) -> None:
        if text:
            self.content += text
            self._out.content += text
            self._out.pieces.append(text)

    def _emit_call_piece(self, piece: dict[str, Any]) -> None:
        self._out.tool_calls.append(piece)
        self._out.pieces.append(piece)

    def _arguments(self, piece: str) -> None:
        if piece:
            self.calls[-1].arguments += piece
            self._emit_call_piece({"index": len(self.calls) - 1, "function": {"arguments": piece}})

    def _whole_call(self, obj: Any) -> bool:
        """Add ``obj`` as a finished call if it is one: ``{"name": <known>, "arguments": {...}}`` (``parameters``
        is accepted for ``arguments``, and arguments given as a JSON string are decoded)."""
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return False
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return False
        if not isinstance(args, dict):
            return False
        call = ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        self._ws = ""
        index = len(self.calls) - 1
        self._emit_call_piece({"index": index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
        self._emit_call_piece({"index": index, "function": {"arguments": call.arguments}})
        return True

    def _whole_block(self, raw: str, closed: bool) -> None:
        """A tagged block that was not passed through: a call if it parses as one, else content as written."""
        try:
            ok = self._whole_call(json.loads(raw))
        except ValueError:
            ok = False
        if ok:
            self._ws = ""
            self._after_call = True
        else:
            self._text(CALL_OPEN + raw + (CALL_CLOSE if closed else ""), final=not closed)

    def _whole_bare(self, raw: str) -> None:
        """The rest of a bare (grammar-shaped) answer that was not passed through: calls if it reads as such,
        else content as written. (It happens when a schema reordered the keys, or the output was cut short.)"""
        decoder = json.JSONDecoder()
        rest = raw.lstrip(_WS)
        if self.form == "array" and rest.startswith("["):
            rest = rest[1:]
        objs = []
        while True:
            rest = rest.lstrip(_WS + ",")
            if not rest or rest[0] == "]":
                break
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:
                objs = None
                break
            objs.append(obj)
            rest = rest[end:]
        if not objs or not all(isinstance(o, dict) and o.get("name") in self.names for o in objs):
            self._text(raw, final=True)
            return
        for obj in objs:
            if not self._whole_call(obj):
                self._text(json.dumps(obj, ensure_ascii=False), final=True)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _json_string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None
