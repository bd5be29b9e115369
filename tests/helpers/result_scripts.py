"""Run a test's compile script in a fresh interpreter and read back what it printed.

Knows: the convention of the compile tests' scripts (kernels compiled ahead of time for a GPU
target, no GPU: they run without ``TRITON_INTERPRET``, which the test process sets, and print one
``RESULT<json>`` line), what a Triton without the NVIDIA backend says (the test skips), and how
those scripts count what a kernel stores to shared memory in its PTX. Must not know: what any
script compiles or what its test asserts.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def script_env() -> dict[str, str]:
    """This process's environment without ``TRITON_INTERPRET`` (the kernels must really compile),
    the checkout first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _parse_result(returncode: int, stdout: str, stderr: str) -> object:
    if returncode != 0:
        if "backend" in stderr.lower() and "nvidia" in stderr.lower():
            pytest.skip("this triton has no NVIDIA backend")
        raise AssertionError(f"the compile script failed (exit {returncode}):\n{stderr[-3000:]}")
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def run_result_script(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> object:
    """``python -c script *args`` from the checkout; its ``RESULT`` line's JSON. Skips the test on a
    Triton without the NVIDIA backend; any other failure fails it with the script's stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env or script_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    return _parse_result(proc.returncode, proc.stdout, proc.stderr)


class BackgroundJob:
    """A command that a ``BackgroundPool`` worker runs, niced, when it gets to it: its stdout into a
    file, its stderr into another (or the same one: ``stderr=None``)."""

    def __init__(self, cmd: list[str], env: dict[str, str], stdout: Path, stderr: Path | None = None) -> None:
        self.cmd, self.env, self.stdout, self.stderr = cmd, env, stdout, stderr
        self.proc: subprocess.Popen | None = None
        self.error: BaseException | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        self._done = threading.Event()

    def _run(self) -> None:
        try:
            with self._lock:
                if self._cancelled:
                    return
                with open(self.stdout, "w") as out, open(self.stderr or os.devnull, "w") as err:
                    self.proc = subprocess.Popen(
                        self.cmd, cwd=ROOT, env=self.env, stdout=out,
                        stderr=err if self.stderr else subprocess.STDOUT,
                    )  # fmt: skip
                # behind the tests running meanwhile: 10 below this process (setpriority sets, nice adds)
                with contextlib.suppress(OSError):
                    niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
                    os.setpriority(os.PRIO_PROCESS, self.proc.pid, niceness)
            self.proc.wait()
        except BaseException as exc:  # noqa: BLE001 - kept for the waiter; the worker goes on to the next job
            self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout: float) -> int | None:
        """Its exit code, once a worker has started and finished it (None: cancelled before it started).
        Raises what stopped the worker from running it (a missing file, a failed ``Popen``)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.cmd[:4]} did not finish within {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"{self.cmd[:4]} could not run: {self.error!r}") from self.error
        return None if self.proc is None else self.proc.returncode

    def cancel(self) -> None:
        """A job not yet started never starts."""
        with self._lock:
            self._cancelled = True

    def kill(self) -> None:
        with self._lock:
            self._cancelled = True
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


class BackgroundPool:
    """Runs submitted ``BackgroundJob``s in order, ``workers`` at a time: the compile drives and scripts
    the session starts at collection run beside its tests without crowding them (seven processes
    started at once slowed a test starting a Ray cluster from 52 s to 146 s on two cores)."""

    def __init__(self, workers: int = 2) -> None:
        self._queue: queue.Queue[BackgroundJob | None] = queue.Queue()
        self._jobs: list[BackgroundJob] = []
        self._workers = workers
        for _ in range(workers):
            threading.Thread(target=self._work, daemon=True).start()

    def submit(self, job: BackgroundJob) -> BackgroundJob:
        self._jobs.append(job)
        self._queue.put(job)
        return job

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            job._run()

    def shutdown(self) -> None:
        """Cancel what waits, then kill what runs (in that order: a worker freed by a kill must find
        the next job cancelled), end the workers."""
        for job in self._jobs:
            job.cancel()
        for job in self._jobs:
            job.kill()
        for _ in range(self._workers):
            self._queue.put(None)


class StartedScript:
    """``run_result_script`` queued on ``pool`` (its output into files under ``folder``): ``result()``
    waits for it and reads what the blocking call would return."""

    def __init__(
        self, script: str, *args: str, env: dict[str, str], folder: Path, name: str, pool: BackgroundPool
    ) -> None:
        self.job = pool.submit(
            BackgroundJob([sys.executable, "-c", script, *args], env, folder / f"{name}.out", folder / f"{name}.err")
        )

    def result(self, timeout: float = 1200) -> object:
        returncode = self.job.wait(timeout)
        if returncode is None:
            raise AssertionError(
                f"the compile script was cancelled before it ran (the session is ending): {self.job.cmd[:2]}"
            )
        return _parse_result(returncode, self.job.stdout.read_text(), self.job.stderr.read_text())


def shared_store_bytes(ptx: str) -> int:
    """Bytes per thread a kernel's PTX stores to shared memory: ``st.shared[.vN].bW`` plus
    ``stmatrix`` (4 B per matrix)."""
    st = sum(
        int(m.group(1) or 1) * int(m.group(2)) // 8
        for m in re.finditer(r"\bst\.shared(?:::cta)?(?:\.v(\d))?\.b(\d+)", ptx)
    )
    return st + sum(4 * int(m.group(1)) for m in re.finditer(r"\bstmatrix\.sync\.aligned\.m8n8\.x(\d)", ptx))
