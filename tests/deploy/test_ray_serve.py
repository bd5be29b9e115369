"""qserve under Ray Serve on a local CPU-only Ray cluster: the demo model is served through
Ray's proxy, and under load Ray scales the deployment from 1 to 2 replicas.

Bounded and self-cleaning: every wait has a deadline, and Serve and Ray are shut down in
``finally``. Sized for a 2-core machine (two replicas of half a CPU each)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from deploy.ray_serve import build_app  # noqa: E402
from qserve.quantize.demo import DEMO_MODEL  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCALE_UP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replicas(app: str, deployment: str) -> int:
    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.slow  # a Ray cluster and two replicas: 1-3 minutes on a busy 2-core machine
@pytest.mark.timeout(600)
def test_ray_serve_serves_the_demo_model_and_scales_from_one_to_two_replicas():
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": python_path}},
        logging_level="WARNING",
    )
    stop = threading.Event()
    load: list[threading.Thread] = []
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            {
                "model": f"demo={DEMO_MODEL}",  # the committed demo checkpoint (no quantization step)
                "serve_args": "--device cpu --max-model-len 512 --num-kv-blocks 128 --max-num-seqs 8",
                "min_replicas": 1,
                "max_replicas": 2,
                "target_ongoing_requests": 1,
                "num_cpus": 0.5,
                "upscale_delay_s": 1,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 2,
                "graceful_shutdown_timeout_s": 5,
            }
        )
        serve.run(app, name="qserve", route_prefix="/")  # returns once the first replica is ready
        url = f"http://127.0.0.1:{port}"
        assert _replicas("qserve", "qserve") == 1
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        body = {"model": "demo", "prompt": "def main(", "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0 and reply.json()["choices"][0]["text"]

        def client() -> None:
            # short requests back to back keep the replica's ongoing count above its target as long ones
            # did, and each thread then finishes its last one within seconds of ``stop`` (256 tokens made
            # the clean-up below wait on six long requests)
            long = {"model": "demo", "prompt": "import os\n", "max_tokens": 48, "ignore_eos": True}
            while not stop.is_set():
                try:
                    httpx.post(f"{url}/v1/completions", json=long, timeout=120)
                except httpx.HTTPError:
                    time.sleep(0.1)

        load = [threading.Thread(target=client, daemon=True) for _ in range(6)]
        for thread in load:
            thread.start()
        deadline = time.monotonic() + SCALE_UP_TIMEOUT_S
        while _replicas("qserve", "qserve") < 2:
            assert time.monotonic() < deadline, f"did not scale to 2 replicas: {serve.status()}"
            time.sleep(1)
        stop.set()
        # Both replicas answer: Ray spreads requests over them.
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    finally:
        stop.set()
        for thread in load:
            thread.join(timeout=130)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
