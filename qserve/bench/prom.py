"""The server's own view of a load point, from its Prometheus ``/metrics``, to cross-check the client.

Knows: vLLM's metric names (``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds`` histograms, ``vllm:generation_tokens`` counter), how to read
their ``_sum`` / ``_count`` for one ``model_name`` and difference two scrapes. Must not know: the
client's timing. Servers without ``/metrics`` (or without these names) give ``None``.

The server times from when the request reaches its engine to when a token is handed to the
HTTP layer, the client from before sending to when the chunk is read: the client's means are
the server's plus the HTTP round trip, which ``agreement`` reports.
"""

from __future__ import annotations

from typing import Any

import httpx

HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2el": "vllm:e2e_request_latency_seconds",
}
GENERATION_TOKENS = "vllm:generation_tokens"


def parse(text: str, model: str) -> dict[str, float]:
    """``{sample name: value}`` of the samples labelled ``model_name=model`` (summed over other labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") != model:
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def scrape(client: httpx.AsyncClient, base_url: str, model: str) -> dict[str, float] | None:
    try:
        response = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse(response.text, model)
    except (ImportError, ValueError):
        return None


def server_view(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """Means (ms) and counts of what the server observed between two scrapes."""
    if before is None or after is None:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    view: dict[str, Any] = {}
    for key, metric in HISTOGRAMS.items():
        count = delta(f"{metric}_count")
        view[f"num_{key}"] = int(count)
        view[f"mean_{key}_ms"] = delta(f"{metric}_sum") / count * 1e3 if count else float("nan")
    tokens = after.get(f"{GENERATION_TOKENS}_total")
    if tokens is not None:
        view["generation_tokens"] = int(tokens - before.get(f"{GENERATION_TOKENS}_total", 0.0))
    if not view.get("num_e2el") and not view.get("num_ttft"):
        return None  # the server exports none of vLLM's histograms
    return view


def agreement(summary: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    """Client minus server, per mean (ms), and whether the token and request counts match."""
    result: dict[str, Any] = {}
    for key in HISTOGRAMS:
        if f"mean_{key}_ms" in summary:  # the metrics --percentile-metrics left out are not compared
            result[f"{key}_client_minus_server_ms"] = summary[f"mean_{key}_ms"] - server[f"mean_{key}_ms"]
    result["requests_match"] = server["num_e2el"] == summary["completed"]
    if "generation_tokens" in server:
        result["tokens_match"] = server["generation_tokens"] == summary["total_output_tokens"]
    return result
