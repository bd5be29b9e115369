"""Programmatic dependent launch (PDL): whether a kernel launch may overlap the one before it.

Knows: the one switch (``QSERVE_ENABLE_PDL=1``), which devices have PDL (sm90 and newer: Hopper's
``griddepcontrol``; Ampere and Ada have none) and that Triton's interpreter runs no PTX. Must not
know: which kernels opt in, or what they do before their wait.

A kernel launched with PDL (Triton's ``launch_pdl=True``) may start while its predecessor on the
stream is still running. Each of our kernels that opts in takes a ``USE_PDL`` constexpr and then
must, before touching anything an earlier kernel writes or reads, call ``gdc_wait()`` (which
returns once every earlier kernel on the stream has finished and its writes are visible), and
calls ``gdc_launch_dependents()`` so the kernel after it can start early in turn. Before the
wait a kernel may only read memory nothing on the stream writes: the W4A16 GEMM prefetches its
first weight tiles into L2 there, so a decode step's weight streaming starts under the tail of
the kernel before (the fixed per-launch latency that bounds the small layers at decode:
bench/RESULTS.md). Writes stay after the wait: a buffer handed out by the caching allocator may
be one an earlier kernel still reads. One exception, argued where it is made: the MoE split-K down
launch reads its blocks' expert ids (``.cg``, from L2) before its wait, to prefetch those experts'
tiles. The router (or sort) that wrote them is complete by then, because the launch right before
down, gate_up, waits at its top before it lets down start; that holds only while gate_up stays
a PDL launch that waits first (``moe_mma_triton``'s module doc).

Off by default for dense models: on the H100 at 8c424b0 the Qwen2.5-14B-shaped engine decoded 1.8% faster
at batch 1 with it and 4.6 / 8.4 / 1.5% slower at batch 8 / 32 / 128. On for mixture-of-experts models
on sm90 unless the user set the switch (``prefer_for_moe``, asked by the engine when it reads the model's
config): Qwen3-30B-A3B's batch-1 decode 357 -> 387 tok/s with the fused cast and packed top-k, batch 8
not slower (bench/RESULTS.md, nineteenth session). The switch is the process's: a dense model served
beside a MoE one in the same process launches with PDL too (``QSERVE_ENABLE_PDL=0`` keeps it off). A
launch without PDL is ordered after its predecessor as usual, so kernels that opt in mix freely with
those that do not.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

from quant_kernels import device as kdevice

ENV = "QSERVE_ENABLE_PDL"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def device_has_pdl(device: torch.device) -> bool:
    """Whether ``device`` can launch with PDL: a CUDA device of compute capability 9.0 or newer."""
    return kdevice.triton_serves(device) and not _INTERPRET and kdevice.capability(device) >= (9, 0)


def use_pdl(device: torch.device, enabled: bool | None = None) -> bool:
    """Whether a launch on ``device`` goes with PDL: ``enabled`` when given (benchmarks compare
    both), else ``QSERVE_ENABLE_PDL=1`` in the environment; never where the device has none."""
    if enabled is None:
        enabled = env_enabled()
    return enabled and device_has_pdl(device)


def env_enabled() -> bool:
    """``QSERVE_ENABLE_PDL``: 1/true/yes/on or 0/false/no/off (unset: off); anything else is an
    error naming the variable, not a silent off."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 1/true/yes/on or 0/false/no/off")


def prefer_for_moe(is_moe: bool, device: torch.device, environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``QSERVE_ENABLE_PDL=1`` in ``environ`` (``os.environ`` by default) for a mixture-of-experts model
    on a device with PDL, unless the variable is already set (a user's "0" wins). Returns whether it set
    it (the engine logs it)."""
    environ = os.environ if environ is None else environ
    if not is_moe or ENV in environ or not device_has_pdl(device):
        return False
    environ[ENV] = "1"
    return True


def launch_options(device: torch.device, enabled: bool | None = None) -> dict[str, bool]:
    """Keyword arguments for a Triton launch of a kernel with a ``USE_PDL`` constexpr: both the
    constexpr and Triton's ``launch_pdl`` when PDL is on (see ``use_pdl``), else none (the
    kernel's default, ``USE_PDL=False``, keeps the compiled variant of a plain launch)."""
    if not use_pdl(device, enabled):
        return {}
    return {"USE_PDL": True, "launch_pdl": True}
