"""The server's way to a compiled grammar: limits, cache, a time-limited compile that can be
killed, then the real compile on threads of its own.

Knows: the order of the steps and what each costs. (1) ``check_constraint``: the documented
limits and satisfiability, microseconds to milliseconds. (2) The compiled-grammar cache
(``GrammarCompiler.cached``): a hit ends here. (3) A recent refusal of the same constraint
(a small LRU): answered again at once, so a repeated pathological request costs nothing; a
refusal for time is forgotten after ``TIMEOUT_REFUSAL_TTL_S``, because how long a compile takes
depends on the machine's load at the time, while a compile error is the constraint's own. (4)
``CompilePool.check``: the constraint compiled in a child process under ``COMPILE_TIMEOUT_S``,
killed on timeout, on cancellation (the client left) or on ``close()`` (shutdown). (5) The
compile in this process (the engine samples with the grammar, and a serialized grammar is
tens of MB, slower to load than to compile), on ``COMPILE_THREADS`` daemon threads of the
gate's own: never the event loop's default pool, never joined at exit, and only for
constraints that (4) proved compile in time. Must not know: HTTP (errors are
``GrammarError``, ``GrammarBusy``), the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from qserve.structured.compile_pool import CompileFailed, CompilePool, CompileTimeout, PoolBusy, PoolClosed
from qserve.structured.grammar import GrammarCompiler, GrammarError, check_constraint
from qserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # in-process compiles at once per model
REFUSED_CACHE_SIZE = 256  # constraints recently refused (compile error or timeout), answered again at once
TIMEOUT_REFUSAL_TTL_S = 60.0  # a timed-out constraint is compiled again after this (its time depends on load)
RETRY_AFTER_S = 5  # what a 503 for busy compile slots tells the client (the compile timeout is 10 s)


class GrammarBusy(Exception):
    """No compile could start in time, or the server is shutting down (a 503, not the request's fault)."""


class DaemonThreads:
    """A fixed set of daemon threads running submitted calls (a process exit never waits on them)."""

    def __init__(self, threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        for index in range(threads):
            threading.Thread(target=self._run, name=f"{name}-{index}", daemon=True).start()

    def _run(self) -> None:
        while True:
            future, call = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting coroutine
                future.set_exception(err)

    def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, call))
        return future


class GrammarGate:
    """``await gate.compile(params, field)``: the grammar is then in ``compiler``'s cache.
    Raises GrammarError (the request's fault: 400) or GrammarBusy (503). One event loop."""

    def __init__(self, compiler: GrammarCompiler, pool: CompilePool | None = None) -> None:
        self.compiler = compiler
        self._pool = pool
        self._threads: DaemonThreads | None = None
        # key -> (reason, monotonic time it expires or None: a compile error is remembered until evicted)
        self._refused: OrderedDict[tuple[str, str], tuple[str, float | None]] = OrderedDict()
        self._closed = False
        self.num_vetted = 0  # constraints compiled in a child process first (tests, logs)

    def _pool_for(self, field: str) -> CompilePool:
        if self._closed:
            raise GrammarBusy("structured outputs are unavailable right now: the server is shutting down")
        if self._pool is None:
            try:
                self._pool = CompilePool(self.compiler.tokenizer_info())
            except RuntimeError as err:  # xgrammar is not installed
                raise GrammarError(f"{field}: {err}", field) from err
        return self._pool

    def start(self) -> None:
        """Start the compile process now rather than at the first constraint (optional)."""
        self._pool_for("structured_outputs").start()

    async def compile(self, params: StructuredOutputsParams, field: str) -> None:
        key = check_constraint(params, field)
        if self.compiler.cached(key) is not None:
            return
        refused = self._refused.get(key)
        if refused is not None:
            reason, expires = refused
            if expires is None or time.monotonic() < expires:
                self._refused.move_to_end(key)
                raise GrammarError(f"{field}: {reason}", field)
            del self._refused[key]
        pool = self._pool_for(field)
        try:
            await pool.check(*key)
        except CompileFailed as err:
            reason = self._refuse(key, f"cannot compile this {key[0].replace('_', ' ')}: {err}")
            raise GrammarError(f"{field}: {reason}", field) from None
        except CompileTimeout:
            reason = f"too complex: it did not compile within {pool.timeout_s:g} s (COMPILE_TIMEOUT_S)"
            self._refuse(key, reason, ttl_s=TIMEOUT_REFUSAL_TTL_S)
            raise GrammarError(f"{field}: {reason}", field) from None
        except (PoolBusy, PoolClosed) as err:
            raise GrammarBusy(f"structured outputs are unavailable right now: {err}") from None
        self.num_vetted += 1
        if self._threads is None:
            self._threads = DaemonThreads(COMPILE_THREADS, "qserve-grammar")
        # Cancelling this await leaves the (bounded) compile running; its grammar lands in the cache.
        await asyncio.wrap_future(self._threads.submit(lambda: self.compiler.compile_checked(key, field)))

    def _refuse(self, key: tuple[str, str], reason: str, ttl_s: float | None = None) -> str:
        self._refused[key] = (reason, None if ttl_s is None else time.monotonic() + ttl_s)
        while len(self._refused) > REFUSED_CACHE_SIZE:
            self._refused.popitem(last=False)
        return reason

    def close(self) -> None:
        """Kill the running compiles and the compile process (shutdown); later compiles raise GrammarBusy."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()
