"""``qserve serve MODEL --tensor-parallel-size 2`` on CPU: this process is rank 0, one spawned
gloo process is rank 1 (``qserve.engine.tensor_parallel``).

Checked: the served completions (greedy tokens, text, logprobs; plain, batched and streamed)
equal those of the same server at TP=1; ``/v1/models`` lists the one model; the idle keep-alive
(empty steps) leaves the workers in step; stopping the server stops the worker; bad flag
combinations are refused before anything starts, and ``launch_engine``'s own errors (device
count) come through unchanged. The last test runs the real command in a subprocess (spawn
from ``python -m qserve.cli``) and stops it with SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from qserve.cli import build_parser, main
from qserve.commands.serve import build_host_factory
from qserve.distributed import worker
from qserve.server.app import create_app
from tests.server.conftest import serve
from tests.server.test_serve_command import _free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[2]
ENGINE_ARGS = ("--device=cpu", "--dtype=float32", "--max-model-len=128", "--num-kv-blocks=32", "--max-num-seqs=4")
START_TIMEOUT_S = 120  # spawning a rank imports torch and loads the model: seconds on a small CPU
REQUESTS = [
    {"prompt": "The quick brown fox", "max_tokens": 8, "logprobs": 2},
    {"prompt": [[5, 17, 99, 3, 25], list(range(40, 75))], "max_tokens": 6, "logprobs": 1},  # > one 16-token block
    {"prompt": "Hello", "max_tokens": 5, "n": 2, "echo": True, "logprobs": 0},
]


def serve_args(*argv: str):  # noqa: ANN201 - argparse.Namespace
    argv = ("serve", *argv)
    return build_parser(list(argv)).parse_args(list(argv))


def _complete(url: str, body: dict) -> dict:
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _stream_text(url: str) -> str:
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 6, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [choice["text"] for choice in json.loads(line[6:])["choices"]]
    return "".join(text)


def _answers(url: str) -> list:
    return [_complete(url, body) for body in REQUESTS] + [_stream_text(url)]


def _assert_same(want: list, got: list) -> None:
    assert got[-1] == want[-1]  # the streamed text
    for ref, out in zip(want[:-1], got[:-1]):
        assert out["usage"] == ref["usage"]
        assert len(out["choices"]) == len(ref["choices"])
        for a, b in zip(ref["choices"], out["choices"]):
            assert (b["index"], b["text"], b["finish_reason"]) == (a["index"], a["text"], a["finish_reason"])
            want, have = a["logprobs"], b["logprobs"]
            assert have["tokens"] == want["tokens"] and have["text_offset"] == want["text_offset"]
            for x, y in zip(want["token_logprobs"], have["token_logprobs"], strict=True):
                assert (x is None and y is None) or abs(x - y) <= 1e-4
            for x, y in zip(want["top_logprobs"], have["top_logprobs"], strict=True):  # float32, two ranks
                assert (x is None and y is None) or (x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 1e-4 for k in x))


def _workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("qserve-tp")]


class _CountingRunner:
    """Wraps rank 0's runner: counts the empty steps (keep-alives) it broadcasts."""

    def __init__(self, runner) -> None:  # noqa: ANN001
        self.runner = runner
        self.num_empty = 0

    def execute(self, scheduler_output):  # noqa: ANN001, ANN201
        if scheduler_output.is_empty:
            self.num_empty += 1
        return self.runner.execute(scheduler_output)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.runner, name)


@dataclass
class TPServer:
    url: str
    app: object
    workers: list
    stop: contextlib.ExitStack


@pytest.fixture(scope="module")
def tp1_answers(checkpoints) -> list:
    app = create_app(host_factory=build_host_factory(serve_args(f"tiny={checkpoints['llama']}", *ENGINE_ARGS)))
    with serve(app, timeout=START_TIMEOUT_S) as url:
        return _answers(url)


@pytest.fixture(scope="module")
def tp_server(checkpoints) -> Iterator[TPServer]:
    args = serve_args(f"tiny={checkpoints['llama']}", "--tensor-parallel-size", "2", *ENGINE_ARGS)
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setattr(worker, "KEEPALIVE_S", 0.2)
        app = create_app(host_factory=build_host_factory(args))
        url = stack.enter_context(serve(app, timeout=START_TIMEOUT_S))
        yield TPServer(url, app, _workers(), stack)


def test_tensor_parallel_server_matches_tp1(tp_server, tp1_answers) -> None:
    assert len(tp_server.workers) == 1 and tp_server.workers[0].is_alive()
    engine = tp_server.app.state.qserve.host.models["tiny"].engine
    assert engine.tp.size == 2 and engine.tp.rank == 0
    _assert_same(tp1_answers, _answers(tp_server.url))


def test_models_lists_the_one_model(tp_server) -> None:
    (model,) = httpx.get(f"{tp_server.url}/v1/models").json()["data"]
    assert model["id"] == "tiny"
    assert httpx.get(f"{tp_server.url}/health").status_code == 200


def test_idle_keepalive_keeps_workers_in_step(tp_server, tp1_answers) -> None:
    broadcasting = tp_server.app.state.qserve.host.models["tiny"].engine.runner
    counting = _CountingRunner(broadcasting.runner)
    broadcasting.runner = counting  # rank 0's own runner: sees every step it broadcasts, keep-alives too
    try:
        deadline = time.monotonic() + 10
        while counting.num_empty < 2:
            assert time.monotonic() < deadline, "no keep-alive step while idle"
            time.sleep(0.1)
        _assert_same(tp1_answers, _answers(tp_server.url))
    finally:
        broadcasting.runner = counting.runner
    assert tp_server.workers[0].is_alive()


def test_stopping_the_server_stops_the_workers(tp_server) -> None:
    tp_server.stop.close()  # uvicorn exits; the lifespan shuts the AsyncEngine down
    assert not any(p.is_alive() for p in tp_server.workers)
    assert not _workers()
    assert not tp_server.app.state.qserve.host.is_running


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("a={llama}", "b={llama}", "--tensor-parallel-size", "2"), "--tensor-parallel-size 2 serves one model; got 2"),
        (("{llama}", "--tensor-parallel-size", "0"), "--tensor-parallel-size must be >= 1, got 0"),
        (("{llama}", "--tensor-parallel-size", "-2"), "--tensor-parallel-size must be >= 1, got -2"),
        (("m={llama}", "--tensor-parallel-size", "2", "--min-share", "m=0.5"), "--min-share / --max-share"),
        (("m={llama}", "--tensor-parallel-size", "2", "--max-share", "m=0.5"), "--tensor-parallel-size 2 the one"),
    ],
)
def test_argument_errors(checkpoints, capsys, argv, message) -> None:
    argv = [a.format(llama=checkpoints["llama"]) for a in argv]
    assert main(["serve", "--port", "0", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not _workers()


def test_launcher_errors_come_through_unchanged(checkpoints, capsys, monkeypatch) -> None:
    """Checked by ``launch_engine`` when the model loads (after the server is up): the serve
    command exits 2 with its message. No process is spawned: the check comes first."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["serve", "--port", "0", checkpoints["llama"], "--tensor-parallel-size", "2", "--device", "cuda"]
    assert main(argv) == 2
    assert "tensor_parallel_size=2 needs 2 CUDA devices, 1 visible" in capsys.readouterr().err
    assert not _workers()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's pid
                    found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may not reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_serve_command_with_tensor_parallel_stops_on_sigterm(checkpoints) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "qserve.cli", "--log-level", "INFO", "serve", f"tiny={checkpoints['llama']}"]
    cmd += ["--port", str(port), "--tensor-parallel-size", "2", *ENGINE_ARGS]
    env = {k: v for k, v in os.environ.items() if k != "QSERVE_API_KEY"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, timeout_s=START_TIMEOUT_S)
        children = _children(proc.pid)
        worker_cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children]
        assert sum(b"spawn_main" in line for line in worker_cmdlines) == 1, worker_cmdlines
        assert _complete(url, {"prompt": "Hi", "max_tokens": 3})["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        output = proc.stdout.read()
        assert "tensor parallel: 2 ranks (gloo)" in output and "engine stopped" in output, output
        assert "terminating them" not in output, output  # the worker stopped when told to
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in children):
            assert time.monotonic() < deadline, f"left running: {[p for p in children if _running(p)]}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
