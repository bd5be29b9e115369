"""Structured-output hardening (issue 31 items 1, 2, 5; issue 28 "numbers without end"), in
process: the documented limits refuse the audit's hostile constraints fast and without
recursion; unsatisfiable schemas are named; numbers in schema grammars are bounded; compiles
run in a child process that a timeout, a cancellation or a shutdown kills, so abandoned
pathological compiles never block a later one; compiled grammars are cached."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from qserve.server.structured import ConstraintError, check_json_schema
from qserve.structured import limits
from qserve.structured.build import grammar_of
from qserve.structured.compile_pool import CompilePool
from qserve.structured.gate import GrammarBusy, GrammarGate
from qserve.structured.grammar import GrammarCompiler, GrammarError
from qserve.structured.params import StructuredOutputsParams as Params
from tests.helpers.tokenizer import make_tokenizer


def _nested(kind: str, depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        if kind == "object":
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        elif kind == "array":
            schema = {"type": "array", "items": schema}
        else:
            schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


def _deep_json_text(depth: int) -> str:
    return '{"type": "object", "default": ' + "[" * depth + "]" * depth + "}"


HOSTILE_SCHEMAS = {
    "enum_100k": ({"enum": [f"value{i}" for i in range(100_000)]}, "MAX_ENUM_VALUES"),
    "properties_20k": (
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}},
        "MAX_PROPERTIES",
    ),
    "object_200_deep": (_nested("object", 200), "MAX_SCHEMA_DEPTH"),
    "array_200_deep": (_nested("array", 200), "MAX_SCHEMA_DEPTH"),
    "anyof_200_deep": (_nested("anyOf", 200), "MAX_SCHEMA_DEPTH"),
    "pattern_5000_groups": ({"type": "string", "pattern": "(" * 5000 + "a" + ")" * 5000}, "MAX_REGEX_CHARS"),
    "pattern_100_groups": ({"type": "string", "pattern": "(" * 100 + "a" + ")" * 100}, "MAX_REGEX_NESTING"),
    "pattern_too_long": ({"type": "string", "pattern": "a" * 20_000}, "MAX_REGEX_CHARS"),
    "big_schema": ({"type": "string", "description": "x" * 300_000}, "MAX_SCHEMA_BYTES"),
    "string_100k_deep": ("[" * 100_000 + "]" * 100_000, "MAX_SCHEMA_DEPTH"),
    "string_100k_deep_inside": (_deep_json_text(100_000), "MAX_SCHEMA_DEPTH"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_SCHEMAS))
def test_hostile_schemas_are_refused_fast_naming_the_limit(name):
    schema, limit = HOSTILE_SCHEMAS[name]
    start = time.perf_counter()
    with pytest.raises(ConstraintError) as err:
        check_json_schema(schema, "guided_json")
    assert time.perf_counter() - start < 2.0
    assert err.value.field == "guided_json" and limit in str(err.value), str(err.value)[:300]


def test_limits_hold_without_the_server_too():
    """Offline and tool schemas go through GrammarCompiler.compile: the same limits."""
    compiler = GrammarCompiler(None, 400, [0])  # refused before the tokenizer is ever needed
    cases = [
        (Params(json=_nested("object", 200)), "MAX_SCHEMA_DEPTH"),
        (Params(regex="(" * 5000 + "a" + ")" * 5000), "MAX_REGEX_CHARS"),
        (Params(regex="(" * 100 + "a" + ")" * 100), "MAX_REGEX_NESTING"),
        (Params(choice=[f"c{i}" for i in range(100_000)]), "MAX_ENUM_VALUES"),
        (Params(grammar="\n".join(f"r{i} ::= r{i + 1}" for i in range(10_000))), "MAX_GRAMMAR_RULES"),
        (Params(json={"not": {}}), "unsatisfiable"),
    ]
    for params, expected in cases:
        with pytest.raises(GrammarError) as err:
            compiler.compile(params, "structured_outputs")
        assert expected in str(err.value) and err.value.field == "structured_outputs"
    with pytest.raises(ValueError, match="MAX_SCHEMA_DEPTH"):
        Params(json="[" * 100_000 + "]" * 100_000)


def test_schemas_at_the_limits_pass():
    check_json_schema(_nested("object", 20), "f")
    check_json_schema({"enum": list(range(limits.MAX_ENUM_VALUES))}, "f")
    check_json_schema({"type": "string", "pattern": "(" * 60 + "a" + ")" * 60}, "f")
    # Property names are names: a property called "enum" or "pattern" is not a keyword.
    check_json_schema({"type": "object", "properties": {"enum": {"type": "string"}, "pattern": {}}}, "f")


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
        {"guided_json": {"type": "integer"}},
        {"guided_json": '{"type": "integer"}'},
        {"structured_outputs": {"json": {"type": "integer"}}},
    ],
)
def test_schema_checks_run_off_the_event_loop(fields, monkeypatch):
    """jsonschema's meta-schema check is pure Python: a schema at the limits (5,000 properties)
    took about 1 s, and on the event loop it held /health that long (the 2026-12-05 audit)."""
    import threading

    from qserve.server import structured
    from qserve.server.protocol import CompletionRequest
    from qserve.server.serving import OpenAIServing

    seen: list[threading.Thread] = []
    real = structured.check_json_schema

    def recording(schema, field):
        seen.append(threading.current_thread())
        return real(schema, field)

    monkeypatch.setattr(structured, "check_json_schema", recording)
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})

    async def check():
        return await OpenAIServing._constraint(request), threading.current_thread()

    (params, field), loop_thread = asyncio.run(check())
    assert params is not None and params.json is not None and field
    assert len(seen) == 1 and seen[0] is not loop_thread and seen[0].daemon


@pytest.mark.parametrize(
    "schema",
    [
        {"not": {}},
        {"not": True},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {
            "type": "object",
            "properties": {"a": {"allOf": [{"type": "string"}, {"type": "integer"}]}},
            "required": ["a"],
        },
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "string", "minLength": 3, "maxLength": 1},
        {"type": "string", "enum": [1, 2]},
        {"enum": []},
        {"anyOf": [{"not": {}}, False]},
        {"type": "object", "required": ["x"], "additionalProperties": False},
    ],
)
def test_unsatisfiable_schemas_are_refused_naming_why(schema):
    with pytest.raises(ConstraintError, match="unsatisfiable") as err:
        check_json_schema(schema, "response_format.json_schema.schema")
    assert err.value.field == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [{"type": "number"}, {"type": "integer"}]},
        {"type": ["integer", "string"], "minimum": 5, "maximum": 1},  # any string still matches
        {"not": {"type": "string"}},
        {"type": "object", "properties": {"a": {"not": {}}}},  # "a" is optional
        {"anyOf": [{"not": {}}, {"type": "string"}]},
    ],
)
def test_satisfiable_schemas_pass(schema):
    check_json_schema(schema, "f")


# ---------------------------------------------------------------------- numbers (issue 28)
def _accepts(schema: dict, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(grammar_of("json", json.dumps(schema)), text)


def test_integers_are_at_most_16_digits_unless_the_schema_says_more():
    free = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert _accepts(free, '{"n": ' + "9" * 16 + "}") and _accepts(free, '{"n": -' + "9" * 16 + "}")
    assert not _accepts(free, '{"n": ' + "1" * 17 + "}")
    low_only = {"type": "integer", "minimum": 0}
    assert _accepts(low_only, "9" * 16) and not _accepts(low_only, "1" * 17) and not _accepts(low_only, "-1")
    high_only = {"type": "integer", "maximum": 5}
    assert _accepts(high_only, "-" + "9" * 16) and not _accepts(high_only, "-" + "1" * 17)
    wide = {"type": "integer", "minimum": 0, "maximum": 10**18}  # the schema's own bounds win
    assert _accepts(wide, "1" * 18)
    big_low = {"type": "integer", "minimum": 10**17}  # a bound past 16 digits widens the other side
    assert _accepts(big_low, "1" * 18)


def test_numbers_and_free_json_values_are_bounded():
    number = {"type": "number"}
    assert _accepts(number, "1" * 16 + "." + "5" * 16 + "e-308")
    assert not _accepts(number, "1" * 17) and not _accepts(number, "1." + "5" * 17)
    assert not _accepts(number, "1e1234")
    assert _accepts({"type": "number", "minimum": 0}, "1" * 16) and not _accepts(
        {"type": "number", "minimum": 0}, "2" * 17
    )
    free = {"type": "object"}  # json_object: any value, numbers included
    assert _accepts(free, '{"a": [' + "9" * 16 + "]}") and not _accepts(free, '{"a": [' + "9" * 17 + "]}")


def test_compiled_grammar_rejects_a_17_digit_integer():
    """The bounds reach the compiled grammar the engine samples with (a matcher over real tokens)."""
    import xgrammar

    tokenizer = make_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = compiler.compile(Params(json={"type": "integer"}))

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and matcher.is_completed()

    assert accepts("1234567890123456") and not accepts("12345678901234567")


# ---------------------------------------------------------------------- cache
def test_cache_is_bounded_in_entries_and_bytes(monkeypatch):
    from qserve.structured import grammar

    tokenizer = make_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    monkeypatch.setattr(grammar, "CACHE_SIZE", 3)
    for i in range(5):
        compiler.compile(Params(regex=f"a{{{i + 1}}}"))
    assert len(compiler._cache) == 3 and compiler.cached(("regex", "a{1}")) is None
    assert compiler.cached(("regex", "a{5}")) is not None
    monkeypatch.setattr(grammar, "CACHE_BYTES", 1)  # every grammar is bigger: only the newest stays
    compiler.compile(Params(regex="b+"))
    assert list(compiler._cache) == [("regex", "b+")]


# ---------------------------------------------------------------------- compiles in a child process
SLOW = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}  # minutes to compile


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = make_tokenizer()
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_abandoned_slow_compiles_do_not_block_later_ones_and_shutdown_kills(compiler):
    async def scenario() -> None:
        pool = CompilePool(compiler.tokenizer_info(), workers=2, timeout_s=20.0)
        gate = GrammarGate(compiler, pool)
        await gate.compile(Params(json={"type": "object", "properties": {"warm": {"type": "string"}}}), "f")
        # Eight pathological requests whose clients leave after a moment.
        hostile = [
            asyncio.ensure_future(gate.compile(Params(json={**SLOW, "title": str(i)}), "guided_json")) for i in range(8)
        ]
        await asyncio.sleep(1.0)
        running = [job.pid for job in pool._jobs.values() if job.pid is not None]
        for task in hostile:
            task.cancel()
        start = time.perf_counter()
        await gate.compile(Params(json={"type": "object", "properties": {"later": {"type": "integer"}}}), "f")
        assert time.perf_counter() - start < 5.0  # not behind the abandoned ones
        assert pool.num_killed >= 2
        await asyncio.sleep(0.2)
        assert running and not any(_alive(pid) for pid in running)  # the abandoned compiles are gone
        # A compile running at shutdown is killed; its request is told the server is busy (503).
        waiting = asyncio.ensure_future(gate.compile(Params(json={**SLOW, "title": "late"}), "f"))
        await asyncio.sleep(1.0)
        start = time.perf_counter()
        gate.close()
        with pytest.raises(GrammarBusy):
            await waiting
        assert time.perf_counter() - start < 1.0
        with pytest.raises(GrammarBusy):
            await gate.compile(Params(json={"type": "object", "properties": {"x": {}}}), "f")

    asyncio.run(scenario())


def test_timeout_is_a_400_naming_the_limit_and_refusals_are_remembered(compiler):
    async def scenario() -> None:
        gate = GrammarGate(compiler, CompilePool(compiler.tokenizer_info(), timeout_s=1.0))
        await gate.compile(Params(regex="warm[0-9]"), "f")  # the compile process is up
        start = time.perf_counter()
        with pytest.raises(GrammarError, match="COMPILE_TIMEOUT_S") as err:
            await gate.compile(Params(json=SLOW), "response_format.json_schema.schema")
        assert err.value.field == "response_format.json_schema.schema"
        assert time.perf_counter() - start < 4.0
        start = time.perf_counter()
        with pytest.raises(GrammarError, match="COMPILE_TIMEOUT_S"):
            await gate.compile(Params(json=SLOW), "guided_json")
        assert time.perf_counter() - start < 0.5  # remembered: no second compile
        # A cache hit never reaches the compile process.
        params = Params(json={"type": "object", "properties": {"hit": {"type": "boolean"}}})
        await gate.compile(params, "f")
        vetted, compiled = gate.num_vetted, compiler.num_compiled
        await gate.compile(Params(json={"type": "object", "properties": {"hit": {"type": "boolean"}}}), "f")
        assert (gate.num_vetted, compiler.num_compiled) == (vetted, compiled)
        gate.close()

    asyncio.run(scenario())


class _CountingPool:
    """A compile process stand-in that fails every constraint the same way and counts the tries."""

    timeout_s = 10.0

    def __init__(self, failure: Exception) -> None:
        self.failure = failure
        self.calls = 0

    async def check(self, *key: str) -> None:
        self.calls += 1
        raise self.failure


def test_a_timeout_refusal_expires_but_a_compile_error_does_not(compiler, monkeypatch):
    """How long a compile takes depends on the load at the time (the audit of 2026-12-05 saw a
    grammar under the limits time out at load 9.8): a timeout is remembered for a minute, then the
    constraint is tried again; a compile error is the constraint's own and stays refused."""
    from qserve.structured import gate as gate_module
    from qserve.structured.compile_pool import CompileFailed, CompileTimeout

    now = [1000.0]
    monkeypatch.setattr(gate_module.time, "monotonic", lambda: now[0])

    async def tries(failure: Exception, schema: dict) -> list[int]:
        pool = _CountingPool(failure)
        gate = GrammarGate(compiler, pool)  # type: ignore[arg-type]
        counts = []
        for step in (0.0, 1.0, gate_module.TIMEOUT_REFUSAL_TTL_S + 1.0):
            now[0] += step
            with pytest.raises(GrammarError, match="guided_json"):
                await gate.compile(Params(json=schema), "guided_json")
            counts.append(pool.calls)
        return counts

    timed_out = asyncio.run(tries(CompileTimeout(), {"type": "object", "properties": {"t": {"type": "integer"}}}))
    assert timed_out == [1, 1, 2]
    failed = asyncio.run(tries(CompileFailed("bad"), {"type": "object", "properties": {"f": {"type": "integer"}}}))
    assert failed == [1, 1, 1]


def test_busy_compile_slots_answer_503_with_retry_after():
    """No compile slot came free in time: not the request's fault, so a 503 that says when to retry."""
    from types import SimpleNamespace

    from qserve.server.serving import OpenAIServing, ServingError
    from qserve.structured import gate as gate_module

    class BusyGate:
        async def compile(self, params: Params, field: str) -> None:
            raise GrammarBusy("structured outputs are unavailable right now: every compile slot is busy")

    model = SimpleNamespace(grammar_gate=BusyGate())
    with pytest.raises(ServingError) as err:
        asyncio.run(OpenAIServing._compile(model, Params(json={"type": "object"}), "response_format"))  # type: ignore[arg-type]
    assert err.value.status == 503
    assert err.value.headers == {"Retry-After": str(gate_module.RETRY_AFTER_S)}
