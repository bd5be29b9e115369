"""How ``qserve serve --api-server-count N``'s parent ends the run when one API server process dies
on its own (issue 27): as vLLM's launcher does, the whole run stops (the others are drained with
SIGTERM, the run exits 1 for its supervisor to restart it) instead of serving on with fewer front
ends. Stand-in processes (a few lines of Python each) play the core and the API servers, so this
runs in seconds; ``test_api_server_count.py`` does it with real ones."""

from __future__ import annotations

import subprocess
import sys
import time

from qserve.commands import multi_api_server

# An API server that drains on SIGTERM (exit 0, as a drained one does) and otherwise runs long.
DRAINS_ON_SIGTERM = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
time.sleep(20)
"""
KILLED = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
CORE = "import time; time.sleep(1)"  # leaves once its front ends have (here: soon, whatever happens)


def _python(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def test_an_api_server_that_dies_stops_the_run_with_exit_1(capsys):
    survivor = _python(DRAINS_ON_SIGTERM)
    assert survivor.stdout is not None and survivor.stdout.readline() == b"ready\n"  # its handler is set
    core, killed = _python(CORE), _python(KILLED)
    started = time.monotonic()
    try:
        code = multi_api_server._wait(core, [killed, survivor], [], shutdown_timeout=5.0)  # noqa: SLF001
    finally:
        for process in (core, killed, survivor):
            if process.poll() is None:
                process.kill()
            process.wait()
            process.stdout.close()  # type: ignore[union-attr]
    assert code == 1
    assert survivor.returncode == 0  # it was asked to drain (SIGTERM), not killed at the deadline
    assert time.monotonic() - started < 4  # not the survivor's 20 s: it did not serve on
    err = capsys.readouterr().err
    assert f"API server 0 (pid {killed.pid}) exited with status -9" in err and "every process stopped" in err
