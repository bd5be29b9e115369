"""Multi-LoRA kernel benchmark: the grouped shrink + expand (``quant_kernels.lora_triton``) against
the PyTorch reference and against the bandwidth floor of the adapters' A/B reads.

Knows: Qwen2.5-14B's adapted layers (qkv 5120 -> 5120+1024+1024, o 5120 -> 5120, gate_up 5120 ->
2x13824, down 13824 -> 5120), rank 16 (issue 30's case), batches of decode rows spread over 1, 8 or
32 distinct adapters plus a prefill chunk, how to time (``triton.testing.do_bench``, median, L2
flushed) and the copy bandwidth of this card. Must not know: the engine. Every timed configuration is
first checked against the reference on fresh random data in the same run.

    PYTHONPATH=. python bench/lora.py --out $OUT/lora.md

Per layer and case: ``triton`` µs (shrink + expand, one call of ``lora_ops.add_lora`` with
``QSERVE_LORA_TRITON=1``), ``reference`` µs (the gather-based torch path qserve runs without the
opt-in), ``floor`` µs = bytes the kernels must move (each distinct adapter's A and B once, x read,
y read and written) / the measured copy bandwidth, and ``floor / triton``. ``--tiny`` is a CPU smoke
run under ``TRITON_INTERPRET=1`` at toy sizes (wall-clock times, meaningless as performance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # must precede the first @triton.jit definition
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import lora_ops, reference_lora  # noqa: E402

LAYERS = {  # name -> (K, output slices)
    "qkv": (5120, [5120, 1024, 1024]),
    "o": (5120, [5120]),
    "gate_up": (5120, [13824, 13824]),
    "down": (13824, [5120]),
}
RANK = 16
MAX_LORAS = 32
# (label, rows, distinct adapters, rows per sequence)
CASES = [
    ("decode b1 x1", 1, 1, 1),
    ("decode b32 x1", 32, 1, 1),
    ("decode b32 x8", 32, 8, 1),
    ("decode b32 x32", 32, 32, 1),
    ("decode b128 x8", 128, 8, 1),
    ("decode b128 x32", 128, 32, 1),
    ("prefill 2048 x4", 2048, 4, 512),
]
TINY_LAYERS = {"qkv": (64, [64, 16, 16]), "down": (96, [64])}
TINY_CASES = [("decode b4 x2", 4, 2, 1), ("prefill 40 x2", 40, 2, 20)]


def bench_us(fn, warmup: int = 10, rep: int = 50) -> float:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.randint(0, 255, (1 << (30 if DEVICE == "cuda" else 20),), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = bench_us(lambda: dst.copy_(src), rep=100)
    return 2 * src.numel() / (t * 1e-6)


def run_case(k: int, sizes: list[int], rows: int, distinct: int, per_seq: int, num_slots: int, dtype, bandwidth):
    gen = torch.Generator().manual_seed(rows * 31 + distinct)
    n = sum(sizes)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)  # [T, K]
    y = torch.randn(rows, n, generator=gen).to(dtype).to(DEVICE)  # [T, N]
    lora_a = (torch.randn(num_slots, len(sizes) * RANK, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    lora_b = (torch.randn(num_slots, n, RANK, generator=gen) * 0.1).to(dtype).to(DEVICE)
    seqs = -(-rows // per_seq)
    slots = np.repeat(np.arange(seqs) % distinct, per_seq)[:rows].astype(np.int32)  # [T]
    starts = [0, *np.cumsum(sizes).tolist()]
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    h = torch.empty(rows, lora_a.shape[1], dtype=dtype, device=DEVICE)
    want = reference_lora.lora_expand(
        y.clone(),
        reference_lora.lora_shrink(x, lora_a, indices.token_slots, h.clone()),
        lora_b,
        indices.token_slots,
        starts,
    )
    os.environ[lora_ops.TRITON_ENV] = "1"
    got = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices)
    if DEVICE == "cpu":  # the interpreter path: call the kernels' wrappers directly
        from quant_kernels import lora_triton

        tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
        got = lora_triton.lora_expand(
            y.clone(), lora_triton.lora_shrink(x, lora_a, *tiles, len(sizes), h), lora_b, *tiles, starts
        )
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error < 3e-2, f"kernel differs from the reference by {error:.2e} (relative)"
    triton_us = bench_us(lambda: lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices))
    os.environ[lora_ops.TRITON_ENV] = "0"
    reference_us = bench_us(lambda: lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices))
    elem = x.element_size()
    moved = distinct * (lora_a[0].numel() + lora_b[0].numel()) * elem + rows * (k + 2 * n) * elem
    floor_us = moved / bandwidth * 1e6
    return {"triton_us": triton_us, "reference_us": reference_us, "floor_us": floor_us, "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the table (Markdown) and the raw JSON beside it")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = parser.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    tiny = args.tiny or DEVICE == "cpu"
    layers, cases = (TINY_LAYERS, TINY_CASES) if tiny else (LAYERS, CASES)
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (interpreter)"
    lines = [
        f"# LoRA shrink + expand, rank {RANK}, {args.dtype}, {device}; copy bandwidth {bandwidth / 1e9:.0f} GB/s",
        "",
        "| layer | case | triton µs | reference µs | floor µs | floor / triton |",
        "|---|---|---:|---:|---:|---:|",
    ]
    raw = []
    for name, (k, sizes) in layers.items():
        for label, rows, distinct, per_seq in cases:
            result = run_case(
                k, sizes, rows, distinct, per_seq, max(distinct, 2 if tiny else MAX_LORAS), dtype, bandwidth
            )
            raw.append({"layer": name, "case": label} | result)
            lines.append(
                f"| {name} | {label} | {result['triton_us']:.1f} | {result['reference_us']:.1f} | "
                f"{result['floor_us']:.1f} | {result['floor_us'] / result['triton_us']:.2f} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
