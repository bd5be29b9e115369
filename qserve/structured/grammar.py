"""Grammars for structured outputs, through xgrammar: compile once per constraint, keep one
matcher per running sequence, fill next-token bitmasks.

Knows: xgrammar's API (``TokenizerInfo``, ``GrammarCompiler``, ``GrammarMatcher``), the
compiled-grammar cache (LRU, bounded in entries and in bytes), and the bitmask layout
(``[rows, ceil(vocab / 32)]`` int32, bit j of word w allows token 32 w + j). How each
``StructuredOutputsParams`` kind becomes a grammar is ``qserve.structured.build``; the limits
every constraint is checked against first are ``qserve.structured.limits``. Must not know:
the scheduler, the sampler's math, HTTP. Why xgrammar and not llguidance:
docs/structured_output.md (measured with bench/grammar_backends.py).

Threads: ``GrammarCompiler`` is thread-safe. The server checks and compiles a request's
grammar before it reaches the engine (``qserve.structured.gate``: a time-limited compile in a
child process first, then this one on the gate's own threads); the engine's step thread then
finds it in the cache. Matchers belong to the step thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from qserve.structured import limits
from qserve.structured.build import clean_error, compile_constraint, xgrammar
from qserve.structured.params import StructuredOutputsParams
from qserve.structured.satisfiable import why_unsatisfiable

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept per tokenizer (least recently used dropped)
CACHE_BYTES = 1 << 30  # and at most this much memory for them (xgrammar's own size estimate)


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile, or past a limit; ``field`` names the
    request field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_constraint(params: StructuredOutputsParams, field: str) -> tuple[str, str]:
    """The constraint's cache key, after the limits (and, for a JSON schema, satisfiability):
    a GrammarError naming ``field`` and the limit otherwise."""
    try:
        kind = params.kind
        if kind == "json":
            schema = params.schema()
            limits.check_schema(schema)
            reason = why_unsatisfiable(schema)
            if reason:
                raise GrammarError(f"{field} is unsatisfiable, no JSON value matches it: {reason}", field)
        elif kind == "regex":
            limits.check_regex(params.regex or "")
        elif kind == "choice":
            limits.check_choices(params.choice or [])
        elif kind == "grammar":
            limits.check_grammar(params.grammar or "")
        return params.key()
    except (limits.LimitError, RecursionError) as err:
        detail = str(err) if isinstance(err, limits.LimitError) else "nested too deep"
        raise GrammarError(f"{field}: {detail}", field) from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer; a bounded LRU cache keyed by the constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._compiler: Any = None
        self._info: Any = None
        self._max_threads = max_threads
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._cache_bytes = 0
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
                xgr = xgrammar()
                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=self._max_threads)
            return self._compiler

    def tokenizer_info(self) -> str:
        """The tokenizer as xgrammar serializes it (what a compile process needs)."""
        self._get_compiler()
        return self._info.serialize_json()

    def cached(self, key: tuple[str, str]) -> Any:
        """The compiled grammar of ``key`` if it is cached (then it becomes the most recent)."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                return None
            self._cache.move_to_end(key)
            return entry[0]

    def compile(self, params: StructuredOutputsParams, field: str = "structured_outputs") -> Any:
        """The compiled grammar of ``params`` (cached); GrammarError naming ``field`` if it is
        past a limit or does not compile."""
        key = check_constraint(params, field)
        return self.cached(key) or self.compile_checked(key, field)

    def compile_checked(self, key: tuple[str, str], field: str) -> Any:
        """Compile a key that passed ``check_constraint`` (no time limit here: the gate proves
        in a child process that it compiles in time before it calls this)."""
        try:
            compiler = self._get_compiler()
        except RuntimeError as err:
            raise GrammarError(f"{field}: {err}", field) from err
        kind, text = key
        try:
            compiled = compile_constraint(compiler, kind, text)
        except Exception as err:  # noqa: BLE001 - the library raises RuntimeError for every bad input
            message = f"{field}: cannot compile this {kind.replace('_', ' ')}: {clean_error(err)}"
            raise GrammarError(message, field) from err
        size = int(getattr(compiled, "memory_size_bytes", 0) or 0)
        with self._lock:
            self.num_compiled += 1
            if key not in self._cache:
                self._cache[key] = (compiled, size)
                self._cache_bytes += size
            while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self._cache_bytes > CACHE_BYTES):
                _, (_, dropped) = self._cache.popitem(last=False)
                self._cache_bytes -= dropped
        return compiled


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
        self._matchers[request_id] = xgrammar().GrammarMatcher(
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
