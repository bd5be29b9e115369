"""Prometheus series of speculative decoding (``--speculative-config``), read at scrape time.

Knows: vLLM's metric names (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos`` with a ``position`` label; all
counters, exported with ``_total``) and ``AsyncEngine.spec_decode_stats()``. Only models that
speculate have series. Must not know: HTTP routing, engines' internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from qserve.engine.async_engine import AsyncEngine


class SpecDecodeCollector(Collector):
    def __init__(self, host: Callable[[], AsyncEngine | None]) -> None:
        self._host = host

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        drafts = CounterMetricFamily(
            "vllm:spec_decode_num_drafts", "Draft proposals verified (one per sequence and step).", labels=labels
        )
        draft_tokens = CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels=labels)
        accepted = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target model.", labels=labels
        )
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0-based).",
            labels=[*labels, "position"],
        )
        host = self._host()
        if host is not None:
            for name, stats in host.spec_decode_stats().items():
                drafts.add_metric([name], stats.num_drafts)
                draft_tokens.add_metric([name], stats.num_draft_tokens)
                accepted.add_metric([name], stats.num_accepted_tokens)
                for position, count in enumerate(stats.accepted_per_pos):
                    per_pos.add_metric([name, str(position)], count)
        yield from (drafts, draft_tokens, accepted, per_pos)
