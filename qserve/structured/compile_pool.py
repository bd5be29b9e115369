"""Time-limited grammar compiles in child processes that can be killed.

Knows: how to start the compile zygote (``qserve.structured.compile_worker``, an asyncio
subprocess of the server's loop), send it jobs, match its answers to them, bound how many
compile at once (``workers``), and kill a job's process when its time runs out, when its
request is cancelled (the client left) or on ``close()`` (shutdown). Must not know: HTTP, the
engine, xgrammar (the zygote's children compile).

Why processes: a compile is C++ that no thread can stop, and on this CPU it can run minutes
(a 100k-value enum: 52 s; 500 optional properties with a 32k vocabulary: 78 s; see
docs/structured_output.md). A job that runs past the limit is killed, so an abandoned or
pathological compile holds nothing once its request is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
from typing import Any

logger = logging.getLogger(__name__)

COMPILE_WORKERS = 2  # compiles at once per model (each in its own child process)
COMPILE_TIMEOUT_S = 10.0  # per constraint: its compile in a child; waiting for a free slot has the same limit
START_TIMEOUT_S = 120.0  # the zygote imports xgrammar (and so torch): seconds, more on a loaded CPU
_LINE_LIMIT = 1 << 20


class CompileTimeout(Exception):
    """The constraint did not compile within the time limit (its process was killed)."""


class PoolBusy(Exception):
    """No compile slot became free in time (every slot was busy), or the zygote did not start."""


class PoolClosed(Exception):
    """The pool was closed (the server is shutting down)."""


class CompileFailed(ValueError):
    """The grammar library refused the constraint; the message is the library's."""


class _Job:
    def __init__(self, job_id: int, future: asyncio.Future[dict[str, Any]]) -> None:
        self.id = job_id
        self.future = future
        self.pid: int | None = None


class CompilePool:
    """``await pool.check(kind, text)`` returns the compile's seconds when the constraint compiles
    within ``timeout_s``; otherwise CompileFailed, CompileTimeout, PoolBusy or PoolClosed. One
    event loop uses a pool (the one that first calls ``check``)."""

    def __init__(
        self, tokenizer_info: str, *, workers: int = COMPILE_WORKERS, timeout_s: float = COMPILE_TIMEOUT_S
    ) -> None:
        self.timeout_s = timeout_s
        self._tokenizer_info = tokenizer_info
        self._slots: asyncio.Semaphore | None = None
        self._workers = workers
        self._zygote: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._jobs: dict[int, _Job] = {}
        self._abandoned: set[int] = set()  # jobs given up before their pid came: kill it when it does
        self._ids = itertools.count()
        self._closed = False
        self.num_killed = 0  # compiles killed on timeout or cancellation (tests, logs)

    # ------------------------------------------------------------------ the zygote
    def start(self) -> None:
        """Start the zygote in the background (on the loop that will use the pool)."""
        if self._closed or self._ready is not None and (not self._ready.done() or self._alive()):
            return  # starting, or running
        self._slots = self._slots or asyncio.Semaphore(self._workers)
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._run_zygote(self._ready))

    def _alive(self) -> bool:
        return self._zygote is not None and self._zygote.returncode is None

    async def _run_zygote(self, ready: asyncio.Future[None]) -> None:
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "qserve.structured.compile_worker",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=_LINE_LIMIT,
            )
            self._zygote = process
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(json.dumps({"tokenizer_info": self._tokenizer_info}).encode() + b"\n")
            await process.stdin.drain()
            first = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
            if not first.startswith(b'{"ready"'):
                raise RuntimeError(f"the grammar-compile process did not start: {first[:200]!r}")
            ready.set_result(None)
            while line := await process.stdout.readline():
                self._on_answer(json.loads(line))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - logged; check() answers PoolBusy meanwhile
            logger.warning("grammar-compile process: %s", err)
            if not ready.done():
                ready.set_exception(PoolBusy(f"the grammar compiler did not start: {err}"))
        finally:
            if not ready.done():
                ready.set_exception(PoolClosed("the grammar compiler is shut down"))
            self._kill_zygote()
            for job in self._jobs.values():  # the zygote is gone: nobody will answer these
                if not job.future.done():
                    job.future.set_exception(PoolClosed("the grammar-compile process exited"))

    def _on_answer(self, answer: dict[str, Any]) -> None:
        job_id = answer.get("id", -1)
        job = self._jobs.get(job_id)
        if "pid" in answer and job_id in self._abandoned:  # given up before its pid came
            self._abandoned.discard(job_id)
            self._kill(answer["pid"])
        elif job is None:
            self._abandoned.discard(job_id)  # it answered by itself: nothing left to kill

        elif "pid" in answer:
            job.pid = answer["pid"]
        elif not job.future.done():
            job.future.set_result(answer)

    def _kill_zygote(self) -> None:
        if self._zygote is not None and self._zygote.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._zygote.kill()

    @staticmethod
    def _kill(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ jobs
    async def check(self, kind: str, text: str) -> float:
        """Compile ``(kind, text)`` in a child process within ``timeout_s``; returns its seconds."""
        if self._closed:
            raise PoolClosed("the grammar compiler is shut down")
        self.start()
        assert self._slots is not None and self._ready is not None
        ready = self._ready
        starting = not ready.done()
        # Waiting for a slot is bounded too (longer while the zygote is still starting).
        wait_s = self.timeout_s + (START_TIMEOUT_S if starting else 0.0)
        try:
            await asyncio.wait_for(self._slots.acquire(), wait_s)
        except asyncio.TimeoutError:
            raise PoolBusy(f"every grammar-compile slot stayed busy for {wait_s:g} s") from None
        try:
            try:
                await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise PoolBusy("the grammar compiler did not start in time") from None
            if self._closed or not self._alive():
                raise PoolClosed("the grammar compiler is shut down")
            return await self._run_job(kind, text)
        finally:
            self._slots.release()

    async def _run_job(self, kind: str, text: str) -> float:
        assert self._zygote is not None and self._zygote.stdin is not None
        job_id = next(self._ids)
        job = _Job(job_id, asyncio.get_running_loop().create_future())
        self._jobs[job_id] = job
        try:
            self._zygote.stdin.write(json.dumps({"id": job_id, "kind": kind, "text": text}).encode() + b"\n")
            await self._zygote.stdin.drain()
            answer = await asyncio.wait_for(asyncio.shield(job.future), self.timeout_s)
        except asyncio.TimeoutError:
            self._give_up(job)
            raise CompileTimeout(f"it did not compile within {self.timeout_s:g} s") from None
        except BaseException:  # cancelled (the client left), closed, or the pipe broke
            self._give_up(job)
            raise
        finally:
            self._jobs.pop(job_id, None)
        if "error" in answer:
            raise CompileFailed(answer["error"])
        return float(answer.get("seconds", 0.0))

    def _give_up(self, job: _Job) -> None:
        if job.future.done():
            return
        job.future.cancel()
        self.num_killed += 1
        if job.pid is not None:
            self._kill(job.pid)
        else:
            self._abandoned.add(job.id)

    def close(self) -> None:
        """Kill every compile and the zygote now; waiting checks raise PoolClosed."""
        self._closed = True
        for job in list(self._jobs.values()):
            if job.pid is not None and not job.future.done():
                self._kill(job.pid)
            if not job.future.done():
                job.future.set_exception(PoolClosed("the grammar compiler is shut down"))
        self._kill_zygote()
        if self._reader is not None:
            self._reader.cancel()
