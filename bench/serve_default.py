"""Which process layout ``qserve serve`` picks by default, checked on a real server: start it on a model
with ``QSERVE_ENABLE_MULTIPROCESSING`` unset, wait until ``/health`` answers 200, say whether an engine
core process (``python -m qserve.engine.core.core``) runs under it, send one completion, then SIGTERM it
and report its exit code. Prints one ``key: value`` line each; exit 0 only when the server answered
and exited 0. The server logs at INFO; its lines are timestamped on arrival (seconds since the
command started) and the start-up milestones among them (load, memory plan, graph captures, the
core's hand-shake, uvicorn) are printed, so the time to ready can be broken down.
``--multiprocessing 0|1`` sets ``QSERVE_ENABLE_MULTIPROCESSING`` instead of leaving it unset: the
same start-up in one process or with the core process forced, to compare against the default.
``--profile-startup FILE``: py-spy (``--subprocesses --threads``, raw) records the server and its core
process from launch to exit, and the samples taken while decode graphs were captured are summarized
(bench/pyspy_summary.py ``--within capture_decode_graphs``): why the core process captured them in
about twice the time one process took.

    python3 bench/serve_default.py /tmp/qb [--port 8011] [--multiprocessing 0] [--profile-startup F] [-- extra args]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.pyspy_summary when run as a script

CORE_MODULE = "qserve.engine.core.core"
# Start-up log lines worth a timestamp (substrings, case-insensitive).
MILESTONES = (
    "loaded",
    "loading",
    "memory plan",
    "captured",
    "warm",
    "engine core",
    "kv pool",
    "compil",
    "application startup",
    "uvicorn running",
    "allocator setting",
)


def timestamp_lines(stream, started: float, into: list[tuple[float, str]]) -> None:  # noqa: ANN001
    """Read the server's output until it closes, keeping (seconds since ``started``, line)."""
    for line in stream:
        into.append((time.monotonic() - started, line.rstrip()))


def children_running(parent: int, module: str) -> list[int]:
    """PIDs of the processes whose parent is ``parent`` and whose command line names ``module`` (/proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past the command's parentheses
        if ppid == parent and module in cmdline:
            found.append(int(entry.name))
    return found


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument(
        "--multiprocessing",
        choices=("unset", "0", "1"),
        default="unset",
        help="QSERVE_ENABLE_MULTIPROCESSING for the server (unset: qserve serve's default layout)",
    )
    parser.add_argument("--profile-startup", metavar="FILE", help="py-spy raw profile of the server's whole run here")
    parser.add_argument("extra", nargs="*", help="more qserve serve arguments (after --)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "QSERVE_ENABLE_MULTIPROCESSING"}
    if args.multiprocessing != "unset":
        env["QSERVE_ENABLE_MULTIPROCESSING"] = args.multiprocessing
    print(f"QSERVE_ENABLE_MULTIPROCESSING: {args.multiprocessing}")
    cmd = [sys.executable, "-m", "qserve.cli", "--log-level", "INFO", "serve", args.model, "--port", str(args.port)]
    cmd += args.extra
    started = time.monotonic()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=timestamp_lines, args=(server.stdout, started, lines), daemon=True)
    reader.start()
    profiler = None
    url = f"http://127.0.0.1:{args.port}"
    try:
        if args.profile_startup:  # inside the try: a py-spy that cannot start still stops the server
            profiler = start_profiler(server.pid, args.profile_startup)
        while get(f"{url}/health")[0] != 200:
            if server.poll() is not None or time.monotonic() - started > args.ready_timeout:
                print(f"ready: no (exit {server.poll()})")
                return 1
            time.sleep(0.5)
        print(f"ready: {time.monotonic() - started:.1f} s")
        cores = children_running(server.pid, CORE_MODULE)
        print(f"engine core process: {'yes, pid ' + str(cores[0]) if cores else 'no (the engine runs in the server)'}")
        model = json.loads(get(f"{url}/v1/models")[1])["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            usage = json.loads(reply.read())["usage"]
        print(f"completion: {usage['completion_tokens']} tokens")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
        reader.join(timeout=10)
        print(f"exit code after SIGTERM: {code}")
        print("start-up milestones (s since the command started):")
        for at, line in lines:
            if any(word in line.lower() for word in MILESTONES):
                print(f"  {at:7.1f}  {line[:200]}")
        if code != 0:
            print("\n".join(line for _, line in lines[-60:]))
        if profiler is not None:
            print_profile(profiler, args.profile_startup)
    return 0 if code == 0 else 1


def start_profiler(pid: int, out: str) -> subprocess.Popen:
    """py-spy recording ``pid`` and the processes it starts until it exits (from PATH, else where the
    device call's ``pip install --target /tmp/site`` put the carried wheel's binary)."""
    pyspy = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
    # --idle: samples of threads that wait too (decode-graph capture is mostly outside Python's CPU time)
    cmd = [pyspy, "record", "-s", "-t", "--idle", "-r", "100", "-p", str(pid), "-f", "raw", "-o", out, "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def print_profile(profiler: subprocess.Popen, out: str) -> None:
    """Wait for py-spy (it stops when the server has exited) and print the capture phase's summary."""
    try:
        _, errors = profiler.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        profiler.kill()
        _, errors = profiler.communicate()
    if not Path(out).exists():
        print(f"py-spy wrote no profile (exit {profiler.returncode}): {errors.strip()[-500:]}")
        return
    from bench.pyspy_summary import summarize

    lines = Path(out).read_text().splitlines()
    print("py-spy, the samples taken while decode graphs were captured:")
    print(summarize(lines, top=12, within="capture_decode_graphs"))


if __name__ == "__main__":
    sys.exit(main())
