"""Where the GPU waits for the host: the idle intervals between a profiled run's kernels, and what the
host was doing through them, from a torch.profiler chrome trace recorded with ``with_stack=True``.

Knows: the trace's event categories (``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` on the device,
``cuda_runtime`` / ``cuda_driver`` launches sharing a ``correlation`` id with their kernels,
``python_function`` frames named ``path(line): function``). Must not know: the engine, or which
step a kernel belongs to.

Two views of the same gaps: by the launch that ended each gap (the innermost frames of our own code
around that launch: the work the GPU waited for), and by every frame of our code whose span overlaps
the gaps (inclusive: a frame and its callers each count the whole overlap).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass
class Gaps:
    """Idle intervals of the device longer than the threshold, in µs."""

    total_us: float = 0.0
    count: int = 0
    busy_us: float = 0.0
    span_us: float = 0.0
    by_launch: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))
    by_frame: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def _ours(name: str, roots: tuple[str, ...]) -> bool:
    return any(root in name for root in roots)


def _short(name: str) -> str:
    """``/x/qserve/spec_decode/eagle.py(303): _draft_in_graphs`` -> ``eagle.py:_draft_in_graphs``."""
    path, _, function = name.partition("): ")
    return f"{path.rsplit('/', 1)[-1].split('(')[0]}:{function or name}"


def idle_gaps(trace: dict, threshold_us: float = 5.0, roots: tuple[str, ...] = ("qserve/", "bench/")) -> Gaps:
    """The device's idle intervals in ``trace`` (a chrome trace dict) longer than ``threshold_us``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    threads = {e["tid"] for e in launches.values()}
    frames = sorted(
        (
            e
            for e in events
            if e.get("cat") == "python_function" and e.get("tid") in threads and _ours(e["name"], roots)
        ),
        key=lambda e: e["ts"],
    )
    gaps = Gaps()
    if not device:
        return gaps
    gaps.busy_us = sum(e.get("dur", 0.0) for e in device)
    gaps.span_us = device[-1]["ts"] + device[-1].get("dur", 0.0) - device[0]["ts"]
    end = device[0]["ts"] + device[0].get("dur", 0.0)
    intervals: list[tuple[float, float]] = []
    for event in device[1:]:
        start = event["ts"]
        if start - end > threshold_us:
            intervals.append((end, start))
            launch = launches.get(event.get("args", {}).get("correlation"))
            label = "(no launch found)"
            if launch is not None:
                at = launch["ts"]
                around = [f for f in frames if f["ts"] <= at <= f["ts"] + f.get("dur", 0.0)]
                around.sort(key=lambda f: f["ts"])  # outermost first
                label = " < ".join(_short(f["name"]) for f in reversed(around[-3:])) or launch["name"]
            slot = gaps.by_launch[label]
            slot[0] += start - end
            slot[1] += 1
            gaps.total_us += start - end
            gaps.count += 1
        end = max(end, event["ts"] + event.get("dur", 0.0))
    for frame in frames:
        lo, hi = frame["ts"], frame["ts"] + frame.get("dur", 0.0)
        overlap = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in intervals if a < hi and b > lo)
        if overlap > 0:
            gaps.by_frame[_short(frame["name"])] += overlap
    return gaps


def gap_table(gaps: Gaps, steps: int, top: int = 15) -> list[str]:
    """Markdown: per-step idle time, the launches that ended the gaps, the frames through them."""
    per = max(steps, 1)
    lines = [
        f"GPU idle between kernels (gaps > 5 µs): {gaps.total_us / 1e3 / per:.2f} ms/step in {gaps.count / per:.1f} "
        f"gaps/step; kernels busy {gaps.busy_us / 1e3 / per:.2f} ms/step of a {gaps.span_us / 1e3 / per:.2f} ms/step span",
        "",
        "| the launch that ended the gap (innermost frames of ours) | idle µs/step | gaps/step |",
        "|---|---|---|",
    ]
    ranked = sorted(gaps.by_launch.items(), key=lambda item: -item[1][0])[:top]
    lines += [f"| {label[:150]} | {us / per:.0f} | {n / per:.1f} |" for label, (us, n) in ranked]
    lines += ["", "| frame of ours spanning the gaps (inclusive) | idle µs/step |", "|---|---|"]
    frames = sorted(gaps.by_frame.items(), key=lambda item: -item[1])[:top]
    lines += [f"| {name[:150]} | {us / per:.0f} |" for name, us in frames]
    return lines


def gaps_from_file(path: Path, steps: int) -> list[str]:
    return gap_table(idle_gaps(json.loads(Path(path).read_text())), steps)
