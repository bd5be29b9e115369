"""Issue 26 / 25: the Gluon W4A16 kernel (quant_kernels.w4a16_wgmma_gluon) against cuBLAS fp16 and the
built-in dispatch at 64-4,096 rows, Qwen2.5-14B shapes, on an sm90 device.

Every candidate is checked against the dense product on a NaN-poisoned output first (relative error
under 1e-2, as bench/kernels.py), then timed inside a CUDA graph that runs 8 weight copies back to
back (nothing served from L2; bench/kernels.py's ``graph_us``). Ratios are cuBLAS µs / candidate µs
in the same run. Writes a markdown table (--out) and prints it.

    python3 bench/w4a16_gluon.py --ms 64,128,256,512,1024,4096 --out $OUT/w4a16_gluon.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels import GRAPH_LAYERS, GROUP, REL_TOL, SHAPES, check, graph_us, make_weight  # noqa: E402

from quant_kernels import w4a16_mma_triton as mma  # noqa: E402
from quant_kernels import w4a16_wgmma_gluon as glk  # noqa: E402
from quant_kernels.reference import dequantize  # noqa: E402

CANDIDATES = [  # (block_m, block_n, stages, warps, split_k[, scales_ahead: 1 if left out[, block_k: 128]])
    (128, 128, 4, 8, 1),
    (128, 64, 4, 4, 1),
    (64, 128, 4, 8, 1),
    (256, 128, 2, 8, 1),
    # One warpgroup a program in under half the shared memory: two programs an SM, each waiting at its
    # own barriers while the other's wgmmas run (the 8-warp tiles hold the SM alone: 164 KB).
    (128, 64, 3, 4, 1),
    (128, 64, 2, 4, 1),
    (64, 64, 4, 4, 1),
    # the default launch: the scales two K-tiles ahead (2-8% ahead of one at every shape, twenty-first
    # session), in 1-4 K shares (auto_split picks the count)
    (128, 64, 3, 4, 1, 2),
    (128, 64, 3, 4, 2, 2),
    (128, 64, 3, 4, 3, 2),
    (128, 64, 3, 4, 4, 2),
]


def configs(m: int, candidates: list[tuple[int, ...]] | None = None) -> list[glk.WgmmaConfig]:
    out = []
    for bm, bn, st, w, sk, *rest in candidates or CANDIDATES:
        base = glk.WgmmaConfig(
            block_m=bm,
            block_n=bn,
            block_k=rest[1] if len(rest) > 1 else 128,
            stages=st,
            num_warps=w,
            split_k=sk,
            scales_ahead=rest[0] if rest else 1,
        )
        cfg = glk.fit(base, m)
        if cfg not in out:
            out.append(cfg)
    return out


def time_fn(one, calls, m: int, n: int, ref: torch.Tensor) -> tuple[float | None, float]:
    """(µs, rel err): checked once on a NaN-poisoned output, then graph-timed over the weight copies."""
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")  # [M, N]
    one(out)
    err = check(out, ref)
    if err > REL_TOL:
        return None, err
    return graph_us(calls, rep=20, repeats=1), err


def bench_m(name: str, m: int, k: int, n: int, copies: list, candidates: list | None = None) -> dict:
    x = torch.randn(m, k, dtype=torch.float16, device="cuda") * 0.5  # [M, K]
    w0, dense0 = copies[0]
    ref = x.float() @ dense0.float()  # [M, N]
    outs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in copies]
    pairs = [(w, d, o) for (w, d), o in zip(copies, outs)]
    # each copy's split-K arrival counters, allocated once and left at zero by every launch (as the engine's
    # weights hold theirs, quant_kernels.ops), one per output tile of any candidate (tiles of 16 x 64 or more)
    tiles = triton.cdiv(n, 64) * triton.cdiv(m, 16)
    counters = {id(w): torch.zeros(tiles, dtype=torch.int32, device="cuda") for w, _ in copies}
    row = {"layer": name, "M": m}
    row["cublas"] = graph_us([lambda d=d, o=o: torch.matmul(x, d, out=o) for _, d, o in pairs], rep=20, repeats=1)
    row["default"], _ = time_fn(
        lambda o: mma.w4a16_gemm(x, w0, out=o, counters=counters[id(w0)]),
        [lambda w=w, o=o: mma.w4a16_gemm(x, w, out=o, counters=counters[id(w)]) for w, _, o in pairs],
        m,
        n,
        ref,
    )
    # the Triton kernel's own dispatch (a config passed keeps w4a16_gemm off the Gluon kernel)
    tcfg = mma.select_config(w0, x.dtype, m)
    row["triton"], _ = time_fn(
        lambda o: mma.w4a16_gemm(x, w0, config=tcfg, out=o, counters=counters[id(w0)]),
        [lambda w=w, o=o: mma.w4a16_gemm(x, w, config=tcfg, out=o, counters=counters[id(w)]) for w, _, o in pairs],
        m,
        n,
        ref,
    )
    row["triton_cfg"] = tcfg.short()
    row["default_cfg"] = (
        glk.default_config(m, k, n, torch.cuda.get_device_properties(0).multi_processor_count).short()
        if mma.uses_gluon(w0, x, m)
        else row["triton_cfg"]
    )
    for cfg in configs(m, candidates):
        try:
            t, err = time_fn(
                lambda o, cfg=cfg: glk.w4a16_wgmma(x, w0, config=cfg, out=o, counters=counters[id(w0)]),
                [
                    lambda w=w, o=o, cfg=cfg: glk.w4a16_wgmma(x, w, config=cfg, out=o, counters=counters[id(w)])
                    for w, _, o in pairs
                ],
                m,
                n,
                ref,
            )
        except Exception as exc:  # noqa: BLE001 - a candidate that fails to build is reported, not fatal
            print(f"{name} M={m} {cfg.short()}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        print(f"{name} M={m} {cfg.short()}: {t} us err {err:.1e}", flush=True)
        if t is not None and ("gluon" not in row or t < row["gluon"]):
            row["gluon"], row["gluon_cfg"], row["gluon_err"] = t, cfg.short(), err
    return row


def run_shape(name: str, ms: list[int], rows: list[dict], deadline: float, candidates: list | None = None) -> None:
    k, n = SHAPES[name]
    copies = []
    for _ in range(GRAPH_LAYERS):
        weight, _codes = make_weight(k, n, GROUP)
        copies.append((mma.prepare(weight), dequantize(weight).half()))  # MMA layout, dense [K, N]
    for m in ms:
        if time.time() > deadline:
            print(f"budget spent before {name} M={m}", flush=True)
            return
        rows.append(bench_m(name, m, k, n, copies, candidates))
        print(rows[-1], flush=True)


def fmt(t, base):
    return "n/a" if t is None else f"{t:.1f} ({base / t:.2f}x)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="gate_up,down,qkv,o")
    ap.add_argument("--ms", default="64,128,256,512,1024,4096")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--candidates",
        default="",
        help="comma list of block_m x block_n x stages x warps x split_k [x scales_ahead [x block_k]] (e.g. "
        "128x64x3x4x1, 128x64x3x4x1x2, 64x128x4x4x1x2x64); default: CANDIDATES",
    )
    args = ap.parse_args()
    candidates = []
    for c in filter(None, args.candidates.split(",")):
        fields = c.split("x")
        if len(fields) not in (5, 6, 7) or not all(f.isdigit() for f in fields):
            ap.error(
                f"--candidates entry {c!r}: expected block_m x block_n x stages x warps x split_k "
                "[x scales_ahead [x block_k]]"
            )
        candidates.append(tuple(int(f) for f in fields))
    candidates = candidates or None
    torch.manual_seed(0)
    deadline = time.time() + args.budget_s
    rows: list[dict] = []
    for name in args.shapes.split(","):
        run_shape(name, [int(v) for v in args.ms.split(",")], rows, deadline, candidates)
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"{props.name}, torch {torch.__version__}, Triton {triton.__version__}; graph-timed, {GRAPH_LAYERS} weight copies; "
        "µs (ratio = cuBLAS fp16 µs / this)",
        "",
        "| layer | M | cuBLAS fp16 µs | default dispatch | default config | Triton table | Gluon best | Gluon config | rel err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['M']} | {r['cublas']:.1f} | {fmt(r.get('default'), r['cublas'])} | {r['default_cfg']} | "
            f"{fmt(r.get('triton'), r['cublas'])} | {fmt(r.get('gluon'), r['cublas'])} | {r.get('gluon_cfg', 'none ran')} | {r.get('gluon_err', float('nan')):.1e} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
