"""Prometheus metrics of the server, with vLLM's names and labels where vLLM has them.

Knows: the metric names (``vllm:*`` as vLLM exports them, ``qserve:*`` for the shared page
pool), their ``model_name`` label, histogram buckets, and how per-request events
(``RequestListener``) and the host's live numbers (``AsyncEngine.stats``, read at scrape
time by a custom collector) become samples. Everything lives in one ``CollectorRegistry``
per app: no global state. Must not know: HTTP routing, engines' internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qserve.engine.async_engine import AsyncEngine
from qserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _HostCollector(Collector):
    """Gauges read from the host at scrape time (queues, page pool, prefix cache)."""

    def __init__(self, host: Callable[[], AsyncEngine | None]) -> None:
        self._host = host

    def collect(self) -> Iterator[Metric]:
        host = self._host()
        labels = ["model_name"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Sequences running on the model.", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Sequences waiting for a seat.", labels=labels)
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "Fraction of the shared KV page pool this model holds (1 = all).", labels=labels
        )
        used = GaugeMetricFamily(
            "qserve:pool_pages_used", "KV pages of the shared pool held by the model.", labels=labels
        )
        total = GaugeMetricFamily("qserve:pool_pages_total", "KV pages in the shared pool.", labels=labels)
        free = GaugeMetricFamily("qserve:pool_pages_free", "Free KV pages in the shared pool.", labels=labels)
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=labels
        )
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=labels)
        if host is not None:
            for name, stats in host.stats().items():
                running.add_metric([name], stats["num_running"])
                waiting.add_metric([name], stats["num_waiting"])
                usage.add_metric([name], stats["pool_pages_used"] / max(stats["pool_pages_total"], 1))
                used.add_metric([name], stats["pool_pages_used"])
                total.add_metric([name], stats["pool_pages_total"])
                free.add_metric([name], stats["pool_pages_free"])
                queries.add_metric([name], stats["prefix_cache_queries"])
                hits.add_metric([name], stats["prefix_cache_hits"])
        yield from (running, waiting, usage, used, total, free, queries, hits)


class ServerMetrics:
    """The app's registry plus the per-request event sink (a ``RequestListener``)."""

    def __init__(self, host: Callable[[], AsyncEngine | None]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests.", ["model_name", "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", labels, buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.registry.register(_HostCollector(host))

    # RequestListener --------------------------------------------------------------
    def on_first_token(self, model: str, seconds: float, num_prompt_tokens: int) -> None:
        self.ttft.labels(model).observe(seconds)
        self.prompt_tokens.labels(model).inc(num_prompt_tokens)

    def on_tokens(self, model: str, num_tokens: int, seconds_since_last: float | None) -> None:
        self.generation_tokens.labels(model).inc(num_tokens)
        if seconds_since_last is not None:
            self.itl.labels(model).observe(seconds_since_last)

    def on_finished(self, model: str, output: RequestOutput, seconds: float) -> None:
        reason = output.outputs[0].finish_reason if output.outputs else None
        self.request_success.labels(model, reason or "abort").inc()
        self.e2e.labels(model).observe(seconds)

    # -------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
