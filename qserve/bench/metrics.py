"""Summaries of one load point, with the field names of vLLM ``bench serve``'s result JSON.

Knows: vLLM's metric definitions — TTFT, TPOT = (latency - TTFT) / (output tokens - 1) over
requests with more than one token, ITL = every gap between token chunks, E2E latency
(``e2el``) — their mean / median / std and chosen percentiles in milliseconds (for the metrics
``--percentile-metrics`` names), throughputs, goodput (requests/s meeting every SLO of
``--goodput``, e.g. ``ttft:500 tpot:50`` in ms; a one-token answer's TPOT counts as 0, as in
vLLM), and errors counted per HTTP status. Must not know: HTTP or how the load was made.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from qserve.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(values: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for value in values or []:
        for item in value.split():
            name, sep, number = item.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(
                    f"--goodput {item!r}: use METRIC:MILLISECONDS with METRIC one of {', '.join(GOODPUT_METRICS)}"
                )
            try:
                slos[name] = float(number)
            except ValueError:
                raise ValueError(f"--goodput {item!r}: {number!r} is not a number of milliseconds") from None
            if slos[name] < 0:
                raise ValueError(f"--goodput {item!r}: an SLO is a non-negative number of milliseconds")
    return slos


def parse_metrics(text: str) -> tuple[str, ...]:
    """``--percentile-metrics ttft,tpot,itl,e2el``: which metrics get mean/median/std/percentiles."""
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: choose from {', '.join(METRICS)}")
    return names


def _is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    values = {"ttft": r.ttft * 1e3, "tpot": tpot * 1e3, "e2el": r.latency * 1e3}
    return all(values[name] <= slo for name, slo in slos.items())


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(
    results: list[RequestResult],
    duration: float,
    percentiles: tuple[float, ...],
    metrics: tuple[str, ...] = METRICS,
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
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
        # vLLM writes null when no --goodput was given
        "request_goodput": (sum(_is_good(r, goodput) for r in ok) / duration if duration > 0 else 0.0)
        if goodput
        else None,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
        "errors_by_status": dict(sorted(errors.items())),
        "first_error": next((r.error for r in results if not r.success), None),
    }
    for name in metrics:
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
    summary["generated_texts"] = [r.text for r in results]
    summary["errors"] = [r.error for r in results]
    return summary
