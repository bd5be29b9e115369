"""W4A16 kernel benchmark (issue 4): Triton fused dequant-GEMM vs cuBLAS fp16, tinygemm and the floor.

Knows: Qwen2.5-14B linear shapes, how to time (CUDA-graph replay of 8 calls on 8 weight copies,
``triton.testing.do_bench`` median), the int4
bandwidth floor (bytes that must move / copy bandwidth measured in this run). Must not know:
anything of the engine. Every configuration it times is first checked against the reference on
fresh random data (poisoned output buffer, relative error bound), in the same run.

    PYTHONPATH=. python bench/kernels.py --sweep --out $OUT/kernels.md

``--sweep`` times every candidate config per (shape, M) and reports the fastest (the table the
dispatch defaults come from); without it the built-in dispatch (``select_config``) is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import reference  # noqa: E402
from quant_kernels.layout import PackedQuantWeight, pack_codes  # noqa: E402
from quant_kernels.w4a16_triton import (  # noqa: E402
    W4A16Config,
    candidate_configs,
    num_split_counters,
    prepare,
    select_config,
    set_config,
    w4a16_gemm,
)

SHAPES = {  # name: (K, N) of Qwen2.5-14B
    "qkv": (5120, 7168),
    "o": (5120, 5120),
    "gate_up": (5120, 27648),
    "down": (13824, 5120),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
GROUP = 128
REL_TOL = 1e-2  # fp16 output vs the reference: measured ~3e-4


def bench_us(fn, warmup: int = 10, rep: int = 25) -> float:
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")  # [1 GiB]
    dst = torch.empty_like(src)
    t = bench_us(lambda: dst.copy_(src), rep=100)
    return 2 * (1 << 30) / (t * 1e-6)


def make_weight(k: int, n: int, group: int) -> tuple[PackedQuantWeight, torch.Tensor]:
    codes = torch.randint(0, 16, (k, n), dtype=torch.int32, device="cuda")  # [K, N]
    scales = (torch.rand(k // group, n, device="cuda") * 0.02 + 0.005).half()  # [K/G, N]
    return PackedQuantWeight(4, group, pack_codes(codes, 4), scales), codes


def make_tinygemm(codes: torch.Tensor, weight: PackedQuantWeight):
    """torch's tinygemm int4 (bf16 activations) for the same codes; None if it does not run here."""
    try:
        w_nk = codes.t().contiguous()  # [N, K]
        packed_u8 = (w_nk[:, ::2] << 4 | w_nk[:, 1::2]).to(torch.uint8)  # [N, K/2]
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
        scales = weight.scales.to(torch.bfloat16)  # [K/G, N]
        scale_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=2).contiguous()  # [K/G, N, 2]

        def run(x: torch.Tensor) -> torch.Tensor:
            return torch._weight_int4pack_mm(x, packed, weight.group_size, scale_zeros)

        run(torch.randn(2, weight.in_features, dtype=torch.bfloat16, device="cuda"))
        return run
    except Exception as exc:  # noqa: BLE001 - reported as n/a
        print(f"tinygemm unavailable: {type(exc).__name__}: {exc}", flush=True)
        return None


GRAPH_LAYERS = 8  # distinct weight copies per graph: together far larger than the 50 MB L2


def graph_us(calls: list, rep: int = 50, repeats: int = 3) -> float:
    """Per-call µs of a CUDA graph that runs ``calls`` back to back, as a decode step does: no
    Python launch cost inside the timing, no L2 flush between calls, and every call on its own
    weight copy so nothing is served from L2. (Timing one eager launch with do_bench measured
    the host's launch latency too: the same config varied up to 4x between runs.)"""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compile / warm outside capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    t = statistics.median(bench_us(graph.replay, rep=rep) for _ in range(repeats)) / len(calls)
    del graph
    return t


def check(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_shape(
    name: str, ms: list[int], sweep: bool, bw: float, rows: list[dict], sweep_log: list[dict], t_start: float
) -> None:
    """Time every M for one layer shape; append a row per M (and every timed config) to the logs."""
    k, n = SHAPES[name]
    weight, codes = make_weight(k, n, GROUP)
    dense = reference.dequantize(weight, torch.float16)  # [K, N] (canonical weight)
    tinys = [make_tinygemm(codes, weight) for _ in range(GRAPH_LAYERS)]
    tinys = tinys if all(t is not None for t in tinys) else None
    weight = prepare(weight)  # load-time repack into the kernel layout (TiledQuantWeight)
    copies = [weight] + [
        dataclasses.replace(weight, qweight=weight.qweight.clone(), scales=weight.scales.clone())
        for _ in range(GRAPH_LAYERS - 1)
    ]
    denses = [dense] + [dense.clone() for _ in range(GRAPH_LAYERS - 1)]
    counters = [torch.zeros(num_split_counters(n), dtype=torch.int32, device="cuda") for _ in range(GRAPH_LAYERS)]
    del codes
    for m in ms:
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")  # [M, K] fresh per M
        ref = x @ dense  # the reference op (w4a16_matmul without perm), cuBLAS fp16
        t_cublas = graph_us([lambda x=x, d=d: x @ d for d in denses])
        t_cublas_eager = statistics.median(bench_us(lambda x=x: x @ dense, rep=50) for _ in range(3))
        t_tiny = None
        if tinys is not None:
            xb = x.bfloat16()
            try:
                t_tiny = graph_us([lambda xb=xb, f=f: f(xb) for f in tinys])
            except Exception as exc:  # noqa: BLE001
                print(f"tinygemm failed at M={m}: {exc}", flush=True)
        cfgs = candidate_configs(m, k, n, weight.block_k) if sweep else [select_config(weight, torch.float16, m)]
        timed: list[tuple[float, W4A16Config, float]] = []
        for cfg in cfgs:
            out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")  # poisoned
            try:
                w4a16_gemm(x, weight, None, cfg, counters[0], out=out)
                err = check(out, ref)
                out2 = w4a16_gemm(x, weight, None, cfg, counters[0])  # counters must be back at zero
                err = max(err, check(out2, ref))
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                print(f"  {name} M={m} {cfg.short()}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            if err > REL_TOL:
                print(f"  WRONG {name} M={m} {cfg.short()}: rel err {err:.2e}", flush=True)
                sweep_log.append({"shape": name, "m": m, "cfg": cfg.short(), "us": None, "err": err})
                continue
            calls = [lambda w=w, c=c, cfg=cfg, x=x: w4a16_gemm(x, w, None, cfg, c) for w, c in zip(copies, counters)]
            t = graph_us(calls, rep=20, repeats=1)
            sweep_log.append({"shape": name, "m": m, "cfg": cfg.short(), "us": t, "err": err})
            timed.append((t, cfg, err))
        assert timed, f"no correct config for {name} M={m}"
        timed.sort(key=lambda r: r[0])
        # Re-time the 3 fastest as carefully as the baselines (median of 3); keep the best.
        best = min(
            (
                (
                    graph_us(
                        [
                            lambda w=w, c=c, cfg=cfg, x=x: w4a16_gemm(x, w, None, cfg, c)
                            for w, c in zip(copies, counters)
                        ]
                    ),
                    cfg,
                    err,
                )
                for _, cfg, err in timed[:3]
            ),
            key=lambda r: r[0],
        )
        set_config(weight, torch.float16, m, best[1])
        floor_bytes = k * n // 2 + (k // GROUP) * n * 2 + m * k * 2 + m * n * 2
        t_floor = floor_bytes / bw * 1e6
        row = {
            "shape": name,
            "K": k,
            "N": n,
            "M": m,
            "us": best[0],
            "cfg": best[1].short(),
            "cfg_repr": repr(best[1]),
            "err": best[2],
            "cublas_us": t_cublas,
            "cublas_eager_us": t_cublas_eager,
            "tiny_us": t_tiny,
            "floor_us": t_floor,
        }
        rows.append(row)
        tiny_s = f"{t_tiny / best[0]:.2f}x" if t_tiny else "n/a"
        print(
            f"{name:8s} M={m:5d} {best[0]:9.1f}us  cuBLAS {t_cublas:8.1f}us ({t_cublas / best[0]:.2f}x)  "
            f"floor {100 * t_floor / best[0]:5.1f}%  tiny {tiny_s}  err {best[2]:.1e}  [{best[1].short()}]"
            f"  ({time.time() - t_start:.0f}s)",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time every candidate config, report the fastest")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels.md"))
    args = ap.parse_args()
    torch.manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    names = args.shapes.split(",")

    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = []
    sweep_log: list[dict] = []
    t_start = time.time()
    for name in names:
        bench_shape(name, ms, args.sweep, bw, rows, sweep_log, t_start)
        torch.cuda.empty_cache()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(os.path.splitext(args.out)[0] + "_sweep.json", "w") as f:  # partial results survive a timeout
            json.dump({"rows": rows, "sweep": sweep_log, "copy_bw": bw}, f, indent=1)

    lines = [
        f"# W4A16 kernels: {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth "
        f"{bw / 1e12:.2f} TB/s",
        "",
        "4-bit, group 128, symmetric, fp16 activations. Every time (ours, cuBLAS fp16 `x @ W`, tinygemm) is the "
        "per-call median µs of a CUDA graph of 8 back-to-back calls on 8 distinct weight copies (decode-step "
        "conditions: no launch cost, weights not in L2); xcuBLAS = cuBLAS µs / ours; floor = int4 bytes / copy "
        "bandwidth; xtiny = tinygemm (bf16) µs / ours; eager cuBLAS = do_bench of one eager `x @ W` (L2 flushed), "
        "comparable with docs/benchmarks.md.",
        "",
        "| shape (KxN) | M | µs | xcuBLAS | % floor | xtiny | cuBLAS µs | eager cuBLAS µs | floor µs | tiny µs "
        "| rel err | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tiny_x = f"{r['tiny_us'] / r['us']:.2f}" if r["tiny_us"] else "n/a"
        tiny_us = f"{r['tiny_us']:.1f}" if r["tiny_us"] else "n/a"
        lines.append(
            f"| {r['shape']} {r['K']}x{r['N']} | {r['M']} | {r['us']:.1f} | {r['cublas_us'] / r['us']:.2f} | "
            f"{100 * r['floor_us'] / r['us']:.0f} | {tiny_x} | {r['cublas_us']:.1f} | {r['cublas_eager_us']:.1f} | "
            f"{r['floor_us']:.1f} | {tiny_us} | {r['err']:.1e} | {r['cfg']} |"
        )
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + "_sweep.json", "w") as f:
        json.dump({"rows": rows, "sweep": sweep_log, "copy_bw": bw}, f, indent=1)
    print("\nshape     M      us   xcuBLAS  %floor  xtiny")
    for r in rows:
        tiny_x = f"{r['tiny_us'] / r['us']:.2f}" if r["tiny_us"] else "n/a"
        print(
            f"{r['shape']:8s} {r['M']:5d} {r['us']:7.1f} {r['cublas_us'] / r['us']:7.2f} "
            f"{100 * r['floor_us'] / r['us']:6.0f}  {tiny_x}"
        )


if __name__ == "__main__":
    main()
