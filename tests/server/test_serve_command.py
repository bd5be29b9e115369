"""``qserve serve``: argument errors, and a real process that serves and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from qserve.cli import build_parser, main
from qserve.commands.serve import build_host_factory, parse_model_args

REPO = Path(__file__).resolve().parents[2]


def serve_args(*argv: str):
    argv = ["serve", *argv]
    return build_parser(argv).parse_args(argv)


def test_model_names():
    assert parse_model_args(["a=/m/x", "/m/y/", "z"]) == [("a", "/m/x"), ("y", "/m/y/"), ("z", "z")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("{llama}", "--kv-cache-dtype", "fp4"), "supported: auto, fp8, int8"),
        (("{llama}", "--gpu-memory-budget", "lots"), "not understood"),
        (("llama={llama}", "--min-share", "other=0.5"), "no model named 'other'"),
        (("llama={llama}", "--max-share", "llama=1.5"), "[0, 1]"),
        (("llama={llama}", "--max-share", "llama"), "NAME=FRACTION"),
        (("a={llama}", "a={llama}"), "unique"),
        (("/definitely/not/here",), "no config.json"),
    ],
)
def test_argument_errors(checkpoints, capsys, argv, message):
    argv = [a.format(llama=checkpoints["llama"]) for a in argv]
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_factory_builds_shared_pool_with_shares(checkpoints):
    args = serve_args(
        f"a={checkpoints['llama']}",
        f"b={checkpoints['qwen']}",
        "--device=cpu",
        "--max-model-len=64",
        "--gpu-memory-budget=1MiB",
        "--min-share=b=0.25",
        "--max-share=a=0.5",
        "--max-queue=3",
    )
    host = build_host_factory(args)()
    a, b = host.models["a"], host.models["b"]
    pool = a.engine.block_pool
    assert pool is b.engine.block_pool and a.max_queue == 3
    page = a.engine.runner.kv_caches[0][0].untyped_storage().nbytes() // pool.num_blocks
    assert pool.num_blocks == (1 << 20) // page
    assert pool.share("b").min_blocks == pool.num_blocks // 4
    assert pool.share("a").max_blocks == pool.num_blocks // 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Poll /health until 200; fail with the server's output if it dies or takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"server did not become ready in {timeout_s} s"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def test_serve_process_answers_and_stops_on_sigterm(checkpoints):
    port = _free_port()
    env = {**os.environ, "QSERVE_API_KEY": "k1"}
    cmd = [
        sys.executable,
        "-m",
        "qserve.cli",
        "--log-level",
        "INFO",
        "serve",
        f"tiny={checkpoints['llama']}",
        "--port",
        str(port),
    ]
    cmd += ["--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "16", "--max-num-seqs", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, timeout_s=60)
        headers = {"Authorization": "Bearer k1"}
        assert httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        r = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}, headers=headers
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully (lifespan: engine thread stopped), then re-raises SIGTERM.
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
        output = proc.stdout.read()
        assert "Application shutdown complete" in output, output
        assert "engine stopped" in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # a real server process that quantizes the demo model first: ~25 s
def test_serve_without_a_model_serves_the_demo(tmp_path):
    """The README's main job: `qserve serve` quantizes the demo model (cached) and answers."""
    port = _free_port()
    env = {**os.environ, "QSERVE_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "qserve.cli", "serve", "--port", str(port), "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, timeout_s=240)
        (model,) = httpx.get(f"{url}/v1/models").json()["data"]
        body = {"model": model["id"], "prompt": "def main(", "max_tokens": 16, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0 and reply.json()["choices"][0]["text"]
        assert any(tmp_path.iterdir()), "the quantized demo model was not cached"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # What the README promises the user sees: where the demo model goes, then one ready line.
    cached = tmp_path / "demo-gptq"
    assert f"quantizing the demo model to 4-bit GPTQ into {cached}" in output, output
    ready = [line for line in output.splitlines() if line.startswith("qserve: ready on ")]
    assert len(ready) == 1, output
    assert f"http://127.0.0.1:{port}" in ready[0] and model["id"] in ready[0] and "KV cache:" in ready[0]
    # A second start reuses the cached copy and says so.
    from qserve.quantize.demo import ensure_demo_model

    said: list[str] = []
    assert ensure_demo_model(str(tmp_path), report=said.append) == str(cached)
    assert said == [f"using the cached 4-bit demo model in {cached} (set QSERVE_CACHE_DIR to move the cache)"]
