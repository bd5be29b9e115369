"""The grammar-compile zygote: ``python -m qserve.structured.compile_worker``.

Knows: its line protocol (one JSON object per line) and ``fork``. It starts once per model,
imports xgrammar once (seconds: xgrammar imports torch) and reads the tokenizer
(``{"tokenizer_info": <TokenizerInfo.serialize_json()>}``, answered ``{"ready": true}``). Then
for each job ``{"id", "kind", "text"}`` it forks a child that compiles the constraint exactly
as the server would (``qserve.structured.build``) and exits; it answers ``{"id", "pid"}`` at
once and the child answers ``{"id", "ok": true, "seconds"}`` or ``{"id", "error"}``. The server
kills a child by its pid when the request's time runs out or its client leaves; a fork costs
milliseconds, so killing costs nothing to replace. The zygote itself runs no compile and
starts no thread. Must not know: the server, asyncio.

Why a process: xgrammar's compile is C++ that no thread can interrupt. The compiled grammar does
not come back (a serialized one is tens of MB for a large schema and slower to load than to
compile again): the child proves that the constraint compiles within the time limit, then the
server compiles it in-process, where the engine samples with it (``qserve.structured.gate``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

MAX_ANSWER_BYTES = 4000  # below PIPE_BUF: one write() is atomic, so children never interleave


def _die_with_parent() -> None:
    """Linux: be killed when the parent dies, even in the middle of a compile."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - elsewhere, stdin EOF ends the zygote
        pass


def _answer(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    if len(data) > MAX_ANSWER_BYTES:
        message = {**message, "error": str(message.get("error", ""))[:500] + " ..."}
        data = (json.dumps(message) + "\n").encode()[:MAX_ANSWER_BYTES]
    os.write(fd, data)


def _compile_and_exit(fd: int, info: object, job: dict) -> None:
    """In the forked child: compile, answer, exit (never returns)."""
    code = 0
    try:
        _die_with_parent()
        from qserve.structured.build import clean_error, compile_constraint, xgrammar

        start = time.perf_counter()
        try:
            compiler = xgrammar().GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compile_constraint(compiler, job["kind"], job["text"])
            _answer(fd, {"id": job["id"], "ok": True, "seconds": time.perf_counter() - start})
        except Exception as err:  # noqa: BLE001 - the library raises RuntimeError for every bad input
            _answer(fd, {"id": job["id"], "error": clean_error(err)})
    except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
        code = 1
    finally:
        os._exit(code)


def main() -> None:
    _die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    # The protocol owns the original stdout; anything a library prints goes to stderr.
    fd = os.dup(1)
    os.dup2(2, 1)
    from qserve.structured.build import xgrammar

    xgr = xgrammar()
    first = json.loads(sys.stdin.readline() or "{}")
    info = xgr.TokenizerInfo.deserialize_json(first["tokenizer_info"])
    _answer(fd, {"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _compile_and_exit(fd, info, job)
        _answer(fd, {"id": job["id"], "pid": pid})


if __name__ == "__main__":
    main()
