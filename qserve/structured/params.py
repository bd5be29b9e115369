"""``StructuredOutputsParams``: what a request's output must match (vLLM's names and meaning).

Knows: the kinds of constraint (a JSON schema, any JSON object, a regex, one of a list of
strings, an EBNF grammar), that exactly one is set, and a canonical cache key per constraint.
Must not know: torch, tokenizers, the grammar library (``qserve.structured.grammar`` does).
Pure Python value object, validated on construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from qserve.structured.limits import LimitError, loads_json

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (object or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF-style), as xgrammar reads it

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {', '.join(kinds) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got {self.json!r}")
        if isinstance(self.json, str):
            try:
                schema = loads_json(self.json)  # json.loads, but a RecursionError is a LimitError
            except LimitError as err:
                raise ValueError(f"structured_outputs.json: {err}") from None
            except ValueError as err:
                raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))

    def kinds(self) -> list[str]:
        return [k for k in KINDS if (getattr(self, k) not in (None, False))]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema as an object (None unless ``json`` is set)."""
        if self.json is None:
            return None
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def key(self) -> tuple[str, str]:
        """A canonical (kind, text) key: equal constraints share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            # Key order is kept: it is the order the properties are generated in.
            return kind, json.dumps(self.schema(), separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, getattr(self, kind)
