"""Summaries of one load point, with the field names of vLLM ``bench serve``'s result JSON.

Knows: vLLM's metric definitions — TTFT, TPOT = (latency - TTFT) / (output tokens - 1) over
requests with more than one token, ITL = every gap between token chunks, E2E latency
(``e2el``) — their mean / median / std and chosen percentiles in milliseconds, throughputs,
and errors counted per HTTP status. Must not know: HTTP or how the load was made.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from qserve.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(results: list[RequestResult], duration: float, percentiles: tuple[float, ...]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [(r.latency - r.ttft) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap * 1e3 for r in ok for gap in r.itl],
        "e2el": [r.latency * 1e3 for r in ok],
    }
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    errors = Counter(str(r.status) if r.status is not None else "connection" for r in results if not r.success)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
        "errors_by_status": dict(sorted(errors.items())),
        "first_error": next((r.error for r in results if not r.success), None),
    }
    for name in METRICS:
        v = values[name]
        summary[f"mean_{name}_ms"] = statistics.fmean(v) if v else float("nan")
        summary[f"median_{name}_ms"] = statistics.median(v) if v else float("nan")
        summary[f"std_{name}_ms"] = statistics.pstdev(v) if v else float("nan")
        for q in percentiles:
            summary[f"p{q:g}_{name}_ms"] = percentile(v, q)
    summary["input_lens"] = [r.prompt_len for r in results]
    summary["output_lens"] = [r.output_tokens for r in results]
    summary["ttfts"] = [r.ttft for r in results]
    summary["itls"] = [r.itl for r in results]
    summary["errors"] = [r.error for r in results]
    return summary
