"""How each kind of constraint becomes an xgrammar grammar, and its compile (no torch here: the
compile workers in ``qserve.structured.compile_worker`` import this and nothing heavier).

Knows: xgrammar's ``Grammar`` / ``GrammarCompiler`` calls, the names of the rules xgrammar's
JSON-schema converter writes for unbounded numbers (``basic_integer``, ``basic_number_*``),
and the bounds qserve puts on them: integer part at most ``INTEGER_DIGITS`` digits, fraction
at most ``FRACTION_DIGITS``, exponent at most ``EXPONENT_DIGITS`` (llama.cpp bounds its
schema grammars' numbers the same way). Must not know: HTTP, the engine, limits (checked
before this is called: ``qserve.structured.limits``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from qserve.structured.schema_rewrite import INTEGER_DIGITS, rewrite_schema

FRACTION_DIGITS = 16
EXPONENT_DIGITS = 3  # 1e308 is the largest double; more exponent digits only overflow
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# xgrammar 0.2's unbounded number rules, by rule name (a schema's own rules are named after
# its path, so a string ``pattern`` of digits is never touched).
_UNBOUNDED_INTEGER = re.compile(r"^(basic_integer|basic_number_2) ::= (.*)\[1-9\] \[0-9\]\*", re.MULTILINE)
_UNBOUNDED_FRACTION = re.compile(r"^(basic_number_3 ::= .*basic_number_digits)\{1, -1\}", re.MULTILINE)
_UNBOUNDED_EXPONENT = re.compile(r"^(basic_number_5 ::= .*basic_number_digits)\{1, -1\}", re.MULTILINE)


def xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:  # pragma: no cover - a dependency of qserve
        raise RuntimeError("structured outputs need the xgrammar package: pip install xgrammar") from err
    return xgrammar


def clean_error(err: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    return _XGRAMMAR_LOCATION.sub("", str(err).strip()).strip()


def ebnf_literal(text: str) -> str:
    """A string as an xgrammar EBNF literal (JSON escapes are EBNF escapes)."""
    return json.dumps(text, ensure_ascii=False)


def bound_number_rules(ebnf: str) -> str:
    """xgrammar's JSON grammar text with its unbounded number rules bounded."""
    ebnf = _UNBOUNDED_INTEGER.sub(rf"\1 ::= \2[1-9] [0-9]{{0,{INTEGER_DIGITS - 1}}}", ebnf)
    ebnf = _UNBOUNDED_FRACTION.sub(rf"\1{{1,{FRACTION_DIGITS}}}", ebnf)
    return _UNBOUNDED_EXPONENT.sub(rf"\1{{1,{EXPONENT_DIGITS}}}", ebnf)


def json_grammar(schema_text: str) -> Any:
    """The grammar of a JSON schema (compact JSON, strict, numbers bounded)."""
    xgr = xgrammar()
    schema = rewrite_schema(json.loads(schema_text))
    # Compact JSON (no free whitespace): a model cannot pad its output with blanks forever.
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return xgr.Grammar.from_ebnf(bound_number_rules(str(grammar)), root_rule_name="root")


def grammar_of(kind: str, text: str, choices: list[str] | None = None) -> Any:
    """The xgrammar ``Grammar`` of one constraint (``kind`` and ``text`` as in
    ``StructuredOutputsParams.key()``); raises the library's error if it does not build."""
    xgr = xgrammar()
    if kind == "json":
        return json_grammar(text)
    if kind == "json_object":
        return json_grammar('{"type": "object"}')
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        options = choices if choices is not None else json.loads(text)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(ebnf_literal(c) for c in options))
    return xgr.Grammar.from_ebnf(text)


def compile_constraint(compiler: Any, kind: str, text: str) -> Any:
    """The compiled grammar of one constraint with an xgrammar ``GrammarCompiler``."""
    return compiler.compile_grammar(grammar_of(kind, text))
