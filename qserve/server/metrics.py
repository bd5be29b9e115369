"""Prometheus metrics of the server, with vLLM's names and labels where vLLM has them.

Knows: the metric names (``vllm:*`` as vLLM exports them, ``qserve:*`` for the shared page
pool), their ``model_name`` label, histogram buckets, and how per-request events
(``RequestListener``) and the host's live numbers (``AsyncEngine.stats``, read at scrape
time by a custom collector) become samples. Everything lives in one ``CollectorRegistry``
per app: no global state. Must not know: HTTP routing, engines' internals.

Several API server processes (``--api-server-count N``): prometheus_client's multiprocess mode.
Each process's counters and histograms live in files of one directory (``PROMETHEUS_MULTIPROC_DIR``,
set in the process's environment before prometheus_client is imported); a scrape of any process
sums them (``MultiProcessCollector``) and adds the live numbers of the engine core, which every
process receives alike. So ``/metrics`` is one view whichever process answers.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qserve.engine.async_engine import AsyncEngine
from qserve.outputs import RequestOutput
from qserve.server.spec_metrics import SpecDecodeCollector
from qserve.server.swap_metrics import SwapCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)  # vLLM's request_params_n buckets
ITERATION_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


REQUEST_LATENCY_BUCKETS = E2E_BUCKETS + (480.0, 960.0, 1920.0, 7680.0)

# The process-wide series of a multi-model server carries this model_name (see _HostCollector).
ALL_MODELS = ""


def _token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_len:
                return tuple(buckets)
            buckets.append(float(value))
        scale *= 10


# vLLM stops these at the context length; the registry exists before the models are loaded,
# so qserve stops them at 1M tokens.
TOKEN_BUCKETS = _token_buckets(1_000_000)


class _HostCollector(Collector):
    """Gauges read from the host at scrape time (queues, page pool, prefix cache, preemptions).

    Routers (the Gateway API inference extension's endpoint picker, llm-d) read the FIRST
    series of a metric. So when the process serves several models, every gauge and info metric
    opens with a process-wide series (``model_name=""``: all models together) followed by one
    series per model; with one model, that model's series is the process total and the only one.
    """

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
        gpu_usage = GaugeMetricFamily(
            "vllm:gpu_cache_usage_perc",
            "Same as vllm:kv_cache_usage_perc (the older name some routers read).",
            labels=labels,
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
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Sequences preempted (recomputed, or swapped to host memory).", labels=labels
        )
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache settings (value 1).",
            labels=[*labels, "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
        )
        lora_info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters of running and waiting requests (comma-separated; never the base model); value: time "
            "of the scrape.",
            labels=[*labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        families = (running, waiting, usage, gpu_usage, used, total, free, queries, hits, preemptions)
        if host is not None:
            stats = host.stats()
            infos = host.cache_info()
            several = len(stats) > 1
            if several:  # the process-wide series first (see the class docstring)
                first = next(iter(stats.values()))
                pages_used = sum(s["pool_pages_used"] for s in stats.values())
                values = {
                    "num_running": sum(s["num_running"] for s in stats.values()),
                    "num_waiting": sum(s["num_waiting"] for s in stats.values()),
                    "pool_pages_used": pages_used,
                    "pool_pages_total": first["pool_pages_total"],
                    "pool_pages_free": first["pool_pages_free"],
                    "prefix_cache_queries": sum(s["prefix_cache_queries"] for s in stats.values()),
                    "prefix_cache_hits": sum(s["prefix_cache_hits"] for s in stats.values()),
                    "num_preemptions": sum(s["num_preemptions"] for s in stats.values()),
                }
                self._add(families, ALL_MODELS, values)
            for name, values in stats.items():
                self._add(families, name, values)
            # Info metrics: one process-wide series (the pool and its page size are shared).
            info = next(iter(infos.values()))
            process_label = ALL_MODELS if several else next(iter(stats))
            cache_info.add_metric(
                [
                    process_label,
                    str(info["block_size"]),
                    str(info["num_gpu_blocks"]),
                    str(info["cache_dtype"]),
                    str(info["enable_prefix_caching"]),
                ],
                1.0,
            )
            # Adapters only: a base model is not an adapter (it made routers pin it as one).
            loras = host.lora_info() if hasattr(host, "lora_info") else {}
            max_lora = sum(info["max_lora"] for info in loras.values())
            running_loras = ",".join(dict.fromkeys(n for info in loras.values() for n in info["running"]))
            waiting_loras = ",".join(dict.fromkeys(n for info in loras.values() for n in info["waiting"]))
            lora_info.add_metric([process_label, str(max_lora), running_loras, waiting_loras], time.time())
        yield from families
        yield from (cache_info, lora_info)

    @staticmethod
    def _add(families: tuple[Metric, ...], label: str, values: dict[str, int]) -> None:
        running, waiting, usage, gpu_usage, used, total, free, queries, hits, preemptions = families
        fraction = values["pool_pages_used"] / max(values["pool_pages_total"], 1)
        running.add_metric([label], values["num_running"])
        waiting.add_metric([label], values["num_waiting"])
        usage.add_metric([label], fraction)
        gpu_usage.add_metric([label], fraction)
        used.add_metric([label], values["pool_pages_used"])
        total.add_metric([label], values["pool_pages_total"])
        free.add_metric([label], values["pool_pages_free"])
        queries.add_metric([label], values["prefix_cache_queries"])
        hits.add_metric([label], values["prefix_cache_hits"])
        preemptions.add_metric([label], values["num_preemptions"])


class ServerMetrics:
    """The app's registry plus the per-request event sink (a ``RequestListener``).
    ``multiprocess_dir``: one of several API server processes (see the module doc)."""

    def __init__(self, host: Callable[[], AsyncEngine | None], multiprocess_dir: str | None = None) -> None:
        disable_created_metrics()  # no *_created series, as vLLM (a process-wide prometheus_client switch)
        self._aggregate: Collector | None = None
        if multiprocess_dir is not None:
            from prometheus_client import multiprocess, values

            if values.ValueClass is values.MutexValue:
                raise RuntimeError(
                    "several API server processes share their metrics through files: PROMETHEUS_MULTIPROC_DIR "
                    "must be set before prometheus_client is imported"
                )
            self._aggregate = multiprocess.MultiProcessCollector(None, path=multiprocess_dir)
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
        # vLLM's Grafana dashboard: per-request sizes and phases.
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per finished request.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request (all its choices).",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited before its first step.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time between tokens (the older name of vllm:inter_token_latency_seconds).",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        # vLLM V1's request phases: prefill (first scheduled -> first token), decode (first -> last
        # token), inference (first scheduled -> last token); and the requests' n.
        self.prefill_time, self.decode_time, self.inference_time = (
            Histogram(f"vllm:request_{phase}_time_seconds", help_, labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
            for phase, help_ in (
                ("prefill", "Time from first scheduled to first token."),
                ("decode", "Time from first to last token."),
                ("inference", "Time from first scheduled to last token."),
            )
        )
        self.params_n = Histogram(
            "vllm:request_params_n", "The n of finished requests.", labels, buckets=N_BUCKETS, registry=r
        )
        self.params_max_tokens = Histogram(
            "vllm:request_params_max_tokens",
            "The max_tokens of finished requests.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Tokens (prompt and generated) per engine step.",
            labels,
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=r,
        )
        self.lora_requests = Counter(
            "qserve:lora_requests",
            "Finished requests per LoRA adapter (the base model's are not counted).",
            [*labels, "lora_name"],
            registry=r,
        )
        host_collectors = (
            _HostCollector(host),
            SwapCollector(host),  # swap preemption's series
            SpecDecodeCollector(host),  # speculative decoding's (models that speculate)
        )
        # What a scrape renders: this registry, or, with several processes, every process's counters
        # and histograms summed (not this process's own: they are among them) and the live numbers.
        self.scrape_registry = self.registry
        if self._aggregate is not None:
            self.scrape_registry = CollectorRegistry()
            self.scrape_registry.register(self._aggregate)
        for collector in host_collectors:
            self.scrape_registry.register(collector)

    # RequestListener --------------------------------------------------------------
    def on_first_token(self, model: str, seconds: float, num_prompt_tokens: int) -> None:
        self.ttft.labels(model).observe(seconds)
        self.prompt_tokens.labels(model).inc(num_prompt_tokens)

    def on_tokens(self, model: str, num_tokens: int, seconds_since_last: float | None) -> None:
        self.generation_tokens.labels(model).inc(num_tokens)
        if seconds_since_last is not None:
            self.itl.labels(model).observe(seconds_since_last)
            self.tpot.labels(model).observe(seconds_since_last)

    def on_finished(self, model: str, output: RequestOutput, seconds: float) -> None:
        reason = output.outputs[0].finish_reason if output.outputs else None
        self.request_success.labels(model, reason or "abort").inc()
        self.e2e.labels(model).observe(seconds)
        self.request_prompt_tokens.labels(model).observe(len(output.prompt_token_ids))
        self.request_generation_tokens.labels(model).observe(sum(len(c.token_ids) for c in output.outputs))
        self.params_n.labels(model).observe(len(output.outputs))
        if output.lora_request is not None:
            self.lora_requests.labels(model, output.lora_request.lora_name).inc()
        max_tokens = output.metrics.get("max_tokens_param")
        if max_tokens is not None:
            self.params_max_tokens.labels(model).observe(max_tokens)
        timing = output.metrics
        queued = timing.get("time_in_queue")
        if queued is not None:
            self.queue_time.labels(model).observe(queued)
        scheduled, first, last = (
            timing.get(k) for k in ("first_scheduled_time", "first_token_time", "last_token_time")
        )
        if scheduled is not None and first is not None and last is not None:
            self.prefill_time.labels(model).observe(max(first - scheduled, 0.0))
            self.decode_time.labels(model).observe(max(last - first, 0.0))
            self.inference_time.labels(model).observe(max(last - scheduled, 0.0))

    def on_step(self, model: str, num_tokens: int) -> None:
        self.iteration_tokens.labels(model).observe(num_tokens)

    # -------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.scrape_registry)

    def totals(self, sample: str) -> dict[str, float]:
        """A counter's samples per ``model_name``, summed over processes (e.g. ``vllm:generation_tokens_total``)."""
        result: dict[str, float] = defaultdict(float)
        for metric in (self._aggregate or self.registry).collect():
            for s in metric.samples:
                if s.name == sample and "model_name" in s.labels:
                    result[s.labels["model_name"]] += s.value
        return dict(result)


class AggregatedTokenCounts:
    """``RequestLog``'s token counts (what the stats line reads), from the metrics: with several
    API server processes, every process's tokens, not only this one's."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    @property
    def prompt_tokens(self) -> dict[str, float]:
        return self._metrics.totals("vllm:prompt_tokens_total")

    @property
    def generation_tokens(self) -> dict[str, float]:
        return self._metrics.totals("vllm:generation_tokens_total")
