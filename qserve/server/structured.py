"""Which structured-output constraint a request asks for, and which request field said so.

Knows: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields, that at most one of them may be set, and that a JSON schema must
itself be valid (checked with ``jsonschema``'s meta-schema, so the error names the schema's
fault) after qserve's limits (``qserve.structured.limits``: the walk is iterative and comes
first, so nothing recursive ever sees a schema nested past ``MAX_SCHEMA_DEPTH``) and that some
value must match it (``qserve.structured.satisfiable``). Must not know: the grammar library
(``qserve.structured.grammar`` compiles), HTTP.

``constraint_of(request)`` returns ``(params, field)`` where ``field`` is the request field to
name in a 400 when the grammar does not compile. ``constraint_off_loop(request)`` is the same
for a coroutine: a request carrying a JSON schema is checked on threads of this module's own,
because ``jsonschema``'s meta-schema check is pure Python and slow on large schemas (5,000
properties, under every limit: about 1 s on a loaded 2-core CPU, which on the event loop held
``/health`` for as long); in a thread it gives the GIL back every few ms and the loop answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

from qserve.server.protocol import SamplingFields
from qserve.structured import limits
from qserve.structured.gate import DaemonThreads
from qserve.structured.params import StructuredOutputsParams
from qserve.structured.satisfiable import why_unsatisfiable


class ConstraintError(ValueError):
    """A bad structured-output request; ``field`` names the request field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_json_schema(schema: Any, field: str) -> dict[str, Any]:
    """A JSON schema (object or its JSON text) within the limits, checked against its
    meta-schema, and satisfiable; ConstraintError naming ``field`` otherwise."""
    import jsonschema

    try:
        if isinstance(schema, str):
            try:
                schema = limits.loads_json(schema)
            except ValueError as err:
                if isinstance(err, limits.LimitError):
                    raise
                raise ConstraintError(f"{field} is not valid JSON: {err}", field) from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"{field} must be a JSON schema object, got {type(schema).__name__}", field)
        limits.check_schema(schema)
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except limits.LimitError as err:
        raise ConstraintError(f"{field}: {err}", field) from None
    except RecursionError:  # a safety net: the depth limit keeps the meta-schema check far from this
        raise ConstraintError(f"{field}: nested too deep (MAX_SCHEMA_DEPTH)", field) from None
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path)
        raise ConstraintError(
            f"{field} is not a valid JSON schema{f' (at {where})' if where else ''}: {err.message}", field
        ) from None
    reason = why_unsatisfiable(schema)
    if reason:
        raise ConstraintError(f"{field} is unsatisfiable, no JSON value matches it: {reason}", field)
    return schema


def constraint_of(request: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured-output constraint and the field it came from (None, None if none)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        else:
            field = "response_format.json_schema"
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ConstraintError(f"{field}.schema is required when response_format.type is json_schema", field)
            field = "response_format.json_schema.schema"
            found.append((StructuredOutputsParams(json=check_json_schema(fmt.json_schema.schema_, field)), field))
    if request.guided_json is not None:
        schema = check_json_schema(request.guided_json, "guided_json")
        found.append((StructuredOutputsParams(json=schema), "guided_json"))
    for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((_make(name, **{kind: value}), name))
    so = request.structured_outputs
    if so is not None:
        set_fields = {k: v for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)}
        if len(set_fields) != 1:
            raise ConstraintError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(set_fields) or 'none'}",
                "structured_outputs",
            )
        ((kind, value),) = set_fields.items()
        field = f"structured_outputs.{kind}"
        if kind == "json":
            value = check_json_schema(value, field)
        found.append((_make(field, **{kind: value}), field))
    if len(found) > 1:
        raise ConstraintError(
            f"give one structured-output constraint, not several: {', '.join(f for _, f in found)}", found[1][1]
        )
    return found[0] if found else (None, None)


SCHEMA_CHECK_THREADS = 2  # schema checks at once (all models); more requests wait their turn
_check_threads: DaemonThreads | None = None


async def constraint_off_loop(
    request: SamplingFields,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """``constraint_of(request)``, off the event loop when the request carries a JSON schema
    (daemon threads: a process exit never waits on a check)."""
    global _check_threads
    so = request.structured_outputs
    fmt = request.response_format
    if request.guided_json is None and (so is None or so.json_ is None) and (fmt is None or fmt.type != "json_schema"):
        return constraint_of(request)  # nothing slow to check
    if _check_threads is None:
        _check_threads = DaemonThreads(SCHEMA_CHECK_THREADS, "qserve-schema-check")
    return await asyncio.wrap_future(_check_threads.submit(lambda: constraint_of(request)))


def _make(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as err:
        raise ConstraintError(f"{field}: {err}", field) from None
