"""Host (Python) cost of one eager ``lora_ops.add_lora`` on the Triton path, measured on a CPU.

Knows: Qwen2.5-14B's adapted layer shapes at rank 16 (as ``bench/lora.py``), how the CUDA branch of
``lora_ops`` is reached from CPU tensors (``tests.helpers.kernel_launches.simulated_gpu``'s patches)
and where Triton's launch path can be cut off without a GPU. Must not know: the engine.

    PYTHONPATH=. python bench/lora_host.py [--calls 20000] [--profile]

Two measurements per case, each the median over ``--repeats`` runs of ``--calls`` calls
(``time.perf_counter``), in µs per call:

``ours``: the kernels' ``[grid](...)`` launches replaced by no-ops, so what is left is lora_ops' and
  lora_triton's own Python: the dispatch checks, the K-split config, allocating ``h`` and the
  split-K workspace, argument checks and marshalling. ``kdevice.sm_count`` goes through the same
  per-device property cache as on CUDA (a fake ``_properties_of``).
``+triton``: the real ``JITFunction.run`` on a simulated sm90 (the kernels compiled ahead of time for
  it, once), stopped at the compiled kernel's C launcher (``CompiledKernel._run`` a no-op): adds
  Triton's own Python per launch (argument binding and specialisation, the cache key, the kernel
  cache lookup). NOT measured, as it needs a GPU: the C launcher (packing the arguments,
  ``cuLaunchKernelEx``), the CUDA caching allocator's host cost (CPU tensors are allocated by the CPU
  allocator here), and the driver's current-device / stream queries (Python stubs here).

``--profile``: cProfile of the ``ours`` loop for the first case (where the time goes).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_kernels import device as kdevice  # noqa: E402
from quant_kernels import lora_ops  # noqa: E402

RANK = 16
# (label, K, output slice sizes, token slots of the step)
CASES = (
    ("qkv decode batch 1", 5120, (5120, 1024, 1024), np.zeros(1, dtype=np.int32)),
    ("qkv decode batch 32 / 8 adapters", 5120, (5120, 1024, 1024), np.arange(32, dtype=np.int32) % 8),
    ("down decode batch 32 / 8 adapters", 13824, (5120,), np.arange(32, dtype=np.int32) % 8),
    ("o prefill 2048 / 4 adapters", 5120, (5120,), np.arange(2048, dtype=np.int32) // 512),
)


def _fake_properties(index: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448)


@contextlib.contextmanager
def cuda_branch() -> Iterator[None]:
    """CPU tensors through lora_ops' CUDA branch, at the cost the real checks have there."""
    have_triton = kdevice.have_triton

    def triton_serves(device: torch.device) -> bool:  # the real test, with "cpu" for "cuda"
        return device.type == "cpu" and have_triton()

    def sm_count(device: torch.device, default: int) -> int:  # the real body, on the CPU device
        return kdevice._properties(device).multi_processor_count

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {lora_ops.TRITON_ENV: "1"}))
        stack.enter_context(mock.patch.object(kdevice, "triton_serves", triton_serves))
        stack.enter_context(mock.patch.object(kdevice, "sm_count", sm_count))
        stack.enter_context(mock.patch.object(kdevice, "_properties_of", _fake_properties))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        yield


class _NoLaunch:
    """Stands for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return _no_op


def _no_op(*args: object, **kwargs: object) -> None:
    return None


@contextlib.contextmanager
def no_launches() -> Iterator[None]:
    from quant_kernels import lora_triton

    with (
        mock.patch.object(lora_triton, "lora_shrink_kernel", _NoLaunch()),
        mock.patch.object(lora_triton, "lora_expand_kernel", _NoLaunch()),
    ):
        yield


@contextlib.contextmanager
def triton_python_only() -> Iterator[None]:
    """Triton's real ``JITFunction.run`` on a simulated sm90, cut at the C launcher."""
    from triton.runtime.driver import driver

    from quant_kernels import lora_triton
    from tests.helpers.kernel_launches import _FakeDriver

    previous = driver._active
    driver.set_active(_FakeDriver(90))
    try:
        yield
    finally:
        for kernel in (lora_triton.lora_shrink_kernel, lora_triton.lora_expand_kernel):
            for caches in kernel.device_caches.values():
                for compiled in caches[0].values():
                    compiled.module = None  # nothing was loaded: nothing for __del__ to unload
                caches[0].clear()
        driver._active = previous


def _cut_launchers() -> None:
    from quant_kernels import lora_triton

    for kernel in (lora_triton.lora_shrink_kernel, lora_triton.lora_expand_kernel):
        for caches in kernel.device_caches.values():
            for compiled in caches[0].values():
                compiled._run = _no_op  # the C launcher: needs a GPU
                compiled.module = "not loaded"  # (_init_handles: nothing to load)


def make_case(k: int, sizes: tuple[int, ...], slots: np.ndarray) -> Callable[[], None]:
    dtype = torch.bfloat16
    starts = [0, *np.cumsum(sizes).tolist()]
    lora_a = torch.zeros(8, len(sizes) * RANK, k, dtype=dtype)  # [L, S * R, K]
    lora_b = torch.zeros(8, starts[-1], RANK, dtype=dtype)  # [L, N, R]
    indices = lora_ops.build_lora_indices(slots, torch.device("cpu"))
    x = torch.zeros(len(slots), k, dtype=dtype)  # [T, K]
    y = torch.zeros(len(slots), starts[-1], dtype=dtype)  # [T, N]
    return lambda: lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices)


def per_call_us(call: Callable[[], None], calls: int, repeats: int) -> float:
    for _ in range(min(calls, 1000)):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-triton", action="store_true", help="skip the +triton measurement (compiles)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls = [(label, make_case(k, sizes, slots)) for label, k, sizes, slots in CASES]
    print(f"{'case':<36} {'ours µs':>9} {'+triton µs':>11}")
    ours = {}
    with torch.inference_mode(), cuda_branch():
        with no_launches():
            for label, call in calls:
                ours[label] = per_call_us(call, args.calls, args.repeats)
            if args.profile:
                profiler = cProfile.Profile()
                profiler.runcall(lambda: [calls[0][1]() for _ in range(args.calls)])
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
                print(out.getvalue())
        if args.no_triton:
            for label, _ in calls:
                print(f"{label:<36} {ours[label]:>9.2f}")
            return
        with triton_python_only():
            for _, call in calls:
                with mock.patch("triton.runtime.jit.JITFunction.run", _warmup_run()):
                    call()  # compile (once per specialisation)
            _cut_launchers()
            for label, call in calls:
                total = per_call_us(call, max(args.calls // 4, 100), args.repeats)
                print(f"{label:<36} {ours[label]:>9.2f} {total:>11.2f}")


def _warmup_run() -> Callable[..., object]:
    from triton.runtime import jit as triton_jit

    original = triton_jit.JITFunction.run

    def run(fn, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202 - Triton's own signature
        return original(fn, *args, grid=grid, warmup=True, **kwargs)

    return run


if __name__ == "__main__":
    main()
