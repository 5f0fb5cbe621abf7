"""Which JSON-schema keywords the grammar engine enforces, and the refusal of every other one (chapter 12).

xgrammar turns a JSON schema into a grammar, and the grammar is the whole promise: whatever the grammar allows, the
model may write. A keyword the converter does not turn into grammar is therefore not a soft hint but a hole --
xgrammar logs a warning at most and goes on, and the output may break the schema the client sent. ``uniqueItems``
is dropped, so ``["a", "a"]`` comes out; ``allOf`` with two subschemas becomes "any JSON value", so a bare ``12321``
comes out where an object was asked for. :func:`unsupported_keyword` reads a schema the way xgrammar's converter
does and names the first keyword the grammar would not enforce, with where it sits (a JSON pointer into the
schema); the admission check (:func:`~minisgl_ref.constrained.validate.validate_grammar`) then refuses the whole
schema -- an HTTP 400 on the server, a ``ValueError`` offline -- instead of returning output that may not fit.

The check is an *allow-list*: a keyword passes only if it is a pure annotation (``title``, ``description``,
``default``, ``examples``, ...), a container of definitions (``$defs``, ``definitions``), or a keyword the converter
is known to enforce exactly *where it stands*. That last clause matters, because xgrammar reads a schema object by
one rule (the first it finds of ``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf``, ``allOf``, ``type``, then
object or array keywords) and ignores everything the rule does not read:

* beside ``$ref``, ``anyOf`` or ``allOf`` every other keyword is ignored, so it is refused (move it inside);
* beside ``const`` / ``enum`` the listed values are written as they are: ``type`` is checked against them here, any
  other keyword is refused;
* without ``type`` (nor ``properties``/``items``-like keywords, which imply object or array) a schema accepts any
  JSON value, so ``{"minimum": 5}`` alone is refused;
* ``allOf`` is enforced with exactly one subschema; ``oneOf`` only when its options are provably disjoint (by
  type, by listed values, or by a required property whose values differ), since the grammar can promise "at least
  one option", not "exactly one";
* strings: ``pattern`` (without lookaround or mid-pattern anchors, which the regex engine drops), a known
  ``format``, and ``minLength``/``maxLength`` unless a pattern or format is beside them (they would be dropped);
* numbers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``; ``multipleOf`` only on integers,
  a whole number up to 1024, either unbounded or between two bounds at most 10,000 apart;
* arrays: ``items``, ``prefixItems``, ``unevaluatedItems``, ``minItems``, ``maxItems`` (``uniqueItems: false``);
  refused: ``uniqueItems: true``, ``contains``, ``minContains``, ``maxContains``, ``additionalItems``;
* objects: ``properties``, ``required`` (of names among the properties: the grammar can only force a property it
  has a schema for), ``additionalProperties``, ``unevaluatedProperties``, ``maxProperties``; ``minProperties`` when
  no key beyond the named properties can be written (a repeated extra key would count twice); ``propertyNames``
  and a single ``patternProperties`` entry only without named properties; refused: ``dependentRequired``,
  ``dependentSchemas``, ``dependencies``;
* never enforced anywhere: ``not``, ``if``/``then``/``else``, ``$anchor``/``$dynamicRef`` and any keyword not
  named above (OpenAPI's ``nullable`` included), a ``$ref`` that does not start with ``#``, and ``$id`` below the
  root (xgrammar resolves every ``$ref`` from the root).

A keyword that cannot apply where it stands is no hole and passes: ``minimum`` on a ``"type": "string"`` schema
constrains nothing, in JSON Schema as in the grammar. Only the parts of a schema the converter reads are checked:
an unreferenced definition in ``$defs`` never reaches the grammar.

One gap is left, by xgrammar's design: an object that allows extra keys could repeat a key, or spell a named
property with a ``\\u`` escape; a model writing ordinary JSON does neither.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Keywords that only describe: they never change which values are valid, so the grammar may ignore them.
#: ``discriminator`` is OpenAPI's hint beside a ``oneOf`` (pydantic writes it); ``oneOf`` itself is checked.
ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$comment", "$schema", "$id", "deprecated", "readOnly",
    "writeOnly", "discriminator",
})
#: Keywords that hold subschemas for ``$ref`` to point at; what they hold is checked where it is referenced.
DEFINITIONS = frozenset({"$defs", "definitions"})
#: ``format`` values xgrammar turns into a regular expression. (``json-pointer`` and ``relative-json-pointer`` are
#: known to it too, but their expressions let a raw ``"`` into the string, which breaks the JSON around it.)
KNOWN_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
    "uri-template",
})
BROKEN_FORMATS = frozenset({"json-pointer", "relative-json-pointer"})
#: The keywords that constrain values of each JSON type (on a value of another type, a keyword is vacuous).
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
VOCABULARY: dict[str, frozenset[str]] = {
    "null": frozenset(),
    "boolean": frozenset(),
    "integer": _NUMERIC,
    "number": _NUMERIC,
    "string": frozenset({"pattern", "format", "minLength", "maxLength", "contentEncoding", "contentMediaType",
                         "contentSchema"}),
    "array": frozenset({"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems",
                        "contains", "minContains", "maxContains", "additionalItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "unevaluatedProperties",
                         "minProperties", "maxProperties", "propertyNames", "patternProperties",
                         "dependentRequired", "dependentSchemas", "dependencies"}),
}
_TYPED_KEYWORDS = frozenset().union(*VOCABULARY.values())
#: xgrammar's limits on an integer ``multipleOf``: the divisor, and the width of a range it enumerates.
MAX_INTEGER_MULTIPLE_OF = 1024
MAX_MULTIPLE_OF_RANGE = 10_000

IGNORED = "it would be ignored and the output could break the schema"


class _Refusal(Exception):
    """The first keyword the grammar would not enforce: raised deep in the walk, caught at the top."""

    def __init__(self, keyword: str, path: str, reason: str = IGNORED) -> None:
        super().__init__(f"the keyword {keyword!r} at {path} is not supported by the grammar engine "
                         f"({reason})")


def unsupported_keyword(schema: Any) -> str | None:
    """None if xgrammar enforces every keyword of ``schema`` (a parsed JSON schema) that can constrain the output;
    else a sentence naming the first keyword it would not, where it sits, and why. The schema is assumed to be
    one xgrammar parses (the admission check asks xgrammar first); anything malformed is left to it."""
    try:
        _Walk(schema).visit(schema, "#", None)
    except _Refusal as refusal:
        return str(refusal)
    except RecursionError:
        return "the schema is nested too deeply to check which of its keywords the grammar engine enforces"
    return None


def pointer(path: str, *tokens: str | int) -> str:
    """``path`` extended by ``tokens``, escaped as a JSON pointer (``~`` -> ``~0``, ``/`` -> ``~1``)."""
    for token in tokens:
        path += "/" + str(token).replace("~", "~0").replace("/", "~1")
    return path


# ------------------------------------------------------------------------------------------------- the walk


class _Walk:
    """Visits the subschemas xgrammar reads, in its order, following ``$ref`` (each target once)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.seen: set[tuple[int, str | None]] = set()

    def visit(self, node: Any, path: str, default_type: str | None) -> None:
        if not isinstance(node, Mapping):
            return  # true accepts anything; false and non-schemas are xgrammar's to reject
        key = (id(node), default_type)
        if key in self.seen:
            return
        self.seen.add(key)
        if "$id" in node and node is not self.root:
            raise _Refusal("$id", path, "below the root it would change what a $ref points to, and the engine "
                                        "resolves every $ref from the root")
        if "$ref" in node:
            self._ref(node, path)
        elif "const" in node:
            self._listed(node, path, "const", [node["const"]])
        elif "enum" in node:
            self._listed(node, path, "enum", node["enum"])
        elif "anyOf" in node:
            self._options(node, path, "anyOf")
        elif "oneOf" in node:
            self._options(node, path, "oneOf")
            self._one_of_disjoint(node, path)
        elif "allOf" in node:
            self._all_of(node, path)
        elif "type" in node or default_type is not None:
            self._typed(node, path, _types(node.get("type", default_type), path))
        elif any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
            self._typed(node, path, {"object"})  # xgrammar writes an object here
        elif any(k in node for k in ("items", "prefixItems", "unevaluatedItems")):
            self._typed(node, path, {"array"})
        else:
            for keyword in node:
                if keyword not in ANNOTATIONS and keyword not in DEFINITIONS:
                    raise _Refusal(keyword, path, "without a 'type' beside it the engine accepts any JSON value "
                                                  "here and ignores it")

    @staticmethod
    def _only(node: Mapping[str, Any], path: str, owner: str, also: frozenset[str] = frozenset()) -> None:
        """Refuse the first keyword beside ``owner`` that is not an annotation, a definition or in ``also``."""
        for keyword in node:
            if keyword != owner and keyword not in ANNOTATIONS and keyword not in DEFINITIONS and keyword not in also:
                raise _Refusal(keyword, path, f"beside {owner!r} the engine ignores it; move it into the schema "
                                              f"{owner!r} leads to")

    # ----------------------------------------------------------------------------------- the composite rules

    def _ref(self, node: Mapping[str, Any], path: str) -> None:
        self._only(node, path, "$ref")
        ref = node["$ref"]
        if not isinstance(ref, str):
            return
        if ref != "#" and not ref.startswith("#/"):
            raise _Refusal("$ref", path, f"only references inside the schema ('#' or '#/...') are followed; "
                                         f"{ref!r} would accept any JSON value")
        target, where = self.root, "#"
        for part in (p for p in ref[2:].split("/") if p):  # as xgrammar reads it: no unescaping
            if not isinstance(target, Mapping) or part not in target:
                return  # xgrammar refuses a dangling reference itself
            target, where = target[part], pointer(where, part)
        self.visit(target, where, None)

    def _listed(self, node: Mapping[str, Any], path: str, owner: str, values: Any) -> None:
        """``const`` / ``enum``: the grammar is the list of values, written as they are, so a keyword beside it
        holds only if every value already satisfies it. ``type`` (and ``enum`` beside ``const``) is checked."""
        if not isinstance(values, list):
            return
        for keyword in node:
            if keyword == owner or keyword in ANNOTATIONS or keyword in DEFINITIONS:
                continue
            if keyword == "type":
                types = _types(node["type"], path)
                bad = next((v for v in values if not any(_has_type(v, t) for t in types)), _NONE)
                if bad is not _NONE:
                    raise _Refusal("type", path, f"beside {owner!r} the engine writes the listed values as they "
                                                 f"are, and {_short(bad)} is not of that type")
            elif keyword == "enum" and owner == "const" and isinstance(node["enum"], list):
                if not any(json_equal(values[0], v) for v in node["enum"]):
                    raise _Refusal("enum", path, "beside 'const' the engine writes the constant as it is, and "
                                                 "the enum does not list it")
            else:
                raise _Refusal(keyword, path, f"beside {owner!r} the engine writes the listed values as they are "
                                              f"and never checks them against it")

    def _options(self, node: Mapping[str, Any], path: str, owner: str) -> None:
        self._only(node, path, owner)
        options = node[owner]
        if isinstance(options, list):
            for i, option in enumerate(options):
                self.visit(option, pointer(path, owner, i), None)

    def _one_of_disjoint(self, node: Mapping[str, Any], path: str) -> None:
        options = node["oneOf"]
        if not isinstance(options, list):
            return
        shapes = [self._shape(option) for option in options]
        for i, a in enumerate(shapes):
            for j in range(i + 1, len(shapes)):
                if not _disjoint(a, shapes[j]):
                    raise _Refusal("oneOf", path, f"options {i} and {j} are not provably disjoint, and the engine "
                                                  "can only make the output match at least one option, not exactly "
                                                  "one; use anyOf if that is what you mean")

    def _all_of(self, node: Mapping[str, Any], path: str) -> None:
        self._only(node, path, "allOf")
        subschemas = node["allOf"]
        if not isinstance(subschemas, list):
            return
        if len(subschemas) != 1:
            raise _Refusal("allOf", path, f"the engine enforces allOf with one subschema only; with "
                                          f"{len(subschemas)} it would accept any JSON value")
        self.visit(subschemas[0], pointer(path, "allOf", 0), None)

    # --------------------------------------------------------------------------------------- the typed rule

    def _typed(self, node: Mapping[str, Any], path: str, types: set[str]) -> None:
        for keyword in node:
            if keyword in ANNOTATIONS or keyword in DEFINITIONS or keyword == "type":
                continue
            if keyword not in _TYPED_KEYWORDS:
                raise _Refusal(keyword, path)
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in KNOWN_FORMATS:
            reason = ("its regular expression lets a raw '\"' into the string, which breaks the JSON"
                      if fmt in BROKEN_FORMATS else f"the format {fmt!r} is not one the engine knows")
            raise _Refusal("format", path, reason)
        if "integer" in types:
            self._integer(node, path)
        if "number" in types:
            if "multipleOf" in node:
                raise _Refusal("multipleOf", path, "the engine enforces multipleOf on integers only")
        if "string" in types:
            self._string(node, path)
        if "array" in types:
            self._array(node, path)
        if "object" in types:
            self._object(node, path)

    @staticmethod
    def _integer(node: Mapping[str, Any], path: str) -> None:
        step = node.get("multipleOf")
        if step is None or not _is_number(step) or step <= 0:
            return  # absent, or malformed (xgrammar's to reject)
        if step != math.floor(step) or step > MAX_INTEGER_MULTIPLE_OF:
            raise _Refusal("multipleOf", path, f"the engine enforces it on integers for a whole number up to "
                                               f"{MAX_INTEGER_MULTIPLE_OF} only")
        low = [b for b in (_bound(node, "minimum", 0), _bound(node, "exclusiveMinimum", 1)) if b is not None]
        high = [b for b in (_bound(node, "maximum", 0), _bound(node, "exclusiveMaximum", -1)) if b is not None]
        if (low or high) and not (low and high):
            raise _Refusal("multipleOf", path, "beside a bound on one side only the engine ignores it; give both "
                                               "bounds or none")
        if low and high and min(high) - max(low) + 1 > MAX_MULTIPLE_OF_RANGE:
            raise _Refusal("multipleOf", path, f"between bounds more than {MAX_MULTIPLE_OF_RANGE:,} apart the "
                                               "engine ignores it")

    @staticmethod
    def _string(node: Mapping[str, Any], path: str) -> None:
        _refuse_any(node, path, ("contentEncoding", "contentMediaType", "contentSchema"))
        has_format = isinstance(node.get("format"), str)  # a known one: unknown ones were refused above
        if has_format and "pattern" in node:
            raise _Refusal("pattern", path, "beside a 'format' the engine writes the format and ignores the "
                                            "pattern")
        for keyword in ("minLength", "maxLength"):
            if keyword in node and (has_format or "pattern" in node):
                beside = "format" if has_format else "pattern"
                raise _Refusal(keyword, path, f"beside a {beside!r} the engine ignores the length limits")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            problem = regex_problem(pattern)
            if problem:
                raise _Refusal("pattern", path, problem)

    def _array(self, node: Mapping[str, Any], path: str) -> None:
        _refuse_any(node, path, ("uniqueItems", "contains", "minContains", "maxContains", "additionalItems"))
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            for i, item in enumerate(prefix):
                self.visit(item, pointer(path, "prefixItems", i), None)
        if "items" in node:
            self.visit(node["items"], pointer(path, "items"), None)
        elif "unevaluatedItems" in node:  # beside items it has nothing left to apply to
            self.visit(node["unevaluatedItems"], pointer(path, "unevaluatedItems"), None)

    def _object(self, node: Mapping[str, Any], path: str) -> None:
        _refuse_any(node, path, ("dependentRequired", "dependentSchemas", "dependencies"))
        properties = node.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = [name for name in node.get("required", ()) if isinstance(name, str)] \
            if isinstance(node.get("required"), list) else []
        missing = next((name for name in required if name not in properties), None)
        if missing is not None:
            raise _Refusal("required", path, f"it names {missing!r}, which is not among the properties beside "
                                             "it; the engine writes only properties it has a schema for, so it "
                                             "could leave it out")
        patterns = node.get("patternProperties")
        patterns = patterns if isinstance(patterns, Mapping) and patterns else None
        names = node.get("propertyNames")
        addl = node.get("additionalProperties", _NONE)
        uneval = node.get("unevaluatedProperties", _NONE)
        # The values an extra key (one not among the properties) may take, as the grammar writes them.
        extra = addl if addl is not _NONE else uneval
        if patterns is not None:
            if len(patterns) != 1 or properties or names is not None:
                raise _Refusal("patternProperties", path, "the engine enforces it only alone: one pattern, with "
                                                          "no properties or propertyNames beside it")
            ((key, value),) = patterns.items()
            problem = regex_problem(key) if isinstance(key, str) else None
            if problem:
                raise _Refusal("patternProperties", path, problem)
            self.visit(value, pointer(path, "patternProperties", key), None)
        elif names is not None:
            if properties or extra is False:
                raise _Refusal("propertyNames", path, "the engine enforces it only on an object without named "
                                                      "properties whose extra keys are allowed")
            self.visit(names, pointer(path, "propertyNames"), "string")
        open_ = patterns is not None or names is not None or (extra is not _NONE and extra is not False)
        least = node.get("minProperties")
        if _is_number(least) and least > len(set(required)) and open_:
            raise _Refusal("minProperties", path, "on an object that allows keys beyond its named properties the "
                                                  "engine counts keys as written, and a repeated key would count "
                                                  "twice")
        for name, sub in properties.items():
            self.visit(sub, pointer(path, "properties", name), None)
        if patterns is None:
            if isinstance(addl, Mapping):
                self.visit(addl, pointer(path, "additionalProperties"), None)
            elif addl is _NONE and isinstance(uneval, Mapping):
                self.visit(uneval, pointer(path, "unevaluatedProperties"), None)

    # ------------------------------------------------------------------------------------ oneOf's options

    def _resolve(self, node: Any, hops: int = 32) -> Any:
        """``node`` with ``$ref`` (local) and one-subschema ``allOf`` followed, for the disjointness proof."""
        while hops and isinstance(node, Mapping):
            hops -= 1
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                target = self.root
                for part in (p for p in ref[2:].split("/") if p):
                    target = target.get(part) if isinstance(target, Mapping) else None
                node = target
            elif isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
                node = node["allOf"][0]
            else:
                break
        return node

    def _shape(self, option: Any) -> _Shape:
        """A superset of the values ``option`` accepts, in the terms the disjointness proof compares."""
        node = self._resolve(option)
        if not isinstance(node, Mapping):
            return _Shape(frozenset(_KINDS) if node is not False else frozenset())
        kinds = frozenset(_KINDS)
        if "type" in node:
            kinds = frozenset(k for t in _types(node["type"], "#") for k in _KINDS_OF.get(t, ()))
        values = None
        if "const" in node:
            values = (node["const"],)
        elif isinstance(node.get("enum"), list):
            values = tuple(node["enum"])
        tags: dict[str, tuple[Any, ...]] = {}
        properties = node.get("properties")
        if isinstance(properties, Mapping) and isinstance(node.get("required"), list):
            for name in node["required"]:
                prop = self._resolve(properties.get(name)) if isinstance(name, str) else None
                if isinstance(prop, Mapping) and "const" in prop:
                    tags[name] = (prop["const"],)
                elif isinstance(prop, Mapping) and isinstance(prop.get("enum"), list):
                    tags[name] = tuple(prop["enum"])
        return _Shape(kinds, values, tags)


# ----------------------------------------------------------------------------------------------- helpers

_NONE = object()  # "absent", where None (JSON null) is a value
#: JSON values by kind; "number" spans integers and the other numbers.
_KINDS = ("null", "boolean", "integer", "fraction", "string", "array", "object")
_KINDS_OF = {"null": ("null",), "boolean": ("boolean",), "integer": ("integer",), "number": ("integer", "fraction"),
             "string": ("string",), "array": ("array",), "object": ("object",)}


@dataclass(frozen=True)
class _Shape:
    """A superset of what one ``oneOf`` option accepts: values of these kinds, one of ``values`` if given, and
    (if an object) with each key of ``tags`` holding one of its values."""

    kinds: frozenset[str]
    values: tuple[Any, ...] | None = None
    tags: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def may_hold(self, value: Any) -> bool:
        if self.values is not None and not any(json_equal(value, v) for v in self.values):
            return False
        if _kind(value) not in self.kinds:
            return False
        if isinstance(value, Mapping):
            return all(k in value and any(json_equal(value[k], v) for v in vs) for k, vs in self.tags.items())
        return True


def _disjoint(a: _Shape, b: _Shape) -> bool:
    """Can no value be accepted by both? (False when unsure: the proof is sound, not complete.)"""
    if a.values is not None:
        return not any(b.may_hold(v) for v in a.values)
    if b.values is not None:
        return not any(a.may_hold(v) for v in b.values)
    common = a.kinds & b.kinds
    if not common:
        return True
    if common == {"object"}:
        return any(not any(json_equal(x, y) for x in a.tags[k] for y in b.tags[k]) for k in a.tags.keys() & b.tags)
    return False


def _refuse_any(node: Mapping[str, Any], path: str, keywords: tuple[str, ...]) -> None:
    """Refuse the first of ``keywords`` that ``node`` uses, in the node's own order (``uniqueItems: false``
    asks for nothing, so it passes)."""
    for keyword in node:
        if keyword in keywords and not (keyword == "uniqueItems" and node[keyword] is False):
            raise _Refusal(keyword, path)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "fraction"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Sequence):
        return "array"
    return "object"


def _has_type(value: Any, type_: str) -> bool:
    return _kind(value) in _KINDS_OF.get(type_, ())


def json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values as JSON Schema sees it: ``1 == 1.0``, but ``true != 1``."""
    ka, kb = _kind(a), _kind(b)
    numbers = ("integer", "fraction")
    if ka in numbers and kb in numbers:
        return a == b
    if ka != kb:
        return False
    if ka == "array":
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if ka == "object":
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return a == b


def _types(value: Any, path: str) -> set[str]:
    """The ``type`` keyword as a set; an empty list would make xgrammar accept any value, so it is refused."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        if not value:
            raise _Refusal("type", path, "an empty list of types would make the engine accept any JSON value")
        return {t for t in value if isinstance(t, str)}
    return set()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bound(node: Mapping[str, Any], keyword: str, shift: int) -> int | None:
    """An integer's bound as the inclusive integer it means (an exclusive one moved by ``shift``), or None. Only
    whole numbers are read: xgrammar refuses any other bound on an integer itself."""
    value = node.get(keyword)
    if not _is_number(value) or value != math.floor(value):
        return None
    return int(value) + shift


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def regex_problem(pattern: str) -> str | None:
    """Why xgrammar's regex engine would not enforce ``pattern`` as written, or None. It drops lookaround
    assertions (``(?=``, ``(?!``, ``(?<=``, ``(?<!``) and ``^`` / ``$`` anywhere but at the very start and end,
    with a warning, so the output could break them. (It fully matches a pattern, where JSON Schema searches, which
    only makes the output stricter.)"""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + (pattern.startswith("^", i + 1))
            if pattern.startswith("]", i):
                i += 1  # a ']' first in a class is a literal
            continue
        elif c == "(" and pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return "the regex engine ignores lookaround assertions in a pattern"
        elif (c == "^" and i != 0) or (c == "$" and i != n - 1):
            return f"the regex engine ignores a {c!r} anywhere but at the very {'start' if c == '^' else 'end'}"
        i += 1
    return None


def check_schema_support(schema: str | Mapping[str, Any] | bool) -> None:
    """Raise ``ValueError("json_schema: the keyword ...")`` if ``schema`` (JSON text or parsed) uses a keyword
    the grammar would not enforce; see :func:`unsupported_keyword`. Text that is not JSON is left to the parser."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return
    reason = unsupported_keyword(schema)
    if reason is not None:
        raise ValueError(f"json_schema: {reason}")


# ------------------------------------------------------------------------------------ moving definitions

#: Keywords whose value is one subschema, a list of them, or a map of names to them: the places where a
#: ``$ref`` is a reference (anywhere else, e.g. inside ``const`` or ``default``, it is data).
_ONE_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
                  "contains", "not", "if", "then", "else", "additionalItems", "contentSchema")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def map_refs(schema: Any, change: Any) -> Any:
    """A copy of ``schema`` with every ``$ref`` string passed through ``change`` (a function of the string)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    if isinstance(out.get("$ref"), str):
        out["$ref"] = change(out["$ref"])
    for keyword in _ONE_SUBSCHEMA:
        if isinstance(out.get(keyword), Mapping):
            out[keyword] = map_refs(out[keyword], change)
    for keyword in _SUBSCHEMA_LISTS:
        if isinstance(out.get(keyword), list):
            out[keyword] = [map_refs(s, change) for s in out[keyword]]
    for keyword in _SUBSCHEMA_MAPS:
        if isinstance(out.get(keyword), Mapping):
            out[keyword] = {k: map_refs(s, change) for k, s in out[keyword].items()}
    return out


def hoist_definitions(schema: Any, prefix: str, defs: dict[str, Any]) -> Any:
    """``schema`` made ready to sit *inside* another schema whose root will hold ``defs`` as its ``$defs``.

    A ``$ref`` is resolved from the root of the document, so once a schema is nested under another, its
    ``#/$defs/Address`` no longer points at its own definitions. Its ``$defs`` and ``definitions`` move into
    ``defs``, under fresh names that start with ``prefix`` (``get_weather.Address``; a taken name gets a number),
    and its references are rewritten to match. A reference to the schema's own root (``#``) or into its body
    (``#/properties/...``) makes the body a definition too, and the schema returned is a ``$ref`` to it -- which
    keeps recursive schemas recursive. Root-only keywords (``$id``, ``$schema``) are dropped."""
    if not isinstance(schema, Mapping):
        return schema
    moved: dict[str, str] = {}  # "#/$defs/Address" -> "#/$defs/get_weather.Address"
    for container in ("$defs", "definitions"):
        held = schema.get(container)
        for name in held if isinstance(held, Mapping) else ():
            moved[f"#/{container}/{name}"] = "#/$defs/" + _fresh(f"{prefix}.{name}", defs)
    body_name: list[str] = []  # the body's own name, once a reference needs one

    def change(ref: str) -> str:
        if ref != "#" and not ref.startswith("#/"):
            return ref  # not a local reference: the support check refuses it
        parts = [p for p in ref[2:].split("/") if p]
        head = "#/" + "/".join(parts[:2])
        if len(parts) >= 2 and head in moved:
            return "/".join([moved[head], *parts[2:]])
        if not body_name:
            body_name.append(_fresh(prefix, defs))
        return "/".join(["#/$defs/" + body_name[0], *parts])

    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$id", "$schema")}
    body = map_refs(body, change)
    for container in ("$defs", "definitions"):
        held = schema.get(container)
        for name, sub in held.items() if isinstance(held, Mapping) else ():
            defs[moved[f"#/{container}/{name}"][len("#/$defs/"):]] = map_refs(sub, change)
    if body_name:
        defs[body_name[0]] = body
        return {"$ref": "#/$defs/" + body_name[0]}
    return body


def _fresh(name: str, taken: dict[str, Any]) -> str:
    """``name``, or ``name_2``, ``name_3``, ... : the first not in ``taken``, which it then reserves."""
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    taken[candidate] = None  # reserved; the caller fills it in
    return candidate
