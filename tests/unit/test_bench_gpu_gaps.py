"""bench/gpu_gaps.py: the GPU's idle gaps in a chrome trace, attributed to the launch that ended each
and to the frames of ours spanning them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu_gaps import gap_table, gaps_from_file, idle_gaps


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1, correlation: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def _trace() -> dict:
    # host thread 1: step() [0, 100) calls observe [10, 60) which launches kernel 2 at t=55;
    # kernels on stream 7: [0, 10), then idle 10..58 (48 µs), [58, 70), then 70..72 (2 µs: under the
    # threshold), [72, 80), then idle 80..95 launched from propose at t=90
    return {
        "traceEvents": [
            _event("python_function", "/x/qserve/engine/engine.py(1115): step", 0, 100),
            _event("python_function", "/x/qserve/spec_decode/eagle.py(118): observe", 10, 50),
            _event("python_function", "/usr/lib/torch/nn/module.py(1): _call_impl", 50, 8),  # not ours
            _event("python_function", "/x/qserve/spec_decode/eagle.py(220): propose", 85, 10),
            _event("cuda_runtime", "cudaLaunchKernel", 1, 1, correlation=1),
            _event("cuda_runtime", "cudaGraphLaunch", 55, 2, correlation=2),
            _event("cuda_runtime", "cudaLaunchKernel", 60, 1, correlation=3),
            _event("cuda_runtime", "cudaLaunchKernel", 90, 1, correlation=4),
            _event("kernel", "a", 0, 10, tid=7, correlation=1),
            _event("kernel", "b", 58, 12, tid=7, correlation=2),
            _event("kernel", "c", 72, 8, tid=7, correlation=3),
            _event("gpu_memcpy", "Memcpy DtoH", 95, 5, tid=7, correlation=4),
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3},  # not a span: ignored
        ]
    }


def test_gaps_are_attributed_to_the_launch_that_ended_them_and_the_frames_through_them() -> None:
    gaps = idle_gaps(_trace())
    assert gaps.count == 2 and gaps.total_us == pytest.approx(48 + 15)
    assert gaps.busy_us == pytest.approx(10 + 12 + 8 + 5) and gaps.span_us == pytest.approx(100)
    assert dict(gaps.by_launch) == {
        "eagle.py:observe < engine.py:step": [48.0, 1],
        "eagle.py:propose < engine.py:step": [15.0, 1],
    }
    # inclusive: step spans both gaps, observe the first (10..58 within [10, 60)), propose 85..95 of the second
    assert gaps.by_frame == pytest.approx({"engine.py:step": 63.0, "eagle.py:observe": 48.0, "eagle.py:propose": 10.0})


def test_the_table_is_per_step_and_a_file_reads_the_same(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    lines = gaps_from_file(path, steps=2)
    assert lines == gap_table(idle_gaps(_trace()), 2)
    assert lines[0].startswith("GPU idle between kernels (gaps > 5 µs): 0.03 ms/step in 1.0 gaps/step")
    assert "| eagle.py:observe < engine.py:step | 24 | 0.5 |" in lines


def test_a_trace_without_device_events_has_no_gaps() -> None:
    gaps = idle_gaps({"traceEvents": [_event("python_function", "/x/qserve/a.py(1): f", 0, 5)]})
    assert gaps.count == 0 and gaps.total_us == 0 and not gaps.by_frame
