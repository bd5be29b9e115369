"""bench/pyspy_summary.py: py-spy's raw stacks summed per process and thread, optionally within a phase."""

from __future__ import annotations

from bench.pyspy_summary import summarize

# a subprocess's stack names its parent process first
CORE = 'process 12:"python -m qserve.cli serve";process 13:"python -m qserve.engine.core.core"'
STACKS = [
    f"{CORE};thread (0x1): MainThread;run (qserve/engine/core/core.py:10);"
    "capture_decode_graphs (qserve/runner/model_runner.py:321);__call__ (triton/runtime/jit.py:5) 30",
    f"{CORE};thread (0x1): MainThread;run (qserve/engine/core/core.py:10);"
    "load (qserve/loaders/gptq.py:3);read (safetensors/x.py:1) 50",
    'process 12:"python -m qserve.cli serve";thread (0x2): MainThread;serve (qserve/cli.py:4);select (x.py:1) 20',
]


def test_samples_are_counted_per_process_and_thread_with_self_and_inclusive_time():
    text = summarize(STACKS, top=5)
    assert text.startswith("100 samples")
    assert "process 13 (engine core), thread MainThread: 80 samples (80.0%)" in text
    assert "process 12 (front end), thread MainThread: 20 samples (20.0%)" in text
    assert "37.5%  __call__ (triton/runtime/jit.py)" in text  # 30 of the core thread's 80


def test_within_keeps_only_the_stacks_that_hold_the_phase():
    text = summarize(STACKS, top=5, within="capture_decode_graphs")
    assert text.startswith("30 samples in stacks holding 'capture_decode_graphs'")
    assert "thread MainThread: 30 samples (100.0%)" in text and "front end" not in text
    assert "load (qserve/loaders/gptq.py)" not in text
    # the process and thread frames (command lines, names) are not phases
    assert summarize(STACKS, top=5, within="engine.core.core").startswith("0 samples")
