"""Common forms of JSON schemas that no value matches, found before anything is generated.

Knows: JSON Schema's meaning for the forms below, nothing of grammars or HTTP. Detected (at the
root, in every ``allOf`` member, in required properties, in the items of arrays that must
have some, and where every branch of an ``anyOf`` / ``oneOf`` is one of these):

- the ``false`` schema, ``{"not": {}}`` / ``{"not": true}`` (``not`` of a schema without
  assertions), ``"type": []``, ``"enum": []``, ``"anyOf": []`` / ``"oneOf": []``;
- ``type`` sets with nothing in common (the schema's own and its ``allOf`` members': a string
  that is an integer), ``const`` / ``enum`` values none of which has an allowed type;
- bounds that cross: ``minimum`` > ``maximum`` (and the exclusive forms), ``minLength`` >
  ``maxLength``, ``minItems`` > ``maxItems``, ``minProperties`` > ``maxProperties``;
- a required property that ``additionalProperties: false`` forbids.

Anything else is left to the grammar library (a schema this misses compiles and generates
what the library makes of it). Pure Python; the schema's depth is bounded before this runs
(``qserve.structured.limits``), so the recursion here is too.
"""

from __future__ import annotations

from typing import Any

_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})
# Keywords that assert something; a schema with none of them matches everything.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$id", "$schema", "$anchor", "deprecated"}
)


def why_unsatisfiable(schema: Any) -> str | None:
    """A sentence saying why no JSON value matches ``schema``, or None if none of the forms above
    applies (which does not prove that one does)."""
    return _why(schema, "")


def _at(path: str) -> str:
    return f" (at {path})" if path else ""


def _types_of(schema: dict[str, Any]) -> set[str] | None:
    value = schema.get("type")
    if value is None:
        return None
    names = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else set()
    return {n for n in names if n in _TYPES}


def _value_type(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _intersect(types: set[str] | None, other: set[str] | None) -> set[str] | None:
    if types is None:
        return other
    if other is None:
        return types
    both = types & other
    if "integer" in types and "number" in other or "number" in types and "integer" in other:
        both.add("integer")  # every integer is a number
    return both


def _why(schema: Any, path: str) -> str | None:
    if schema is False:
        return f"the schema is `false`{_at(path)}"
    if not isinstance(schema, dict):
        return None
    negated = schema.get("not")
    if negated is True or isinstance(negated, dict) and not (set(negated) - _ANNOTATIONS):
        return f"`not` of a schema that matches everything{_at(path)}"
    members = schema.get("allOf") if isinstance(schema.get("allOf"), list) else []
    for i, member in enumerate(members):
        reason = _why(member, f"{path}/allOf/{i}".lstrip("/"))
        if reason:
            return reason
    types = _types_of(schema)
    if types is not None and not types:
        return f"`type` allows no type{_at(path)}"
    for member in members:
        if isinstance(member, dict):
            member_types = _types_of(member)
            merged = _intersect(types, member_types)
            if merged is not None and not merged:
                return (
                    f"`allOf` requires types {sorted(types or ())} and {sorted(member_types or ())} at once{_at(path)}"
                )
            types = merged
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if not isinstance(branches, list):
            continue
        if not branches:
            return f"`{key}` is empty{_at(path)}"
        reasons = []
        for i, branch in enumerate(branches):
            reason = _why(branch, f"{path}/{key}/{i}".lstrip("/"))
            if reason is None and isinstance(branch, dict):
                merged = _intersect(types, _types_of(branch))
                if merged is not None and not merged:
                    reason = f"its type {sorted(_types_of(branch) or ())} is not one of {sorted(types or ())}"
            reasons.append(reason)
        if all(reasons):
            return f"no branch of `{key}` can match{_at(path)}: {reasons[0]}"
    allowed = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(allowed, list):
        if not allowed:
            return f"`enum` is empty{_at(path)}"
        if types is not None and not any(_value_type(v) & types for v in allowed):
            return f"no `enum` / `const` value has an allowed type {sorted(types)}{_at(path)}"
    return _crossed_bounds(schema, types, path) or _required_parts(schema, types, path)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# Which types each pair of bounds constrains: crossed bounds rule out only those.
_BOUNDS = (
    ("minLength", "maxLength", {"string"}),
    ("minItems", "maxItems", {"array"}),
    ("minProperties", "maxProperties", {"object"}),
)
_NUMBERS = {"number", "integer"}


def _crossed_bounds(schema: dict[str, Any], types: set[str] | None, path: str) -> str | None:
    """Crossed bounds, where the schema's types are all of the kind the bounds constrain (a
    value of another type would ignore them)."""
    if types is not None and types <= _NUMBERS:
        lows = [(_number(schema.get(k)), k.startswith("exclusive")) for k in ("minimum", "exclusiveMinimum")]
        highs = [(_number(schema.get(k)), k.startswith("exclusive")) for k in ("maximum", "exclusiveMaximum")]
        for lo, lo_open in lows:
            for hi, hi_open in highs:
                if lo is not None and hi is not None and (lo > hi or lo == hi and (lo_open or hi_open)):
                    return f"the lower bound {lo:g} is above the upper bound {hi:g}{_at(path)}"
    for low_key, high_key, kinds in _BOUNDS:
        lo_n, hi_n = _number(schema.get(low_key)), _number(schema.get(high_key))
        if types is not None and types <= kinds and lo_n is not None and hi_n is not None and lo_n > hi_n:
            return f"`{low_key}` {lo_n:g} is above `{high_key}` {hi_n:g}{_at(path)}"
    return None


def _required_parts(schema: dict[str, Any], types: set[str] | None, path: str) -> str | None:
    """An object's required properties and an array's required items must be satisfiable
    (when the schema allows only objects, or only arrays)."""
    if types == {"object"}:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        for name in required:
            if not isinstance(name, str):
                continue
            if name in properties:
                reason = _why(properties[name], f"{path}/properties/{name}".lstrip("/"))
                if reason:
                    return reason
            elif schema.get("additionalProperties") is False and not schema.get("patternProperties"):
                return f"property {name!r} is required but `additionalProperties: false` forbids it{_at(path)}"
    min_items = _number(schema.get("minItems")) or 0
    if types == {"array"} and min_items > 0 and isinstance(schema.get("items"), (dict, bool)):
        reason = _why(schema["items"], f"{path}/items".lstrip("/"))
        if reason:
            return reason
    return None
