"""What a bench run leaves behind: a table on the terminal, a JSON result file, a PNG plot.

Knows: the columns of the table (output tok/s, req/s, the chosen metrics of TTFT / TPOT / ITL /
E2E at the chosen percentiles, errors per status), the result file's layout (vLLM ``bench serve``'s
flat object per load point — ``date``, ``backend``, ``model_id``, ``num_prompts``, ``request_rate``,
``burstiness``, ``max_concurrency``, ``duration``, ``completed``, throughputs, ``mean_ttft_ms``,
``p99_ttft_ms``, ...; one point is one JSON object, several are JSON Lines, one object a line, as
vLLM's ``--append-result`` writes them) and the plot (throughput and latency against load,
matplotlib without a display). Must not know: HTTP or how numbers were measured.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTTED = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else (f"{value:.0f}" if value >= 100 else f"{value:.1f}")


def table(runs: list[dict[str, Any]], percentiles: tuple[float, ...]) -> str:
    """A markdown table: one row per load point (the metrics the runs have percentiles of)."""
    ps = " / ".join(f"p{q:g}" for q in percentiles)
    shown = [(key, title) for key, title in PLOTTED if runs and f"mean_{key}_ms" in runs[0]]
    columns = ["load", "done", "req/s", "out tok/s"]
    columns += [f"{title} {ps} (ms)" for _, title in shown]
    columns += ["errors"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in runs:
        cells = [
            run["load"],
            f"{run['completed']}/{run['num_prompts']}",
            f"{run['request_throughput']:.2f}",
            f"{run['output_throughput']:.1f}",
        ]
        for key, _ in shown:
            cells.append(" / ".join(_ms(run[f"p{q:g}_{key}_ms"]) for q in percentiles))
        errors = run["errors_by_status"]
        cells.append(", ".join(f"{status}: {n}" for status, n in errors.items()) or "0")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_results(path: str | Path, runs: list[dict[str, Any]], before: str = "") -> None:
    """Strict JSON (NaN -> null, inf -> "inf"), one flat object per load point, one a line,
    after ``before`` (what the file held, for ``--append-result``); rewritten after every point."""
    lines = [json.dumps(_jsonable(run)) for run in runs]
    if before and not before.endswith("\n"):
        before += "\n"
    Path(path).write_text(before + "\n".join(lines) + "\n")


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The load points of a result file (one JSON object, or JSON Lines)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(path: str | Path, runs: list[dict[str, Any]], percentiles: tuple[float, ...]) -> None:
    """Throughput and latency against the achieved request rate (one point per load point)."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda run: run["request_throughput"])  # one curve, left to right
    x = [run["request_throughput"] for run in runs]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    top.plot(x, [run["output_throughput"] for run in runs], "o-", label="output tok/s")
    for xi, run in zip(x, runs):
        top.annotate(run["load"], (xi, run["output_throughput"]), fontsize=7, textcoords="offset points",
                     xytext=(4, 4))  # fmt: skip
    top.set_ylabel("output tokens/s")
    top.set_title(f"qserve bench: {runs[0].get('model_id', '')}" if runs else "qserve bench")
    top.grid(True, alpha=0.3)
    high = max(percentiles)
    for key, title in PLOTTED:
        for q, style in ((50, "o-"), (high, "s--")):
            name = f"p{q:g}_{key}_ms"
            if name in runs[0]:
                bottom.plot(x, [run[name] for run in runs], style, label=f"{title} p{q:g}")
    bottom.set_yscale("log")
    bottom.set_xlabel("achieved requests/s")
    bottom.set_ylabel("latency (ms)")
    bottom.grid(True, which="both", alpha=0.3)
    bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
