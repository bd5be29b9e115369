"""The front end's side of tenants: admission around each submission, and per-tenant metrics.

Knows: how a submission's cost is counted for ``qserve.tenants.Tenants`` (prompt tokens plus
``max_tokens`` per sequence; without ``max_tokens``, what the context leaves), how an engine
output stream is wrapped so its admission is released exactly once when it ends, is aborted
or fails (giving back the tokens it did not generate), and the per-tenant Prometheus metrics
(``qserve:tenant_*``: requests and sequences in flight, admitted, rejected by reason, tokens used, time to
first token), and what a tenant's own key may read of ``/metrics``: only the series labelled
with its own name (``tenant_view``; the server's key reads everything). Must not know: routes,
auth headers, engines' internals.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qserve.server.metrics import TTFT_BUCKETS
from qserve.tenants import Admission, Tenants


class TenantStream:
    """An ``OutputStream`` that releases its tenant admission when it ends (any way) and reports
    the tenant's time to first token."""

    def __init__(self, stream: Any, gate: TenantGate, admission: Admission) -> None:
        self._stream = stream
        self._gate = gate
        self._admission = admission
        self._start = time.monotonic()
        self._tokens: dict[str, int] = {}
        self._first_seen = False
        self.model = stream.model
        self.request_ids = stream.request_ids

    @property
    def finished(self) -> bool:
        return self._stream.finished

    def __aiter__(self) -> TenantStream:
        return self

    async def __anext__(self) -> tuple[str, Any]:
        try:
            request_id, output = await self._stream.__anext__()
        except BaseException:
            self._end()
            raise
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        self._tokens[request_id] = num_tokens
        if num_tokens and not self._first_seen:
            self._first_seen = True
            self._gate.ttft.labels(self._admission.tenant).observe(time.monotonic() - self._start)
        if self._stream.finished:
            self._end()
        return request_id, output

    def abort(self) -> None:
        self._stream.abort()
        self._end()

    def _end(self) -> None:
        self._gate.tenants.release(self._admission, sum(self._tokens.values()))


class _TenantCollector(Collector):
    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        labels = ["tenant"]
        in_flight = GaugeMetricFamily(
            "qserve:tenant_requests_in_flight", "Requests admitted, not finished.", labels=labels
        )
        sequences = GaugeMetricFamily(
            "qserve:tenant_sequences_in_flight",
            "Sequences (prompts x n) admitted, not finished: what max_concurrent + max_queued bound.",
            labels=labels,
        )
        admitted = CounterMetricFamily("qserve:tenant_requests_admitted", "Requests admitted.", labels=labels)
        rejected = CounterMetricFamily(
            "qserve:tenant_requests_rejected", "Requests refused with 429, by reason.", labels=["tenant", "reason"]
        )
        tokens = CounterMetricFamily(
            "qserve:tenant_tokens", "Tokens used (prompt + generated) against tokens_per_minute.", labels=labels
        )
        for name, stats in self._tenants.stats().items():
            in_flight.add_metric([name], stats["in_flight"])
            sequences.add_metric([name], stats["sequences_in_flight"])
            admitted.add_metric([name], stats["admitted"])
            for reason in ("queue", "tokens", "too_large"):
                rejected.add_metric([name, reason], stats["rejected"].get(reason, 0))
            tokens.add_metric([name], stats["tokens_used"])
        yield from (in_flight, sequences, admitted, rejected, tokens)


class TenantGate:
    """Admission and metrics for every tenant (event-loop thread only)."""

    def __init__(self, tenants: Tenants, registry: CollectorRegistry) -> None:
        self.tenants = tenants
        self.ttft = Histogram(
            "qserve:tenant_time_to_first_token_seconds",
            "Time to first token per tenant (submission to first output).",
            ["tenant"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        registry.register(_TenantCollector(tenants))

    def admit(
        self, tenant: str, prompt_lens: list[int], max_tokens: int | None, n: int, max_model_len: int
    ) -> Admission:
        """Raises ``TenantLimitError``; the cost is every prompt and its ``n`` completions' ``max_tokens``."""
        new_tokens = sum(
            (max_tokens if max_tokens is not None else max_model_len - length) * n for length in prompt_lens
        )
        return self.tenants.admit(tenant, sum(prompt_lens), new_tokens, sequences=len(prompt_lens) * n)

    def wrap(self, stream: Any, admission: Admission) -> TenantStream:
        return TenantStream(stream, self, admission)


def tenant_view(exposition: bytes, tenant: str) -> bytes:
    """Prometheus text reduced to the series labelled ``tenant="<tenant>"`` (with their HELP and
    TYPE lines): a tenant's key sees its own usage, not other tenants' nor the server's."""
    escaped = tenant.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    own = re.compile(r'[{,]tenant="' + re.escape(escaped) + r'"[,}]')
    out: list[str] = []
    headers: list[str] = []
    for line in exposition.decode("utf-8").splitlines():
        if line.startswith("#"):
            if line.startswith("# HELP "):
                headers = [line]
            else:
                headers.append(line)
            continue
        if own.search(line):
            out.extend(headers)
            headers = []
            out.append(line)
    return ("\n".join(out) + "\n").encode("utf-8") if out else b""


def resolve_tenant(tenants: Tenants, request: Request) -> bool:
    """Set ``request.state.tenant`` from the Bearer key if it is a tenant's."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    tenant = tenants.tenant_for_key(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
    if tenant is None:
        return False
    request.state.tenant = tenant.name
    return True
