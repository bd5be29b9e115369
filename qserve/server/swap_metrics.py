"""Prometheus series of swap preemption (``--preemption-mode swap|auto``), read at scrape time.

Knows: the metric names (vLLM V0's ``vllm:num_requests_swapped`` gauge; ``qserve:num_swapped_out``
/ ``qserve:num_swapped_in`` counters, exported with ``_total``), and the ``num_swapped*`` keys of
``AsyncEngine.stats()``. Every preemption, swapped or recomputed, is also counted in
``vllm:num_preemptions_total`` (``qserve.server.metrics``). Like the host collector there, a
process serving several models opens each metric with a process-wide series (``model_name=""``).
Must not know: HTTP routing, engines' internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qserve.engine.async_engine import AsyncEngine

ALL_MODELS = ""  # the process-wide series' model_name (as qserve.server.metrics)


class SwapCollector(Collector):
    def __init__(self, host: Callable[[], AsyncEngine | None]) -> None:
        self._host = host

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        swapped = GaugeMetricFamily(
            "vllm:num_requests_swapped", "Sequences preempted to host memory, waiting to be swapped in.", labels=labels
        )
        swapped_out = CounterMetricFamily(
            "qserve:num_swapped_out", "Preemptions that copied the KV to host memory.", labels=labels
        )
        swapped_in = CounterMetricFamily(
            "qserve:num_swapped_in", "Swapped sequences whose KV was copied back.", labels=labels
        )
        host = self._host()
        if host is not None:
            stats = host.stats()
            rows = list(stats.items())
            if len(stats) > 1:
                total = {
                    key: sum(s.get(key, 0) for s in stats.values())
                    for key in ("num_swapped", "num_swapped_out", "num_swapped_in")
                }
                rows.insert(0, (ALL_MODELS, total))
            for name, values in rows:
                swapped.add_metric([name], values.get("num_swapped", 0))
                swapped_out.add_metric([name], values.get("num_swapped_out", 0))
                swapped_in.add_metric([name], values.get("num_swapped_in", 0))
        yield from (swapped, swapped_out, swapped_in)
