"""Fused elementwise kernel benchmark: RMSNorm, residual add + RMSNorm, rotary, SiLU-and-mul.

Knows: Qwen2.5-14B shapes (hidden 5120, 40 q / 8 kv heads of 128, intermediate 13824), how to
time (``triton.testing.do_bench``, median), and the torch sequences the fused kernels replace
(``quant_kernels.reference_elementwise``, the arithmetic the layers ran before). Must not know:
the engine. Every op it times is first checked against the reference on fresh random data
(NaN-poisoned output buffers, max abs / relative error bound), in the same run.

    PYTHONPATH=. python bench/elementwise.py --out $OUT/elementwise.md

Times per op and token count T: ``graph``: per-call µs of a CUDA graph replaying the op
``GRAPH_CALLS`` times back to back (as a decode step runs: no launch gaps from Python, inputs
warm in L2); ``eager``: ``do_bench`` of one call from Python (L2 flushed, launch overhead and
the gaps between the reference's small kernels included). ``--tiny`` is a CPU smoke run under
``TRITON_INTERPRET=1`` at toy sizes (wall-clock times, meaningless as performance).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # must precede the first @triton.jit definition
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import elementwise_triton, reference_elementwise  # noqa: E402

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE = 5120, 40, 8, 128, 13824
TOKENS = [1, 16, 64, 256, 1024]
MAX_POSITIONS = 32768
EPS = 1e-6
GRAPH_CALLS = 20
# Max |out - ref| / max |ref| allowed per dtype: one or two ulps of the output dtype.
REL_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def bench_us(fn, warmup: int = 10, rep: int = 50) -> float:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def graph_us(fn) -> float:
    """Per-call µs of a CUDA graph running ``fn`` GRAPH_CALLS times back to back. CPU: one call."""
    if DEVICE != "cuda":
        return bench_us(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return statistics.median(bench_us(graph.replay) for _ in range(3)) / GRAPH_CALLS


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.randint(0, 255, (1 << (30 if DEVICE == "cuda" else 20),), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = bench_us(lambda: dst.copy_(src), rep=100)
    return 2 * src.numel() / (t * 1e-6)


def rel_err(outs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...]) -> float:
    """Worst max |out - ref| / max |ref| over the outputs; inf if any output is not finite."""
    worst = 0.0
    for out, ref in zip(outs, refs):
        if not torch.isfinite(out).all():
            return math.inf
        worst = max(worst, ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item())
    return worst


def nan(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def make_cases(t: int, dtype: torch.dtype) -> list[dict]:
    """One dict per op: the fused call (writing into poisoned buffers), the reference call, bytes moved."""
    h, hq, hk, d, inter = HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE
    es = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(t, h, dtype=dtype, device=DEVICE)  # [T, H]
    residual = torch.randn(t, h, dtype=dtype, device=DEVICE) * 4  # [T, H]
    weight = torch.randn(h, dtype=dtype, device=DEVICE)  # [H]
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype, device=DEVICE)  # [T, (Hq + 2 Hk) D]
    query = qkv[:, : hq * d].view(t, hq, d)  # strided views, as the attention layer passes them
    key = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    positions = torch.randint(0, MAX_POSITIONS, (t,), device=DEVICE)  # [T]
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    freqs = torch.outer(torch.arange(MAX_POSITIONS, device=DEVICE, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()  # float32 [max_positions, D / 2]
    gate_up = torch.randn(t, 2 * inter, dtype=dtype, device=DEVICE) * 3  # [T, 2I]
    out_h, res_h = nan((t, h), dtype), nan((t, h), dtype)
    q_out, k_out = nan((t, hq, d), dtype), nan((t, hk, d), dtype)
    silu_out = nan((t, inter), dtype)
    rotary_bytes = 2 * t * (hq + hk) * d * es + 2 * t * (d // 2) * 4 + t * 8
    return [
        {
            "op": "rms_norm",
            "fused": lambda: (elementwise_triton.rms_norm(x, weight, EPS, out=out_h),),
            "ref": lambda: (reference_elementwise.rms_norm(x, weight, EPS),),
            "bytes": (2 * t * h + h) * es,
        },
        {
            "op": "fused_add_rms_norm",
            "fused": lambda: elementwise_triton.fused_add_rms_norm(
                x, residual, weight, EPS, out=out_h, residual_out=res_h
            ),
            "ref": lambda: reference_elementwise.fused_add_rms_norm(x, residual, weight, EPS),
            "bytes": (4 * t * h + h) * es,
        },
        {
            "op": "rotary_embedding",
            "fused": lambda: elementwise_triton.rotary_embedding(positions, query, key, cos, sin, q_out, k_out),
            "ref": lambda: reference_elementwise.rotary_embedding(positions, query, key, cos, sin),
            "bytes": rotary_bytes,
        },
        {
            "op": "silu_and_mul",
            "fused": lambda: (elementwise_triton.silu_and_mul(gate_up, out=silu_out),),
            "ref": lambda: (reference_elementwise.silu_and_mul(gate_up),),
            "bytes": 3 * t * inter * es,
        },
    ]


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)"


def write_report(path: str, dtype: torch.dtype, bw: float, rows: list[dict]) -> None:
    lines = [
        f"# Fused elementwise ops, Qwen2.5-14B shapes (hidden {HIDDEN}, {NUM_HEADS} q / {NUM_KV_HEADS} kv heads "
        f"of {HEAD_DIM}, intermediate {INTERMEDIATE}), {str(dtype).replace('torch.', '')}",
        "",
        f"{device_name()}, torch {torch.__version__}; measured copy bandwidth {bw / 1e9:.0f} GB/s. Times: median "
        f"µs. `graph`: per call, CUDA graph of {GRAPH_CALLS} back-to-back calls (decode-step conditions); "
        "`eager`: `do_bench` of one call from Python (L2 flushed; launch overhead and inter-kernel gaps "
        "included). `ref`: the torch sequence the kernel replaces (`quant_kernels.reference_elementwise`). "
        "GB/s: bytes the op must move / fused graph time. err: max |fused - ref| / max |ref|.",
        "",
        "| op | T | fused graph µs | ref graph µs | x graph | fused eager µs | ref eager µs | x eager | GB/s "
        "| % copy BW | err | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['t']} | {r['fused_graph_us']:.2f} | {r['ref_graph_us']:.2f} | "
            f"{r['ref_graph_us'] / r['fused_graph_us']:.1f} | {r['fused_eager_us']:.2f} | {r['ref_eager_us']:.2f} | "
            f"{r['ref_eager_us'] / r['fused_eager_us']:.1f} | {r['gbps']:.0f} | {r['pct_bw']:.1f}% | "
            f"{r['err']:.1e} | {'yes' if r['ok'] else '**NO**'} |"
        )
    per_layer = {}  # one decoder layer runs 2 x fused_add_rms_norm, 1 x rotary, 1 x silu_and_mul
    for r in rows:
        if r["op"] != "rms_norm":
            k = 2 if r["op"] == "fused_add_rms_norm" else 1
            f, g = per_layer.get(r["t"], (0.0, 0.0))
            per_layer[r["t"]] = (f + k * r["fused_graph_us"], g + k * r["ref_graph_us"])
    lines += ["", "Per decoder layer (2 x add+norm, rotary, silu_and_mul), graph µs:", ""]
    lines += ["| T | fused | ref | saved per layer |", "|---|---|---|---|"]
    for t, (f, g) in per_layer.items():
        lines.append(f"| {t} | {f:.1f} | {g:.1f} | {g - f:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    with open(os.path.splitext(path)[0] + "_raw.json", "w") as f:
        json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "elementwise.md"))
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--tiny", action="store_true", help="smoke run at toy sizes (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, MAX_POSITIONS
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.tiny:
        HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, MAX_POSITIONS = 200, 4, 2, 16, 300, 64
        tokens = [1, 3]
    if DEVICE == "cpu":  # Triton 3.6's interpreter vs NumPy >= 2.4 (see tests/conftest.py)
        from tests.conftest import _fix_interpreter_index

        _fix_interpreter_index()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, {device_name()}", flush=True)
    rows = []
    for t in tokens:
        for case in make_cases(t, dtype):
            err = rel_err(case["fused"](), case["ref"]())  # fused outputs are the poisoned buffers
            fused_graph = graph_us(case["fused"])
            ref_graph = graph_us(case["ref"])
            row = {
                "op": case["op"],
                "t": t,
                "fused_graph_us": fused_graph,
                "ref_graph_us": ref_graph,
                "fused_eager_us": bench_us(case["fused"]),
                "ref_eager_us": bench_us(case["ref"]),
                "gbps": case["bytes"] / (fused_graph * 1e-6) / 1e9,
                "pct_bw": case["bytes"] / (fused_graph * 1e-6) / bw * 100,
                "err": err,
                "ok": err <= REL_TOL[dtype],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_report(args.out, dtype, bw, rows)
    if not all(r["ok"] for r in rows):
        sys.exit("some fused op disagrees with the reference (see the `ok` column)")


if __name__ == "__main__":
    main()
