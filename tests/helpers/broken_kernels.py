"""Kernels that must not compile, or must not launch: the controls of the launch-compile check.

Knows: two ways a launch breaks on a GPU while every interpreter test passes. Must not know:
qserve. Used by ``tests/kernels/test_launch_compile.py`` only, to show the check can fail.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def split_or_direct_kernel(out_ptr, cnt_ptr, n, USE_SPLIT: tl.constexpr, SEGMENTED: tl.constexpr = False):
    """b0d3937's ``_write_tile`` in miniature: the branch choice is a variable the frontend does not
    fold, so the atomic on ``cnt_ptr`` is compiled (and type-checked) even when ``USE_SPLIT`` is off."""
    offs = tl.arange(0, 16)
    direct = not USE_SPLIT
    if SEGMENTED:
        direct = n == 1
    if direct:
        tl.store(out_ptr + offs, tl.zeros((16,), tl.float16), mask=offs < n)
    else:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


def launch_split_or_direct(out: torch.Tensor) -> None:
    """Launch it as b0d3937's wrapper did without split-K: the fp16 output passed as the counters."""
    split_or_direct_kernel[(1,)](out, out, out.numel(), USE_SPLIT=False)


@triton.jit
def big_tile_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    """A matrix product whose pipelined tiles need more shared memory than an sm86 block may have."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + offs[:, None] * K + k + offs[None, :])
        b = tl.load(b_ptr + (k + offs[:, None]) * BLOCK + offs[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], acc)


def launch_big_tile(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """128 x 128 fp16 tiles of both operands, 3 stages: 64 KB of buffers per stage (sm90: 192 KB, under
    its 227 KB; sm86: 128 KB, over the 99 KB an sm86 / sm89 block may have)."""
    big_tile_kernel[(1,)](a, b, c, a.shape[1], BLOCK=128, num_warps=8, num_stages=3)


@triton.jit
def fill_kernel(out_ptr):
    """One store per program."""
    tl.store(out_ptr + tl.program_id(1), 0.0)


def launch_tall_grid(out: torch.Tensor) -> None:
    """A grid of 70,000 programs along y: CUDA allows 65,535 there (an elementwise grid over rows must
    put them on x). Launched twice, first within the limit, so the check must look at every launch's
    grid and not only the one that compiled the kernel."""
    fill_kernel[(1, 8)](out)
    fill_kernel[(1, 70_000)](out)
