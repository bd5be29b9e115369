"""Async scheduling through the server: the same completions, usage and ``/metrics`` token counts
as with ``--no-async-scheduling`` (the extra token computed for finished requests is never
counted)."""

from __future__ import annotations

import json

import httpx

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.server.app import create_app
from tests.server.conftest import host_config, serve

BODIES = [
    {"prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 0, "ignore_eos": True},
    {"prompt": [11, 12, 13], "max_tokens": 12, "temperature": 0, "stop": ["e", "a"]},
    {"prompt": [20, 21], "max_tokens": 7, "temperature": 0.9, "seed": 5, "n": 2, "logprobs": 2},
    {"prompt": [30, 31, 32], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
     "stream_options": {"include_usage": True}},
]  # fmt: skip
COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total")


def _run(checkpoint: str, async_scheduling: bool) -> tuple[list, dict[str, float]]:
    engines = build_engines([ModelSpec("m", checkpoint)], host_config(async_scheduling=async_scheduling))
    assert engines["m"].async_scheduling is async_scheduling
    results = []
    with serve(create_app(AsyncEngine(engines))) as url:
        for body in BODIES:
            response = httpx.post(f"{url}/v1/completions", json={"model": "m", **body}, timeout=60)
            assert response.status_code == 200, response.text
            if body.get("stream"):
                chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
                texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]  # one chunk per token
                results.append((texts, chunks[-1]["usage"]))
            else:
                data = response.json()
                results.append(([(c["text"], c["finish_reason"]) for c in data["choices"]], data["usage"]))
        text = httpx.get(f"{url}/metrics").text
    counters = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(COUNTERS)
    }
    return results, counters


def test_same_completions_usage_and_metrics_with_async_scheduling_on_and_off(checkpoints):
    sync_results, sync_counters = _run(checkpoints["llama"], False)
    async_results, async_counters = _run(checkpoints["llama"], True)
    assert async_results == sync_results
    assert async_counters == sync_counters
    generated = async_counters['vllm:generation_tokens_total{model_name="m"}']
    assert generated == sum(usage["completion_tokens"] for _, usage in async_results)
    assert len(async_results[3][0]) == BODIES[3]["max_tokens"]
