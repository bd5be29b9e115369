"""What the kernel wrappers ask of a device, asked in one place.

Knows: whether Triton kernels serve a device (a CUDA device, triton importable), its compute
capability, SM count and shared memory per block (``torch.cuda``'s queries), the never-read
placeholder tensors a launch passes for the pointer arguments of a branch it does not take, and
the per-device int32 arrival counters of the launches whose last program reduces (one buffer per
named owner, ``arrival_counters``). Must not know: kernels, models, engines.

Every wrapper and dispatcher asks here rather than ``torch.cuda``, so that the launch-compile
check (``tests/helpers/kernel_launches.py``) can put a simulated GPU of any architecture in the
real one's place on a machine without one, and capture the exact launches the engine makes.

Placeholders: a kernel argument keeps one type whichever branch the kernel takes. A launch that
does not use, say, the split-K workspace still passes an fp32 tensor there, never the fp16 output:
Triton type-checks whatever code survives constant folding, so an fp16 pointer where the kernel
declares an fp32 workspace or an int32 counter is a compile error the moment a branch is not
folded away (main at b0d3937 crashed at the first token on every GPU this way).

Arrival counters: a launch whose programs each write a partial and whose last program to arrive
(an acq_rel atomic on a counter) combines them needs counters that are zero when it starts. Each
owner's buffer (the owner: a name its kernel module picks) is zeroed once, and every launch's last
program resets the counters it used, so the next launch, another layer's, or a CUDA-graph replay finds
them zero without a memset launch. One buffer per owner, not
one for all, so no two kernels' counters alias whatever streams run them. Grown, never shrunk or
freed: a graph captured earlier keeps the address it was captured with (the engine warms up outside
capture, so the allocation, a zeroing launch, happens there).
"""

from __future__ import annotations

import functools

import torch

from quant_kernels import have_triton


def triton_serves(device: torch.device) -> bool:
    """Whether Triton kernels run on ``device``: a CUDA device, with triton importable."""
    return device.type == "cuda" and have_triton()


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device`` (``(9, 0)`` for an H100 / H200)."""
    return torch.cuda.get_device_capability(device)


def sm_count(device: torch.device, default: int) -> int:
    """Streaming multiprocessors of ``device``; ``default`` off CUDA (interpreter tests)."""
    return _properties(device).multi_processor_count if device.type == "cuda" else default


def max_shared(device: torch.device) -> int | None:
    """Bytes of shared memory one block of ``device`` may use (the opt-in maximum: 227 KB on sm90,
    99 KB on sm86 / sm89); None off CUDA (no limit to respect)."""
    return _properties(device).shared_memory_per_block_optin if device.type == "cuda" else None


def _properties(device: torch.device):  # noqa: ANN202 - torch's _CudaDeviceProperties
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _properties_of(index: int):  # noqa: ANN202
    return torch.cuda.get_device_properties(index)


def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor of ``dtype`` on ``device`` that no kernel reads or writes: what a
    launch passes for a pointer argument its compiled branch leaves unused. Made once per
    (device, dtype) — no allocation per launch, and safe inside CUDA-graph capture once made."""
    return _placeholder(device, dtype)


@functools.lru_cache(maxsize=64)
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


# (owner, device type, device index) -> that owner's counters; the buffers a growth replaced stay
# referenced here, so a CUDA graph captured with one keeps valid (and zero) counters.
_COUNTERS: dict[tuple[str, str, int | None], torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def arrival_counters(device: torch.device, count: int, owner: str, minimum: int = 1) -> torch.Tensor:
    """int32 ``[>= count]`` arrival counters of ``owner`` on ``device``, zero between launches: allocated
    (zeroed) at ``max(count, minimum)`` the first time, at least doubled when a launch needs more, then
    left to the launches (each one's last program per counter resets it), so no memset per call."""
    key = (owner, device.type, device.index)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < count:
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        size = max(count, minimum, 2 * (0 if counters is None else counters.numel()))
        counters = torch.zeros(size, dtype=torch.int32, device=device)  # [size]
        _COUNTERS[key] = counters
    return counters
