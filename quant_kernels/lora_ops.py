"""Device dispatch for multi-LoRA: ``add_lora`` (``y += scale * B(A(x))`` per row, each row with its
own adapter slot) and ``build_lora_indices`` (a step's per-row slots and their Punica-style tiles).

Knows: which implementation serves which device (the Triton kernels on CUDA unless
``QSERVE_LORA_TRITON=0``: faster than the reference in every case bench/lora.py timed on the H200;
the PyTorch reference everywhere else), and
how rows are grouped into tiles of one slot, and what the kernels need besides the tiles (the split-K
shrink's arrival counters, its workspace); that a gate_up's output is its gate's and its up's columns
laid end to end (``(0, I, 2I)``), for ``expand_silu_and_mul``. Must not know: models, layers, PEFT, engines. Triton stays
a lazy import. Layout and numerics: ``quant_kernels.reference_lora``.

A step's indices reach the device in ONE host-to-device copy: every array is a view of one int32
buffer (each segment starting 16-byte aligned, so the kernels' pointer specialisation never varies
between steps and forces a recompile mid-serving).

Host work per call (issue 30: an eager step makes ~4 LoRA calls per layer, ~190 on a 48-layer model,
and each call's Python, not its kernels, set its time). The Triton branch of ``add_lora`` checks its
four tensors once for both halves and takes a launch plan per layer shape (dtype, K, S * R, slices,
split overrides): the K split, the split-K workspace and ``h``, made by the step's first call of that
shape and kept in the step's ``LoRAIndices.plans`` (every LoRA layer of a step shares its indices, so
a 48-layer step makes about four plans, not ~190), dropped with the indices when the step ends. Reuse
is safe because a step's launches run in order on one stream: the workspace is scratch that each
shrink writes before it reads, and ``add_lora``'s ``h`` is dead once its expand has read it
(``lora_shrink`` still returns a fresh ``h``: its caller holds it). Inside a CUDA-graph capture no
plan is kept: every call allocates from the graph's pool as before, so no plan buffer is replayed
into. What is launched is unchanged (same kernels, grids, constexprs).
``PYTHONPATH=. python bench/lora_host.py`` measures the per-call host cost on a CPU.

Overlap (``QSERVE_LORA_OVERLAP``: unset = ``shrink``, the default since the H100 smoke at ``f609d24``;
``pair``; ``0`` off; CUDA, Triton kernels):
a profiled decode step at batch 32 with 8 adapters on an H100 spent 1.75 ms in 192 shrinks (9.1 µs
each, mostly the fixed cost of a launch and its split-K reduction in series) and 0.94 ms in the
expands, on a 6.2 ms base step (bench/RESULTS.md, fourteenth session), all of it after the base GEMMs
on one stream. The shrink reads only the layer's input, so it need not wait for the base GEMM: with a
``LoRAOverlap`` in the step's indices (from ``overlap_for``), ``begin_lora`` forks its side stream
from the current one and launches the shrink there, the caller launches its base GEMM, and
``finish_lora`` joins the side stream back, then expands into ``y``. ``pair`` also launches the expand
on the side stream, into a zeroed fp32 ``delta [T, N]``, and ``finish_lora`` adds it (``y.add_(delta)``:
fp32, rounded once), so the critical path keeps one elementwise launch per layer instead of two
dependent kernels. Past ``PAIR_MAX_ROWS`` rows (a long prefill) the delta's traffic outgrows what it
hides: such a call overlaps the shrink only. ``shrink`` with ``QSERVE_LORA_SIDE_SPLIT_K=auto`` gives
``add_lora``'s outputs bitwise (the same launches, reordered); with its default side split of 4 the
shrink sums its fp32 partials in other groups, so ``h`` may round differently (within fp16 / bf16 noise). ``pair`` does not quite: on a GPU Triton folds the expand's ``fp32(y) + h @ B``
into the MMA's accumulator (``y`` is its C operand), while the delta is the MMA from zero, added to
``y`` after; the two differ in the low bits of the fp32 sum, so a ``pair`` output may be one unit in
the last place of fp16 / bf16 away from ``add_lora``'s (both are the reference within the kernels'
tolerance). Captured into a CUDA graph the fork and join become the graph's edges. Buffers:
``h``, the workspace and ``delta`` are allocated on the current stream before the fork, held by the
``PendingLoRA`` until ``finish_lora`` has joined the side stream (the workspace too: a buffer freed
while the side stream still writes it goes to the current stream's next allocation), so none is freed
or reused while the side stream may touch it; consecutive layers' shrinks (sharing the arrival counters, a reused plan) stay
in order.

Fused SiLU (``QSERVE_LORA_FUSED_SILU=1``, opt-in until a GPU run passes with it): a gate_up layer's
expand and the SiLU-and-mul that reads its output become one launch (``finish_lora_silu_and_mul``,
``expand_silu_and_mul``; the model asks through ``Linear.forward_unexpanded``): a decode step keeps
one kernel after each gate_up GEMM instead of two (the expands are on the step's critical path: 0.94
ms of a batch-32 step with 8 adapters, fourteenth session) and ``y + B(h)`` is not written back and
read again. The sum is rounded to the activation dtype before the product, as the two launches do.
A "pair" call that added its delta at the join (``PAIR_MAX_ROWS`` rows or fewer) has nothing left to
expand: the plain product follows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from quant_kernels import device as kdevice
from quant_kernels import elementwise_ops, reference_lora
from quant_kernels.switches import env_switch

TILE_ROWS = 16  # = lora_triton.TILE_ROWS (not imported: triton stays lazy)
MAX_SLICES = 3  # = lora_triton.MAX_SLICES: the shrink's arrival counters per tile
_MAX_SPLIT_K = 32  # = lora_triton.MAX_SPLIT_K
_ALIGN = 4  # int32 elements per 16 bytes: where each segment of a packed index buffer starts
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
TRITON_ENV = "QSERVE_LORA_TRITON"
OVERLAP_ENV = "QSERVE_LORA_OVERLAP"
OVERLAP_MODES = ("0", "shrink", "pair")
SIDE_SPLIT_K_ENV = "QSERVE_LORA_SIDE_SPLIT_K"  # unset: 4 (DEFAULT_SIDE_SPLIT_K); "auto": the heuristic; 1..32
# The side shrink's default K split: 4 measured best beside the base GEMM (H100 2026-12-07 and H200
# 2026-12-07: batch 32 x 8 adapters 0.73x -> 0.78x / 0.82x of the base; bench/RESULTS.md), the default
# since the H200 smoke with it exported at 27649cd (971 passed)
DEFAULT_SIDE_SPLIT_K = 4
# The expand's N block: unset / "auto" (the default: lora_triton.expand_block_n's rule, 256 for the widest
# grids; H200 2026-12-07: batch 32 x 8 0.82x -> 0.84x), "64", "128" or "256"
EXPAND_BLOCK_N_ENV = "QSERVE_LORA_EXPAND_BLOCK_N"
_EXPAND_BLOCK_N_VALUES = ("64", "128", "256", "auto")
FUSED_SILU_ENV = "QSERVE_LORA_FUSED_SILU"  # unset: off (fused_silu_enabled)
PAIR_MAX_ROWS = 512  # past it a "pair" call overlaps the shrink only (module doc)


@dataclass(frozen=True, slots=True)
class LoRAOverlap:
    """QSERVE_LORA_OVERLAP's side stream (a ``torch.cuda.Stream``) and whether the expand runs on it too."""

    stream: object
    pair: bool
    # The side stream's shrink K split (``overlap_for`` passes ``side_split_k()``: 4 unless
    # QSERVE_LORA_SIDE_SPLIT_K says otherwise); None: ``shrink_config``'s heuristic, which sizes the split to
    # fill the card alone, while beside the base GEMM the shrink shares it
    split_k: int | None = None


@dataclass(frozen=True, slots=True)
class LoRAIndices:
    """Which adapter slot each row of a step uses, shared by every LoRA layer of the step.

    ``token_slots`` serves the reference; the tiles serve the kernels: the rows with a slot, sorted
    by slot (stable: a prefill segment stays in order) and cut into runs of at most ``TILE_ROWS`` rows
    of one slot.
    """

    token_slots: torch.Tensor  # int32 [T], -1: base row
    sorted_rows: torch.Tensor  # int32 [T_lora]
    tile_offsets: torch.Tensor  # int32 [G]: start of each tile in sorted_rows
    tile_lens: torch.Tensor  # int32 [G]: rows in each tile (1..TILE_ROWS)
    tile_slots: torch.Tensor  # int32 [G]: the tile's slot
    # int32 [G * MAX_SLICES], zero: the split-K shrink's arrival counters, one per tile and slice.
    # Each launch leaves them zero again, so every LoRA layer of the step shares them.
    tile_counters: torch.Tensor
    # The Triton branch's launch plans of this step, by layer shape (see the module doc): host-side
    # reuse only, filled by ``add_lora`` outside CUDA-graph capture.
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    # QSERVE_LORA_OVERLAP: the side stream the shrink (and with "pair" the expand) runs on (``begin_lora``)
    overlap: LoRAOverlap | None = field(default=None, compare=False, repr=False)


def index_layout(num_rows: int, num_tiles: int, num_sorted: int | None = None) -> tuple[int, list[tuple[int, int]]]:
    """``(total, [(start, length)] * 6)``: where a packed int32 buffer keeps the token slots
    (``num_rows``), the sorted rows (``num_sorted``, default ``num_rows``: a CUDA graph's fixed size),
    the tile offsets, lengths, slots (``num_tiles``) and the counters (``num_tiles * MAX_SLICES``),
    each segment 16-byte aligned."""
    segments = []
    start = 0
    num_sorted = num_rows if num_sorted is None else num_sorted
    for length in (num_rows, num_sorted, num_tiles, num_tiles, num_tiles, num_tiles * MAX_SLICES):
        segments.append((start, length))
        start += -(-length // _ALIGN) * _ALIGN
    return start, segments


def indices_from_buffer(
    buffer: torch.Tensor,
    num_rows: int,
    num_tiles: int,
    num_sorted: int | None = None,
    overlap: LoRAOverlap | None = None,
) -> LoRAIndices:
    """The ``LoRAIndices`` views of an int32 buffer laid out by ``index_layout`` (same arguments);
    ``overlap``: ``overlap_for``'s, or None."""
    _, segments = index_layout(num_rows, num_tiles, num_sorted)
    views = (buffer[start : start + length] for start, length in segments)
    return LoRAIndices(*views, overlap=overlap)


def max_lora_tiles(num_rows: int, max_loras: int) -> int:
    """The most tiles ``num_rows`` rows over at most ``max_loras`` adapters can take (each adapter's
    rows end in one partial tile): the fixed tile count of a CUDA graph's indices."""
    return -(-num_rows // TILE_ROWS) + min(max_loras, num_rows)


def lora_tiles(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(sorted_rows [T_lora], tile_offsets [G], tile_lens [G], tile_slots [G])`` (int32) of a step
    whose row ``t`` uses slot ``token_slots[t]`` (-1: base). Host numpy, no per-row Python loop."""
    slots = np.asarray(token_slots, dtype=np.int32)  # [T]
    rows = np.flatnonzero(slots >= 0)  # [T_lora]
    rows = rows[np.argsort(slots[rows], kind="stable")].astype(np.int32)
    sorted_slots = slots[rows]  # [T_lora]
    # Runs of one slot, then each run cut into pieces of TILE_ROWS.
    run_starts = np.flatnonzero(np.r_[True, sorted_slots[1:] != sorted_slots[:-1]])[: len(rows)]  # [runs]
    run_ends = np.r_[run_starts[1:], len(rows)][: len(run_starts)].astype(np.int64)  # [runs]
    pieces = -(-(run_ends - run_starts) // TILE_ROWS)  # [runs]
    first_piece = np.repeat(run_starts, pieces)
    piece_index = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    offsets = first_piece + piece_index * TILE_ROWS  # [G]
    lens = np.minimum(np.repeat(run_ends, pieces) - offsets, TILE_ROWS)  # [G]
    as32 = np.int32
    return rows, offsets.astype(as32), lens.astype(as32), sorted_slots[offsets].astype(as32)


def fill_index_buffer(host: np.ndarray, token_slots: np.ndarray, num_rows: int, num_tiles: int) -> None:
    """Write a step's indices into ``host`` (int32, laid out by ``index_layout(num_rows, num_tiles)``):
    row ``t < len(token_slots)`` uses slot ``token_slots[t]``, later rows (a graph's pad rows) none;
    tiles past the step's own are empty (length 0); the counters zero."""
    slots = np.full(num_rows, -1, dtype=np.int32)  # [num_rows]
    slots[: len(token_slots)] = token_slots
    _fill(host, slots, lora_tiles(slots), num_tiles)


def _fill(
    host: np.ndarray, slots: np.ndarray, tiles: tuple[np.ndarray, ...], num_tiles: int, num_sorted: int | None = None
) -> None:
    if len(tiles[1]) > num_tiles:
        raise ValueError(f"LoRA indices: {len(tiles[1])} tiles, room for {num_tiles}")
    _, segments = index_layout(len(slots), num_tiles, num_sorted)
    for (start, length), values in zip(segments, (slots, *tiles, slots[:0])):  # the counters: none given
        host[start : start + len(values)] = values
        host[start + len(values) : start + length] = 0  # unused tiles: length 0; counters: zero
    # (rows of a graph's pad rows past the step's sorted rows are never read: no tile points there)


def build_lora_indices(
    token_slots: np.ndarray, device: torch.device, overlap: LoRAOverlap | None = None
) -> LoRAIndices:
    """Indices for a step whose row ``t`` uses slot ``token_slots[t]`` (-1: base); one host-to-device
    copy for all of them (see the module doc). ``overlap``: ``overlap_for``'s, or None."""
    slots = np.ascontiguousarray(token_slots, dtype=np.int32)  # [T]
    tiles = lora_tiles(slots)
    num_rows, num_sorted, num_tiles = len(slots), len(tiles[0]), len(tiles[1])
    total, _ = index_layout(num_rows, num_tiles, num_sorted)
    host = torch.empty(total, dtype=torch.int32, pin_memory=device.type == "cuda")  # [total]
    _fill(host.numpy(), slots, tiles, num_tiles, num_sorted)
    buffer = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return indices_from_buffer(buffer, num_rows, num_tiles, num_sorted, overlap)


def triton_enabled() -> bool:
    """The Triton kernels on CUDA unless ``QSERVE_LORA_TRITON=0`` (the PyTorch reference path)."""
    return os.environ.get(TRITON_ENV, "1") != "0"


def overlap_for(device: torch.device) -> LoRAOverlap | None:
    """``QSERVE_LORA_OVERLAP`` (module doc, "Overlap"): "shrink" or "pair" on a CUDA ``device`` whose LoRA
    layers take the Triton kernels gives a new side stream (unset or empty: "shrink"); None otherwise
    ("0", another device, ``QSERVE_LORA_TRITON=0``). Made once per model by its owner (one per ``LoRAManager``),
    passed to the step's indices."""
    value = os.environ.get(OVERLAP_ENV) or "shrink"  # unset or empty: the default (measured faster, RESULTS)
    if value not in OVERLAP_MODES:
        raise ValueError(f"{OVERLAP_ENV}={value!r}: expected one of {', '.join(OVERLAP_MODES)}")
    split_k = side_split_k()
    if value == "0" or device.type != "cuda" or not triton_enabled():
        return None
    return LoRAOverlap(torch.cuda.Stream(device), pair=value == "pair", split_k=split_k)


def side_split_k() -> int | None:
    """``QSERVE_LORA_SIDE_SPLIT_K``: the K split of a shrink launched beside the base GEMM: unset or empty
    ``DEFAULT_SIDE_SPLIT_K``; None ("auto") for ``shrink_config``'s heuristic, which sizes the split to
    fill the card alone. Anything but auto or 1..MAX_SPLIT_K is refused."""
    return parse_side_split_k(os.environ.get(SIDE_SPLIT_K_ENV) or str(DEFAULT_SIDE_SPLIT_K))


def parse_side_split_k(value: str) -> int | None:
    """A ``QSERVE_LORA_SIDE_SPLIT_K`` value: None for "auto", else an integer 1..MAX_SPLIT_K (refused
    otherwise, naming the variable)."""
    if value == "auto":
        return None
    if not value.isdigit() or not 1 <= int(value) <= _MAX_SPLIT_K:
        raise ValueError(f"{SIDE_SPLIT_K_ENV}={value!r}: expected auto or an integer 1..{_MAX_SPLIT_K}")
    return int(value)


def _triton_usable(*tensors: torch.Tensor) -> bool:
    """The kernels are on (``triton_enabled``), every tensor is on a device Triton serves with its
    last dim contiguous, and the first has a kernel dtype. (A plain loop: this runs for every LoRA
    layer of a step.)"""
    if not triton_enabled() or tensors[0].dtype not in _KERNEL_DTYPES:
        return False
    for t in tensors:
        if t.stride(-1) != 1 or not kdevice.triton_serves(t.device):
            return False
    return True


@dataclass(frozen=True, slots=True)
class _LaunchPlan:
    """What one shape of Triton shrink + expand needs besides its inputs: the K split, the
    split-K workspace (a placeholder with one split) and ``h`` (``add_lora``'s private one)."""

    config: object  # lora_triton.ShrinkConfig
    workspace: torch.Tensor  # fp32 [split_k, T, S * R], or the placeholder
    h: torch.Tensor  # [T, S * R], x's dtype


_triton_module = None


def _lora_triton():  # noqa: ANN202 - the module, imported on first use (triton stays lazy)
    global _triton_module
    if _triton_module is None:  # later calls skip the import machinery (~1 µs)
        from quant_kernels import lora_triton

        _triton_module = lora_triton
    return _triton_module


def _launch_plan(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    num_slices: int,
    indices: LoRAIndices,
    split_k: int | None,
    block_k: int | None,
) -> _LaunchPlan:
    """The plan for this shape: reused from this step's earlier calls (``indices.plans``) outside a
    CUDA-graph capture (see the module doc: why reusing the buffers is safe), made fresh inside one."""
    num_rows, k = x.shape
    num_tiles = indices.tile_offsets.shape[0]
    key = (x.device, x.dtype, num_rows, k, lora_a.shape[1], num_tiles, num_slices, split_k, block_k)
    capturing = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    cache = None if capturing else indices.plans
    plan = None if cache is None else cache.get(key)
    if plan is not None:
        return plan
    config = _lora_triton().shrink_config(
        k, num_rows, num_tiles, num_slices, kdevice.sm_count(x.device, default=132), split_k, block_k
    )
    h = torch.empty((num_rows, lora_a.shape[1]), dtype=x.dtype, device=x.device)  # [T, S * R]
    workspace = (
        torch.empty((config.split_k, *h.shape), dtype=torch.float32, device=x.device)  # [split_k, T, S * R]
        if config.split_k > 1
        else kdevice.placeholder(x.device, torch.float32)  # never read with one split
    )
    plan = _LaunchPlan(config, workspace, h)
    if cache is not None:
        cache[key] = plan
    return plan


def add_lora(
    y: torch.Tensor,  # [T, N]: the base layer's output, updated in place
    x: torch.Tensor,  # [T, K]: the layer's input
    lora_a: torch.Tensor,  # [L, S * R, K]
    lora_b: torch.Tensor,  # [L, N, R]
    slice_starts: Sequence[int],  # S + 1 bounds of the output slices along N
    indices: LoRAIndices,
    *,
    split_k: int | None = None,  # the Triton shrink's K split / K block: None = its heuristic
    block_k: int | None = None,  # (overrides for tuning, bench/lora.py; the reference ignores them)
) -> torch.Tensor:
    """``y[t] += B[slot t](A[slot t](x[t]))`` (the scale is folded into B) for rows with a slot."""
    num_slices = len(slice_starts) - 1
    if _triton_usable(x, lora_a, y, lora_b) and y.dtype in _KERNEL_DTYPES:  # both halves' checks at once
        plan = _launch_plan(x, lora_a, num_slices, indices, split_k, block_k)
        _launch_shrink(x, lora_a, num_slices, indices, plan, plan.h)
        return _expand(y, plan.h, lora_b, indices, slice_starts)
    h = lora_shrink(x, lora_a, num_slices, indices, split_k=split_k, block_k=block_k)
    return lora_expand(y, h, lora_b, slice_starts, indices)


@dataclass(slots=True)
class PendingLoRA:
    """A ``begin_lora``'s launches, for its ``finish_lora``."""

    h: torch.Tensor  # [T, S * R]: the shrink's output
    beside: bool  # launched on the side stream (finish_lora joins it first); False: in order
    delta: torch.Tensor | None  # fp32 [T, N]: "pair" mode's expand of h, added to y after the join
    # The side stream's split-K workspace (fp32 [split_k, T, S * R]), held until the join: freed at
    # begin_lora's return, its memory went to the current stream's next allocation while the shrink
    # still wrote its partials there (inside a CUDA-graph capture, whose plans are not cached, at once:
    # the first H100 smoke with the overlap's graph test, 2026-12-06)
    workspace: torch.Tensor | None = None


def begin_lora(
    x: torch.Tensor,  # [T, K]: the layer's input
    lora_a: torch.Tensor,  # [L, S * R, K]
    lora_b: torch.Tensor,  # [L, N, R]
    slice_starts: Sequence[int],  # S + 1 bounds of the output slices along N
    indices: LoRAIndices,
) -> PendingLoRA:
    """``add_lora``'s launches that need no base output, made before the base layer's GEMM: with
    ``indices.overlap`` and the Triton kernels, the shrink ("pair": and the expand into a delta) on the
    side stream, forked from the current one; else the shrink, in order. Hand the result to
    ``finish_lora`` with the base output."""
    overlap = indices.overlap
    num_slices = len(slice_starts) - 1
    if overlap is None or not _triton_usable(x, lora_a, lora_b):
        return PendingLoRA(lora_shrink(x, lora_a, num_slices, indices), False, None)
    plan = _launch_plan(x, lora_a, num_slices, indices, overlap.split_k, None)  # allocated on the current stream
    delta = None
    if overlap.pair and x.shape[0] <= PAIR_MAX_ROWS:
        delta = torch.empty((x.shape[0], lora_b.shape[1]), dtype=torch.float32, device=x.device)  # [T, N]
    overlap.stream.wait_stream(torch.cuda.current_stream(x.device))  # the fork: x is ready
    with torch.cuda.stream(overlap.stream):
        _launch_shrink(x, lora_a, num_slices, indices, plan, plan.h)
        if delta is not None:
            delta.zero_()  # base rows: y + 0 is y
            _expand(delta, plan.h, lora_b, indices, slice_starts)
    return PendingLoRA(plan.h, True, delta, plan.workspace)


def finish_lora(
    y: torch.Tensor,  # [T, N]: the base layer's output, updated in place
    pending: PendingLoRA,  # begin_lora's
    lora_b: torch.Tensor,  # [L, N, R]
    slice_starts: Sequence[int],
    indices: LoRAIndices,
) -> torch.Tensor:
    """The rest of a ``begin_lora``: after the join (the side stream's launches done), ``y += B(h)``
    (the expand, or "pair" mode's delta added)."""
    if _join(y, pending, indices):
        return y
    return lora_expand(y, pending.h, lora_b, slice_starts, indices)


def finish_lora_silu_and_mul(
    y: torch.Tensor,  # [T, 2I]: a gate_up layer's base output (written only by "pair" mode's delta)
    pending: PendingLoRA,  # begin_lora's
    lora_b: torch.Tensor,  # [L, 2I, R]
    slice_starts: Sequence[int],  # (0, I, 2I)
    indices: LoRAIndices,
) -> torch.Tensor:  # [T, I]
    """``silu_and_mul(finish_lora(y, ...))`` of a gate_up layer, with the expand fused into the product
    (``expand_silu_and_mul``) where no "pair" delta was added at the join."""
    if _join(y, pending, indices):
        return elementwise_ops.silu_and_mul(y)
    return expand_silu_and_mul(y, pending.h, lora_b, slice_starts, indices)


def _join(y: torch.Tensor, pending: PendingLoRA, indices: LoRAIndices) -> bool:
    """Join a side-stream ``begin_lora`` back (the current stream waits for its launches); True where
    "pair" mode's delta was then added to ``y`` (nothing left to expand)."""
    if not pending.beside:
        return False
    assert indices.overlap is not None
    torch.cuda.current_stream(y.device).wait_stream(indices.overlap.stream)  # the join: h (and delta) ready
    if pending.delta is None:
        return False
    y.add_(pending.delta)  # fp32(y) + delta, rounded once (module doc: not bitwise the expand's)
    return True


def fused_silu_enabled() -> bool:
    """``QSERVE_LORA_FUSED_SILU``: a gate_up layer's expand fused into the SiLU-and-mul after it (off unless
    ``1`` until a GPU run has passed with it on; the model reads it once, when built)."""
    return env_switch(FUSED_SILU_ENV, default=False)


def expand_silu_and_mul(
    y: torch.Tensor,  # [T, 2I]: a gate_up layer's base output
    h: torch.Tensor,  # [T, 2R]: its shrink's output
    lora_b: torch.Tensor,  # [L, 2I, R]
    slice_starts: Sequence[int],  # (0, I, 2I): gate's and up's columns
    indices: LoRAIndices,
) -> torch.Tensor:  # [T, I], new
    """``silu(gate) * up`` for ``gate, up = (y + B(h)).chunk(2, -1)`` (rows without a slot: ``y``'s own).
    The Triton kernel does both in one launch (``lora_triton.lora_expand_silu_mul_kernel``; y is left as
    it was); elsewhere the expand into ``y``, then the product."""
    starts = tuple(slice_starts)
    gate_up = len(starts) == 3 and starts[0] == 0 and 2 * starts[1] == starts[2] == y.shape[1]
    if gate_up and _triton_usable(y, h, lora_b) and y.dtype in _KERNEL_DTYPES:
        out = torch.empty((y.shape[0], starts[1]), dtype=y.dtype, device=y.device)  # [T, I]
        block_n = expand_block_n(indices.tile_offsets.shape[0], starts)  # the unfused expand's for this grid
        return _lora_triton().lora_expand_silu_and_mul(
            y, h, lora_b, indices.token_slots, *_tiles(indices), out, block_n
        )
    return elementwise_ops.silu_and_mul(lora_expand(y, h, lora_b, slice_starts, indices))


def lora_shrink(
    x: torch.Tensor,  # [T, K]: the layer's input
    lora_a: torch.Tensor,  # [L, S * R, K]
    num_slices: int,
    indices: LoRAIndices,
    *,
    split_k: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:  # [T, S * R]
    """The first half of ``add_lora``: ``h[t] = A[slot t](x[t])`` (rows without a slot: never read).
    Apart so that a row-parallel layer can all-reduce its partial ``h`` between the halves."""
    h = torch.empty((x.shape[0], lora_a.shape[1]), dtype=x.dtype, device=x.device)  # [T, S * R]: the caller's
    if _triton_usable(x, lora_a):
        plan = _launch_plan(x, lora_a, num_slices, indices, split_k, block_k)  # its config and workspace
        _launch_shrink(x, lora_a, num_slices, indices, plan, h)
        return h
    return reference_lora.lora_shrink(x, lora_a, indices.token_slots, h)


def lora_expand(
    y: torch.Tensor,  # [T, N]: updated in place
    h: torch.Tensor,  # [T, S * R]: lora_shrink's output
    lora_b: torch.Tensor,  # [L, N, R]
    slice_starts: Sequence[int],  # S + 1 bounds of the output slices along N
    indices: LoRAIndices,
) -> torch.Tensor:
    """The second half of ``add_lora``: ``y[t] += B[slot t](h[t])`` for rows with a slot."""
    if _triton_usable(y, h, lora_b):
        return _expand(y, h, lora_b, indices, slice_starts)
    return reference_lora.lora_expand(y, h, lora_b, indices.token_slots, slice_starts)


def expand_block_n_setting() -> str:
    """``QSERVE_LORA_EXPAND_BLOCK_N`` (unset or empty: "auto"); anything but 64, 128, 256 or auto is refused."""
    value = os.environ.get(EXPAND_BLOCK_N_ENV) or "auto"
    if value not in _EXPAND_BLOCK_N_VALUES:
        raise ValueError(f"{EXPAND_BLOCK_N_ENV}={value!r}: expected one of {', '.join(_EXPAND_BLOCK_N_VALUES)}")
    return value


def _expand(
    y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, indices: LoRAIndices, slice_starts: Sequence[int]
) -> torch.Tensor:
    """The Triton expand with the N block ``QSERVE_LORA_EXPAND_BLOCK_N`` asks for."""
    starts = tuple(slice_starts)
    block_n = expand_block_n(indices.tile_offsets.shape[0], starts)
    return _lora_triton().lora_expand(y, h, lora_b, *_tiles(indices), starts, block_n)


def expand_block_n(num_tiles: int, slice_starts: tuple[int, ...]) -> int:
    """The Triton expand's N block for ``num_tiles`` tiles (padding included) over ``slice_starts``:
    ``QSERVE_LORA_EXPAND_BLOCK_N``'s, "auto" through ``lora_triton.expand_block_n``'s rule."""
    setting = expand_block_n_setting()
    return _lora_triton().expand_block_n(num_tiles, slice_starts) if setting == "auto" else int(setting)


def _launch_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, num_slices: int, indices: LoRAIndices, plan: _LaunchPlan, h: torch.Tensor
) -> None:
    """The Triton shrink into ``h`` ``[T, S * R]`` with ``plan``'s K split and workspace."""
    _lora_triton().lora_shrink(
        x, lora_a, *_tiles(indices), num_slices, h, plan.config, plan.workspace, indices.tile_counters
    )


def _tiles(indices: LoRAIndices) -> tuple[torch.Tensor, ...]:
    return indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots
