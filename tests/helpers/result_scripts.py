"""Run a test's compile script in a fresh interpreter and read back what it printed.

Knows: the convention of the compile tests' scripts (kernels compiled ahead of time for a GPU
target, no GPU: they run without ``TRITON_INTERPRET``, which the test process sets, and print one
``RESULT<json>`` line), what a Triton without the NVIDIA backend says (the test skips), and how
those scripts count what a kernel stores to shared memory in its PTX. Must not know: what any
script compiles or what its test asserts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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


def lower_priority() -> None:  # in the child, before exec: the tests running meanwhile come first
    os.nice(10)


class StartedScript:
    """``run_result_script`` started now, niced, in the background (its output into files under
    ``folder``): ``result()`` waits for it and reads what the blocking call would return."""

    def __init__(self, script: str, *args: str, env: dict[str, str], folder: Path, name: str) -> None:
        self.out, self.err = folder / f"{name}.out", folder / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", script, *args], cwd=ROOT, env=env, stdout=out, stderr=err,
                preexec_fn=lower_priority,
            )  # fmt: skip

    def result(self, timeout: float = 1200) -> object:
        self.proc.wait(timeout=timeout)
        return _parse_result(self.proc.returncode, self.out.read_text(), self.err.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def shared_store_bytes(ptx: str) -> int:
    """Bytes per thread a kernel's PTX stores to shared memory: ``st.shared[.vN].bW`` plus
    ``stmatrix`` (4 B per matrix)."""
    st = sum(
        int(m.group(1) or 1) * int(m.group(2)) // 8
        for m in re.finditer(r"\bst\.shared(?:::cta)?(?:\.v(\d))?\.b(\d+)", ptx)
    )
    return st + sum(4 * int(m.group(1)) for m in re.finditer(r"\bstmatrix\.sync\.aligned\.m8n8\.x(\d)", ptx))
