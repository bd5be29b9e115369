"""Grammars for structured outputs, through xgrammar: compile once per constraint, keep one
matcher per running sequence, fill next-token bitmasks.

Knows: xgrammar's API (``TokenizerInfo``, ``GrammarCompiler``, ``GrammarMatcher``), how each
``StructuredOutputsParams`` kind becomes a grammar, the compiled-grammar cache, and the
bitmask layout (``[rows, ceil(vocab / 32)]`` int32, bit j of word w allows token 32 w + j).
Must not know: the scheduler, the sampler's math, HTTP. Why xgrammar and not llguidance:
docs/structured_output.md (measured with bench/grammar_backends.py).

Threads: ``GrammarCompiler`` is thread-safe, so the server compiles (and so validates) a
request's grammar on a worker thread before it reaches the engine; the engine's step thread
then finds it in the cache. Matchers belong to the step thread.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from qserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept per tokenizer (least recently used dropped)
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile; ``field`` names the request field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:  # pragma: no cover - a dependency of qserve
        raise RuntimeError("structured outputs need the xgrammar package: pip install xgrammar") from err
    return xgrammar


def _clean(err: BaseException) -> str:
    return _XGRAMMAR_LOCATION.sub("", str(err).strip()).strip()


def _ebnf_literal(text: str) -> str:
    """A string as an xgrammar EBNF literal (JSON escapes are EBNF escapes)."""
    return json.dumps(text, ensure_ascii=False)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; a bounded LRU cache keyed by the constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._compiler: Any = None
        self._max_threads = max_threads
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and logs

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def prepare(self) -> None:
        """Read the tokenizer's vocabulary now (~0.1 s), on the thread that owns the tokenizer:
        later compiles, from any thread, then never touch the tokenizer. Without xgrammar
        installed, only a warning: requests with a constraint are then refused."""
        try:
            self._get_compiler()
        except RuntimeError as err:
            logger.warning("%s; structured outputs are off", err)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def compile(self, params: StructuredOutputsParams, field: str = "structured_outputs") -> Any:
        """The compiled grammar of ``params`` (cached); GrammarError naming ``field`` if it is bad."""
        key = params.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        try:
            compiler = self._get_compiler()
        except RuntimeError as err:
            raise GrammarError(f"{field}: {err}", field) from err
        kind, text = key
        try:
            if kind == "json":
                # Compact JSON (no free whitespace): a model cannot pad its output with blanks forever.
                schema = json.dumps(_string_lengths_as_patterns(json.loads(text)))
                compiled = compiler.compile_json_schema(schema, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "choice":
                choices = params.choice or []
                compiled = compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as err:  # noqa: BLE001 - the library raises RuntimeError for every bad input
            raise GrammarError(f"{field}: cannot compile this {kind.replace('_', ' ')}: {_clean(err)}", field) from err
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def _string_lengths_as_patterns(schema: Any) -> Any:
    """Work around xgrammar 0.2's rule for strings with ``minLength`` / ``maxLength``: it admits
    raw control characters (invalid JSON) and UTF-8-encoded surrogates (bytes that decode to
    several U+FFFD, breaking the length). Such a string (without its own pattern or format)
    gets the equivalent pattern over JSON-safe characters instead (no escapes: the library's
    length rule has none either). Returns a copy."""
    if isinstance(schema, list):
        return [_string_lengths_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _string_lengths_as_patterns(value) for key, value in schema.items()}
    lengths = ("minLength" in out, "maxLength" in out)
    if out.get("type") == "string" and any(lengths) and "pattern" not in out and "format" not in out:
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        out["pattern"] = _SAFE_STRING % (low, "" if high is None else int(high))
    return out


_SAFE_STRING = r'^[^\x00-\x1f"\\\ud800-\udfff]{%d,%s}$'


class GrammarMatchers:
    """One matcher per constrained sequence (step thread only)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, Any] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        compiled = self.compiler.compile(params)
        self._matchers[request_id] = _xgrammar().GrammarMatcher(
            compiled, override_stop_tokens=self.compiler.stop_token_ids or None
        )

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def fill_bitmask(self, request_ids: Sequence[str]) -> np.ndarray:
        """Next-token bitmasks of these sequences: ``[len(request_ids), ceil(vocab / 32)]`` int32."""
        bitmask = torch.full((len(request_ids), self.compiler.bitmask_width), -1, dtype=torch.int32)  # [N, W]
        for row, request_id in enumerate(request_ids):  # one C++ call per sequence, none per token id
            matcher = self._matchers[request_id]
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask.numpy()

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the sequence's matcher; True once its grammar is complete (nothing may follow)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.is_terminated() and not matcher.accept_token(token_id):
            logger.warning("sequence %s: token %d is outside its grammar", request_id, token_id)
        # Terminated: the grammar is complete and its stop token (the model's eos) was taken.
        return matcher.is_terminated()
