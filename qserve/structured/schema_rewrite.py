"""JSON schemas rewritten, before compiling, into equivalents that generate well-formed, finite JSON.

Knows: where a JSON schema keeps its subschemas, and two rewrites:

- numbers with one bound get the other (issue 28: a model wrote 200-digit integers until
  ``max_tokens`` cut the JSON). As llama.cpp's schema grammars do, an integer is at most
  ``INTEGER_DIGITS`` digits unless the schema's own bound needs more: ``{"type": "integer",
  "minimum": 0}`` becomes ``minimum 0, maximum 9999999999999999``. Numbers likewise, at most
  ``10 ** INTEGER_DIGITS`` in magnitude. (A number or integer without any bound uses the
  library's own rules, bounded in ``qserve.structured.build``.) The schema's bounds always win.
- strings with ``minLength`` / ``maxLength`` become the equivalent ``pattern`` over JSON-safe
  characters (xgrammar 0.2's length rule admits raw control characters and surrogates).

Must not know: the grammar library's API. Pure Python; returns copies. The schema's depth is
bounded before this runs (``qserve.structured.limits``), so the recursion here is too.
"""

from __future__ import annotations

from typing import Any

from qserve.structured.limits import _SCHEMA_LISTS, _SCHEMA_MAPS, _SCHEMA_ONE  # where subschemas live

INTEGER_DIGITS = 16  # digits of an integer whose schema does not bound it (llama.cpp's choice)
INT64_MAX = 2**63 - 1  # xgrammar refuses integer bounds past int64

_SAFE_STRING = r'^[^\x00-\x1f"\\\ud800-\udfff]{%d,%s}$'


def rewrite_schema(schema: Any) -> Any:
    """A copy of ``schema`` with both rewrites applied to it and to every subschema."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rewrite_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list) or key == "items" and isinstance(value, list):
            out[key] = [rewrite_schema(sub) for sub in value]
        elif key in _SCHEMA_ONE:
            out[key] = rewrite_schema(value)
        else:
            out[key] = value
    _bound_numbers(out)
    _string_lengths_as_patterns(out)
    return out


def _types(schema: dict[str, Any]) -> set[str]:
    value = schema.get("type")
    return (
        {value}
        if isinstance(value, str)
        else {t for t in value if isinstance(t, str)}
        if isinstance(value, list)
        else set()
    )


def _bound(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _digits(value: float | int) -> int:
    return len(str(int(abs(value))))


def _bound_numbers(schema: dict[str, Any]) -> None:
    """Give an integer or number with exactly one side bounded the other side, in place."""
    types = _types(schema)
    if not types & {"integer", "number"}:
        return
    low = next((v for k in ("minimum", "exclusiveMinimum") if (v := _bound(schema.get(k))) is not None), None)
    high = next((v for k in ("maximum", "exclusiveMaximum") if (v := _bound(schema.get(k))) is not None), None)
    if (low is None) == (high is None):
        return  # both bounded (the schema decides) or neither (the library's rules, bounded in build.py)
    known = low if low is not None else high
    digits = max(INTEGER_DIGITS, _digits(known))
    if "number" in types:
        limit: float | int = float(10**digits)
    else:
        limit = min(10**digits - 1, INT64_MAX)
    if low is None:
        schema["minimum"] = -limit
    else:
        schema["maximum"] = limit


def _string_lengths_as_patterns(schema: dict[str, Any]) -> None:
    """A string with ``minLength`` / ``maxLength`` (and no pattern or format of its own) gets
    the equivalent pattern over JSON-safe characters (no escapes: the library's length rule
    has none either), in place."""
    lengths = ("minLength" in schema, "maxLength" in schema)
    if schema.get("type") == "string" and any(lengths) and "pattern" not in schema and "format" not in schema:
        low = int(schema.pop("minLength", 0))
        high = schema.pop("maxLength", None)
        schema["pattern"] = _SAFE_STRING % (low, "" if high is None else int(high))
