"""Prometheus series of speculative decoding (``--speculative-config``), read at scrape time.

Knows: vLLM's metric names (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos`` with a ``position`` label; all
counters, exported with ``_total``), read from the ``stats()`` numbers of the host (in-process
``AsyncEngine`` or the engine-core client: ``qserve.spec_decode.metrics.stats_entries``). Only
models that speculate have series. Must not know: HTTP routing, engines' internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from qserve.engine.async_engine import AsyncEngine
from qserve.spec_decode.metrics import ACCEPTED_KEY, DRAFT_TOKENS_KEY, DRAFTS_KEY, PER_POS_PREFIX


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
            for name, values in host.stats().items():
                if DRAFTS_KEY not in values:
                    continue  # this model does not speculate
                drafts.add_metric([name], values[DRAFTS_KEY])
                draft_tokens.add_metric([name], values[DRAFT_TOKENS_KEY])
                accepted.add_metric([name], values[ACCEPTED_KEY])
                positions = sorted(int(key[len(PER_POS_PREFIX) :]) for key in values if key.startswith(PER_POS_PREFIX))
                for position in positions:
                    per_pos.add_metric([name, str(position)], values[f"{PER_POS_PREFIX}{position}"])
        yield from (drafts, draft_tokens, accepted, per_pos)
