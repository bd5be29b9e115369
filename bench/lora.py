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

``--e2e`` (issue 30's engine measurements): a Qwen2.5-14B-shaped random GPTQ checkpoint
(``bench/e2e.py``'s) under ``--budget``, rank-16 random adapters on every projection of every layer
(4 distinct files, registered under up to 32 names: each name its own slot), decode tok/s at batch 32
and 128 with 1, 8 and 32 distinct adapters and at batch 1 with one, against the base model with CUDA
graphs (the default) and eager, LoRA eager (the default with LoRA) with and without
``QSERVE_LORA_TRITON``, and LoRA with its opt-in decode graphs (``QSERVE_LORA_GRAPHS=1``), plus the
memory plan with the 32 slots set aside. ``--e2e --small`` checks the script on CPU.
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


def e2e(args: argparse.Namespace) -> list[str]:
    """Engine decode throughput with adapters vs the base model (see the module doc)."""
    import gc
    from pathlib import Path

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import e2e as e2e_bench  # bench/e2e.py: the random 14B-shaped checkpoint

    from qserve import LLM, LoRARequest, SamplingParams
    from tests.helpers.lora_adapters import projection_shapes, write_peft_adapter

    shape = e2e_bench.SMALL if args.small else e2e_bench.QWEN14B
    tmp = Path(args.tmp)
    ckpt = tmp / ("small-gptq" if args.small else "qwen14b-gptq")
    if not (ckpt / "config.json").is_file():
        e2e_bench.write_random_gptq(ckpt, shape)
    h, d = shape["hidden"], 128 if shape["hidden"] >= 1024 else shape["hidden"] // shape["heads"]
    shapes = projection_shapes(h, shape["inter"], shape["heads"], shape["kv_heads"], d)
    projections = tuple(shapes)
    files = []
    for i in range(4):
        path = tmp / f"lora-r{RANK}-{i}"
        if not (path / "adapter_config.json").is_file():
            write_peft_adapter(
                path, shapes, shape["layers"], targets=projections, rank=RANK, alpha=32, seed=i, std=0.01
            )
        files.append(str(path))
    names = [LoRARequest(f"a{i}", i + 1, files[i % 4]) for i in range(MAX_LORAS)]
    budget = args.budget if DEVICE == "cuda" else None
    steps = 4 if args.small else 32
    batches = (1, 4) if args.small else (1, 32, 128)
    lines = ["| engine | batch | adapters | decode tok/s |", "|---|---:|---:|---:|"]

    def decode(llm: LLM, batch: int, distinct: int) -> float:
        engine = llm.engine
        gen = torch.Generator().manual_seed(batch)
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch):
            ids = torch.randint(3, shape["vocab"], (128,), generator=gen).tolist()
            lora = names[i % distinct] if distinct else None
            engine.add_request(f"d{batch}-{distinct}-{i}", {"prompt_token_ids": ids}, params, lora_request=lora)
        while any(not seq.request.output_token_ids for _, seq in engine._sequences.values()):  # noqa: SLF001
            engine.step()
        e2e_bench.sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        e2e_bench.sync()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return batch * steps / elapsed

    common = dict(device=DEVICE, gpu_memory_budget=budget, max_model_len=4096, max_num_seqs=256)
    runs = [("base, CUDA graphs", {}, [0]), ("base, eager", {"enforce_eager": True}, [0])]
    lora = dict(enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=RANK)
    runs += [(f"LoRA, {k}", lora | {"_triton": k == "triton"}, [1, 8, 32]) for k in ("reference", "triton")]
    runs.append(("LoRA, triton + graphs", lora | {"_triton": True, "_graphs": True}, [1, 8, 32]))
    for label, kwargs, adapter_counts in runs:
        os.environ[lora_ops.TRITON_ENV] = "1" if kwargs.pop("_triton", False) else "0"
        os.environ["QSERVE_LORA_GRAPHS"] = "1" if kwargs.pop("_graphs", False) else "0"
        llm = LLM(str(ckpt), **common, **kwargs)
        if llm.engine.memory_plan is not None:
            lines.insert(0, f"- {label}: plan " + llm.engine.memory_plan.describe().replace("\n", "; "))
        for batch in batches:
            for distinct in adapter_counts:
                if distinct > batch and distinct != adapter_counts[0]:
                    continue  # batch 1: one adapter
                tps = decode(llm, batch, min(distinct, batch))
                lines.append(f"| {label} | {batch} | {min(distinct, batch)} | {tps:.0f} |")
                print(lines[-1], flush=True)
        del llm
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the table (Markdown) and the raw JSON beside it")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--e2e", action="store_true", help="engine decode throughput with adapters (issue 30)")
    parser.add_argument("--small", action="store_true", help="--e2e on a tiny shape (CPU check of the script)")
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--tmp", default="/tmp/qserve-bench")
    args = parser.parse_args()
    if args.e2e:
        text = "\n".join(e2e(args)) + "\n"
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        return
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
