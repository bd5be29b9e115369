"""Explicit bounds on structured-output constraints, checked before anything compiles them.

Knows: the documented limits (module constants; docs/structured_output.md lists them), how to
measure a JSON schema (size, nesting depth, enum values, property definitions, regex patterns)
with an iterative walk (no recursion, so a schema nested 100k deep is measured, not a
``RecursionError``), how deep a regex's groups nest, and how many rules an EBNF grammar has.
Must not know: the grammar library, HTTP (``LimitError`` names the limit; callers name the
request field). Pure Python.

Why limits: xgrammar's compile time grows faster than linearly in enum values and optional
properties (measured in docs/structured_output.md), Python's ``re`` and ``jsonschema`` recurse
once per nesting level, and every one of those ran on the server's threads.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_SCHEMA_BYTES = 256 * 1024  # a JSON schema's compact JSON text
MAX_SCHEMA_DEPTH = 48  # JSON objects/arrays nested in a schema document (24 levels of nested object properties)
MAX_ENUM_VALUES = 5_000  # enum entries + const values in one schema; also the guided_choice list length
MAX_PROPERTIES = 5_000  # property definitions (``properties`` / ``patternProperties`` entries) in one schema
MAX_REGEX_CHARS = 8_192  # a regex: guided_regex, or a schema's ``pattern`` / ``patternProperties`` key
MAX_REGEX_NESTING = 64  # groups nested in one regex
MAX_GRAMMAR_BYTES = 256 * 1024  # an EBNF grammar's text
MAX_GRAMMAR_RULES = 2_000  # rules (``name ::= ...``) in an EBNF grammar
MAX_CHOICE_BYTES = 256 * 1024  # guided_choice strings together
MAX_LOGIT_BIAS_ENTRIES = 1_024  # logit_bias keys in one request

_RULE = re.compile(r"^\s*[A-Za-z_][\w\-.]*\s*::=", re.MULTILINE)


class LimitError(ValueError):
    """A constraint past one of the limits above; ``limit`` is the constant's name."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


def _over(what: str, value: int, limit: int, name: str) -> LimitError:
    return LimitError(f"{what}: {value} is past qserve's limit of {limit} ({name})", name)


def loads_json(text: str) -> Any:
    """``json.loads`` that refuses text nested too deep with a LimitError (the C decoder
    raises RecursionError past Python's recursion limit; this never does)."""
    depth = _text_depth(text)
    if depth > MAX_SCHEMA_DEPTH:
        raise _over("JSON nesting depth", depth, MAX_SCHEMA_DEPTH, "MAX_SCHEMA_DEPTH")
    try:
        return json.loads(text)
    except RecursionError:  # pragma: no cover - the depth check above comes first
        raise _over("JSON nesting depth", depth, MAX_SCHEMA_DEPTH, "MAX_SCHEMA_DEPTH") from None


_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def _text_depth(text: str) -> int:
    """The deepest bracket nesting of JSON text, skipping strings (one regex pass, C speed)."""
    depth = deepest = 0
    for match in _STRUCTURE.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def check_regex(pattern: str, what: str = "regex") -> None:
    """A regex's length and group nesting (Python's and xgrammar's parsers recurse per group)."""
    if len(pattern) > MAX_REGEX_CHARS:
        raise _over(f"{what} length", len(pattern), MAX_REGEX_CHARS, "MAX_REGEX_CHARS")
    nesting = regex_nesting(pattern)
    if nesting > MAX_REGEX_NESTING:
        raise _over(f"{what} group nesting", nesting, MAX_REGEX_NESTING, "MAX_REGEX_NESTING")


def regex_nesting(pattern: str) -> int:
    """How deep the regex's parentheses nest (escapes and character classes skipped)."""
    depth = deepest = 0
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
    return deepest


def check_grammar(text: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise _over("grammar size in bytes", size, MAX_GRAMMAR_BYTES, "MAX_GRAMMAR_BYTES")
    rules = len(_RULE.findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise _over("grammar rules", rules, MAX_GRAMMAR_RULES, "MAX_GRAMMAR_RULES")


def check_choices(choices: list[str]) -> None:
    if len(choices) > MAX_ENUM_VALUES:
        raise _over("number of choices", len(choices), MAX_ENUM_VALUES, "MAX_ENUM_VALUES")
    size = sum(len(c.encode("utf-8", "surrogatepass")) for c in choices)
    if size > MAX_CHOICE_BYTES:
        raise _over("choices' total size in bytes", size, MAX_CHOICE_BYTES, "MAX_CHOICE_BYTES")


def check_logit_bias(entries: int) -> None:
    if entries > MAX_LOGIT_BIAS_ENTRIES:
        raise _over("logit_bias entries", entries, MAX_LOGIT_BIAS_ENTRIES, "MAX_LOGIT_BIAS_ENTRIES")


# Where a schema keeps its subschemas (everything else under a schema is data: walked for depth only);
# schema_rewrite walks the same places.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)


def check_schema(schema: Any) -> None:
    """Every schema limit, depth first (so that nothing recursive ever sees a deeper schema),
    then the size of its compact JSON text."""
    enum_values = properties = 0
    stack: list[tuple[Any, int, bool]] = [(schema, 1, True)]  # (node, depth, is it a schema)
    while stack:
        node, depth, is_schema = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise _over("schema nesting depth", depth, MAX_SCHEMA_DEPTH, "MAX_SCHEMA_DEPTH")
        if not is_schema or isinstance(node, list):
            stack.extend((value, depth + 1, False) for value in (node.values() if isinstance(node, dict) else node))
            continue
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], "schema pattern")
        for pattern in node.get("patternProperties") or ():
            check_regex(str(pattern), "schema patternProperties key")
        enum_values += ("const" in node) + (len(node["enum"]) if isinstance(node.get("enum"), list) else 0)
        if enum_values > MAX_ENUM_VALUES:
            raise _over("schema enum values", enum_values, MAX_ENUM_VALUES, "MAX_ENUM_VALUES")
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                if key in ("properties", "patternProperties"):
                    properties += len(value)
                    if properties > MAX_PROPERTIES:
                        raise _over("schema property definitions", properties, MAX_PROPERTIES, "MAX_PROPERTIES")
                if depth + 1 > MAX_SCHEMA_DEPTH:
                    raise _over("schema nesting depth", depth + 1, MAX_SCHEMA_DEPTH, "MAX_SCHEMA_DEPTH")
                stack.extend((sub, depth + 2, True) for sub in value.values())
            elif key in _SCHEMA_LISTS and isinstance(value, list) or key == "items" and isinstance(value, list):
                if depth + 1 > MAX_SCHEMA_DEPTH:
                    raise _over("schema nesting depth", depth + 1, MAX_SCHEMA_DEPTH, "MAX_SCHEMA_DEPTH")
                stack.extend((sub, depth + 2, True) for sub in value)
            else:
                stack.append((value, depth + 1, key in _SCHEMA_ONE))
    size = len(json.dumps(schema, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise _over("schema size in bytes", size, MAX_SCHEMA_BYTES, "MAX_SCHEMA_BYTES")
