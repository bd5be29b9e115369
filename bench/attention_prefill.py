"""Prefill attention over the paged cache (issue 25): the Triton prefill kernel vs torch SDPA's flash
backend and the measured tensor-core peak, in one run.

Knows: Qwen2.5-14B attention heads (40 q / 8 kv, head_dim 128), the step shapes that matter (one
long prompt, an extend over a cached prefix, a few short prompts, short prompts next to a full
batch of decodes: the mixed step), how to time (``triton.testing.do_bench`` median of a CUDA-graph
replay, L2 flushed). Must not know: the engine. Every timed configuration is first checked
against the fp32 reference on the same data (NaN-poisoned output, relative error bound).

    PYTHONPATH=. python bench/attention_prefill.py --out $OUT/attention_prefill.md [--sweep]
        [--legacy-module path/to/old/attention_triton.py]

``--legacy-module`` times another copy of ``quant_kernels/attention_triton.py`` (e.g. the one
before a change, ``git show REV:quant_kernels/attention_triton.py > /tmp/old.py``) on the same
inputs: a before/after in one run. ``--sweep`` times the prefill tile configurations too.

TFLOP/s count the causal work of the new tokens only: ``4 * H * D`` per visible (query, key) pair.
The mixed step also runs the decode kernel for its decode rows; its row reports the decode-only
time of the same decodes beside it, so the prefill share is the difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention import graph_of  # noqa: E402 - the same capture as the decode benchmark
from quant_kernels import reference, reference_kv_quant  # noqa: E402
from quant_kernels.attention_triton import AttentionConfig, paged_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 40, 8, 128, 16
REL_TOL = 1e-2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --tiny under TRITON_INTERPRET=1


@dataclass(frozen=True)
class Shape:
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def prefill_pairs(self) -> int:
        """Visible (query, key) pairs of the sequences with more than one new token."""
        return sum(sum(s - q + i + 1 for i in range(q)) for q, s in zip(self.query_lens, self.seq_lens) if q > 1)

    @property
    def decode_only(self) -> Shape | None:
        rows = [(q, s) for q, s in zip(self.query_lens, self.seq_lens) if q == 1]
        if not rows or len(rows) == len(self.query_lens):
            return None
        return Shape(self.name + " (decodes alone)", tuple(q for q, _ in rows), tuple(s for _, s in rows))


SHAPES = [
    Shape("1 prompt x 4096", (4096,), (4096,)),
    Shape("extend 512 over 3584 cached", (512,), (4096,)),
    Shape("4 prompts x 224", (224,) * 4, (224,) * 4),
    Shape("16 prompts x 128", (128,) * 16, (128,) * 16),
    Shape("mixed: 4 x 224 + 128 decodes at 1024", (224,) * 4 + (1,) * 128, (224,) * 4 + (1024,) * 128),
]
TINY = [
    Shape("1 prompt x 40", (40,), (40,)),
    Shape("mixed: 2 x 9 + 3 decodes", (9, 1, 9, 1, 1), (9, 30, 20, 17, 5)),
]


def bench_us(fn) -> float:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def measured_peak_tflops() -> float:
    """fp16 tensor-core TFLOP/s of one large cuBLAS GEMM in this run (the same-run peak)."""
    if DEVICE != "cuda":
        return math.nan
    n = 8192
    a = torch.randn(n, n, dtype=torch.float16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.float16, device=DEVICE)
    t = do_bench(lambda: a @ b, warmup=10, rep=100, return_mode="median") * 1e-3
    return 2 * n**3 / t / 1e12


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("legacy_attention_triton", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton's JIT reads the source through the module
    spec.loader.exec_module(module)
    return module


def make_inputs(shape: Shape, kc: torch.Tensor, gen: torch.Generator):
    num_blocks = kc.shape[0]
    per_seq = [-(-s // BLOCK_SIZE) for s in shape.seq_lens]
    ids = torch.randperm(num_blocks, generator=gen)[: sum(per_seq)]
    tables = torch.zeros(len(per_seq), max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):  # scattered pages, as in a running server
        tables[i, :n] = ids[used : used + n]
        used += n
    qsl = torch.zeros(len(per_seq) + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor(shape.query_lens).cumsum(0)
    query = torch.randn(int(qsl[-1]), NUM_HEADS, HEAD_DIM, generator=gen).to(torch.float16)  # [T, H, D]
    seq_lens = torch.tensor(shape.seq_lens, dtype=torch.int64)
    return tuple(t.to(DEVICE) for t in (query, tables, seq_lens, qsl))


def sdpa_baseline(shape: Shape, query, kc, vc, tables, scale: float) -> float | None:
    """torch SDPA (flash backend) over the same K/V made contiguous: equal-length prompts only
    (top-left causal; an extend uses the lower-right causal bias)."""
    if DEVICE != "cuda" or len(set(shape.query_lens)) != 1 or 1 in shape.query_lens:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, q_len, ctx = len(shape.query_lens), shape.query_lens[0], shape.seq_lens[0]
    if len(set(shape.seq_lens)) != 1:
        return None
    k = kc[tables.long()].reshape(b, -1, NUM_KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
    v = vc[tables.long()].reshape(b, -1, NUM_KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
    q = query.view(b, q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()  # [B, H, T, D]
    if q_len == ctx:
        mask, causal = None, True
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask, causal = causal_lower_right(q_len, ctx), False

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )

    try:
        run()
        return bench_us(run)
    except Exception as exc:  # noqa: BLE001 - reported as n/a
        print(f"  SDPA failed on {shape.name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None


def sweep_configs() -> list[AttentionConfig]:
    grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    configs = [
        AttentionConfig(prefill_block_m=bm, prefill_block_n=bn, prefill_num_warps=w, prefill_num_stages=st)
        for bm, bn, w, st in grid
    ]
    return configs


def describe(cfg: AttentionConfig) -> str:
    return (
        f"m{cfg.prefill_block_m or 'auto'} n{cfg.prefill_block_n or 'auto'} w{cfg.prefill_num_warps or 'auto'} "
        f"st{cfg.prefill_num_stages or 'auto'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_prefill.md")
    ap.add_argument("--sweep", action="store_true", help="also time the prefill tile configurations")
    ap.add_argument("--legacy-module", help="another copy of attention_triton.py, timed on the same inputs")
    ap.add_argument("--tiny", action="store_true", help="smoke run at tiny sizes (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if DEVICE == "cpu":
        from tests.conftest import _fix_interpreter_index

        _fix_interpreter_index()
    shapes = TINY if args.tiny else SHAPES
    gen = torch.Generator().manual_seed(0)
    peak = measured_peak_tflops()
    legacy = load_module(args.legacy_module) if args.legacy_module else None
    print(f"{device_name()}: measured fp16 GEMM peak {peak:.0f} TFLOP/s", flush=True)

    max_tokens = max(sum(s.seq_lens) for s in shapes)
    num_blocks = max_tokens // BLOCK_SIZE + 2 * len(shapes[-1].seq_lens) + 64
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kc = torch.randn(cache_shape, generator=gen).to(torch.float16).to(DEVICE)  # [num_blocks, bs, Hkv, D]
    vc = torch.randn(cache_shape, generator=gen).to(torch.float16).to(DEVICE)
    fp8 = torch.float8_e4m3fn
    ks, vs = reference_kv_quant.compute_kv_scale(kc, fp8), reference_kv_quant.compute_kv_scale(vc, fp8)
    kc8, vc8 = reference_kv_quant.quantize_kv(kc, ks, fp8), reference_kv_quant.quantize_kv(vc, vs, fp8)
    rows, sweep_log = [], []
    for shape in shapes:
        rows.append(bench_shape(shape, kc, vc, kc8, vc8, ks, vs, gen, legacy, args.sweep, sweep_log))
    write_report(args.out, peak, rows, sweep_log)


def bench_shape(shape: Shape, kc, vc, kc8, vc8, ks, vs, gen, legacy, sweep: bool, sweep_log: list) -> dict:
    """Time one step shape: the default launch, the legacy module, fp8 KV, SDPA, decodes alone, the sweep."""
    scale = HEAD_DIM**-0.5
    default = AttentionConfig()
    query, tables, seq_lens, qsl = make_inputs(shape, kc, gen)
    qmax, smax = max(shape.query_lens), max(shape.seq_lens)
    ref = reference.paged_attention(query, kc, vc, tables, seq_lens, qsl, qmax, smax, scale).float()

    def timed(fn, label: str, ref=ref) -> float:
        out = torch.full_like(query, float("nan"))
        run = graph_of(lambda: fn(out))
        out.fill_(float("nan"))
        run()
        err = rel_err(out, ref)
        if err > REL_TOL:
            print(f"  WRONG {shape.name} {label}: rel err {err:.2e}", flush=True)
            return math.nan
        return bench_us(run)

    common = (query, kc, vc, tables, seq_lens, qsl, qmax, smax, scale)
    row = {"shape": shape.name, "pairs": shape.prefill_pairs}
    row["us"] = timed(lambda out: paged_attention(*common, out=out, config=default), "default")
    if legacy is not None:
        row["legacy_us"] = timed(lambda out: legacy.paged_attention(*common, out=out), "legacy")
    ref8 = reference.paged_attention(
        query,
        reference_kv_quant.dequantize_kv(kc8, ks),
        reference_kv_quant.dequantize_kv(vc8, vs),
        tables,
        seq_lens,
        qsl,
        qmax,
        smax,
        scale,
    ).float()
    args8 = (query, kc8, vc8, tables, seq_lens, qsl, qmax, smax, scale, None, ks, vs)
    row["fp8_us"] = timed(lambda out: paged_attention(*args8, out=out), "fp8", ref=ref8)
    if legacy is not None:
        row["fp8_legacy_us"] = timed(lambda out: legacy.paged_attention(*args8, out=out), "fp8 legacy", ref=ref8)
    row["sdpa_us"] = sdpa_baseline(shape, query, kc, vc, tables, scale)
    alone = shape.decode_only
    if alone is not None:  # the same decodes on their own: the prefill share is the difference
        d_rows = [i for i, q in enumerate(shape.query_lens) if q == 1]
        starts = qsl[:-1][d_rows]
        dq, dt, ds = query[starts], tables[d_rows], seq_lens[d_rows]
        dqsl = torch.arange(len(d_rows) + 1, device=DEVICE)
        dref = reference.paged_attention(dq, kc, vc, dt, ds, dqsl, 1, smax, scale).float()
        d_out = torch.full_like(dq, float("nan"))
        run = graph_of(lambda: paged_attention(dq, kc, vc, dt, ds, dqsl, 1, smax, scale, out=d_out))
        run()
        row["decode_alone_us"] = bench_us(run) if rel_err(d_out, dref) < REL_TOL else math.nan
    if sweep:
        best = (row["us"], describe(default))
        for cfg in sweep_configs():
            t = timed(lambda out, cfg=cfg: paged_attention(*common, out=out, config=cfg), describe(cfg))
            sweep_log.append({"shape": shape.name, "cfg": describe(cfg), "us": t})
            if t < best[0]:
                best = (t, describe(cfg))
        row["best_us"], row["best_cfg"] = best
    tf = lambda us: 4 * shape.prefill_pairs * NUM_HEADS * HEAD_DIM / (us * 1e-6) / 1e12  # noqa: E731
    print(
        f"{shape.name}: {row['us']:.1f} us ({tf(row['us']):.0f} TFLOP/s)"
        + (f" legacy {row['legacy_us']:.1f} us" if "legacy_us" in row else "")
        + f" fp8 {row['fp8_us']:.1f} us"
        + (f" sdpa {row['sdpa_us']:.1f} us" if row["sdpa_us"] else "")
        + (f" decodes alone {row['decode_alone_us']:.1f} us" if "decode_alone_us" in row else "")
        + (f" best {row['best_us']:.1f} us ({row['best_cfg']})" if "best_us" in row else ""),
        flush=True,
    )
    return row


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)"


def write_report(path: str, peak: float, rows: list[dict], sweep: list[dict]) -> None:
    def tflops(r: dict, key: str) -> str:
        us = r.get(key)
        if us is None or not math.isfinite(us):
            return "—"
        share = us - r.get("decode_alone_us", 0.0) if key != "sdpa_us" else us
        return f"{4 * r['pairs'] * NUM_HEADS * HEAD_DIM / (max(share, 1e-3) * 1e-6) / 1e12:.0f}"

    def us(r: dict, key: str) -> str:
        v = r.get(key)
        return "—" if v is None or not math.isfinite(v) else f"{v:.1f}"

    lines = [
        f"# Prefill attention, Qwen2.5-14B heads ({NUM_HEADS} q / {NUM_KV_HEADS} kv, head_dim {HEAD_DIM}), "
        f"block size {BLOCK_SIZE}, fp16",
        "",
        f"{device_name()}, torch {torch.__version__}; measured fp16 GEMM peak (cuBLAS 8192^3) {peak:.0f} TFLOP/s. "
        "µs: median of a CUDA-graph replay (`do_bench`, L2 flushed). TFLOP/s: causal work of the new tokens "
        "over (time − the decodes-alone time). `legacy`: the module given by --legacy-module on the same inputs. "
        "SDPA: torch's flash backend over the same K/V made contiguous (equal-length prompts only).",
        "",
        "| step | µs | TFLOP/s | legacy µs | legacy TFLOP/s | fp8 KV µs | fp8 legacy µs | SDPA flash µs "
        "| SDPA TFLOP/s | decodes alone µs | best µs (cfg) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = f"{r['best_us']:.1f} ({r['best_cfg']})" if "best_us" in r else "—"
        lines.append(
            f"| {r['shape']} | {us(r, 'us')} | {tflops(r, 'us')} | {us(r, 'legacy_us')} | {tflops(r, 'legacy_us')} "
            f"| {us(r, 'fp8_us')} | {us(r, 'fp8_legacy_us')} | {us(r, 'sdpa_us')} | {tflops(r, 'sdpa_us')} "
            f"| {us(r, 'decode_alone_us')} | {best} |"
        )
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    with open(os.path.splitext(path)[0] + "_raw.json", "w") as f:
        json.dump({"peak_tflops": peak, "rows": rows, "sweep": sweep}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
