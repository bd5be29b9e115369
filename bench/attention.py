"""Paged decode-attention benchmark (issue 5): Triton split-KV decode vs the bandwidth floor.

Knows: Qwen2.5-14B attention heads (40 q / 8 kv, head_dim 128), how to time
(``triton.testing.do_bench``, median, L2 flushed between runs), the floor (bytes of K/V one
decode step must read / copy bandwidth measured in this run). Must not know: the engine. Every
configuration it times is first checked against the reference on fresh random data (poisoned
output, relative error bound), in the same run. Also times torch SDPA over a contiguous
(unpaged) fp16 KV as a same-run baseline, and two prefill shapes.

    PYTHONPATH=. python bench/attention.py --out $OUT/attention.md

Pages: block size 16, block ids drawn at random from one pool sized for the largest case, so
each sequence's pages are scattered as in a running server.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import reference, reference_kv_quant  # noqa: E402
from quant_kernels.attention_triton import (  # noqa: E402
    AttentionConfig,
    _num_sms,
    choose_num_splits,
    paged_attention,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 40, 8, 128, 16
BATCHES = [1, 8, 32, 128]
CONTEXTS = [1024, 4096]
REL_TOL = 1e-2  # fp16 output vs the fp32 reference: measured ~5e-4


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a --tiny smoke run under TRITON_INTERPRET=1


def bench_us(fn, warmup: int = 5, rep: int = 25) -> float:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.randint(0, 255, (1 << (30 if DEVICE == "cuda" else 20),), dtype=torch.uint8, device=DEVICE)  # [1 GiB]
    dst = torch.empty_like(src)
    t = bench_us(lambda: dst.copy_(src), rep=100)
    return 2 * src.numel() / (t * 1e-6)


def graph_of(fn):
    """``fn`` captured in a CUDA graph (as decode runs in the engine); returns its replay. CPU: ``fn``."""
    if DEVICE != "cuda":
        return fn
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention.md")
    ap.add_argument("--no-sweep", action="store_true", help="time the default configuration only")
    ap.add_argument("--tiny", action="store_true", help="smoke run at tiny sizes (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global BATCHES, CONTEXTS
    if args.tiny:
        BATCHES, CONTEXTS = [1, 2], [64, 160]
    if DEVICE == "cpu":  # Triton 3.6's interpreter vs NumPy >= 2.4 (see tests/conftest.py)
        from tests.conftest import _fix_interpreter_index

        _fix_interpreter_index()
    torch.manual_seed(0)
    t_start = time.time()
    bw = copy_bandwidth()
    num_sms = _num_sms(torch.device(DEVICE))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, {num_sms} SMs, {device_name()}", flush=True)

    max_tokens = max(BATCHES) * max(CONTEXTS)
    num_blocks = max_tokens // BLOCK_SIZE + 64
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kc16 = torch.randn(shape, dtype=torch.float16, device=DEVICE)  # [num_blocks, bs, Hkv, D]
    vc16 = torch.randn(shape, dtype=torch.float16, device=DEVICE)
    fp8 = torch.float8_e4m3fn
    k_scale = reference_kv_quant.compute_kv_scale(kc16, fp8)
    v_scale = reference_kv_quant.compute_kv_scale(vc16, fp8)
    caches = {
        "fp16": (kc16, vc16, None, None),
        "fp8": (
            reference_kv_quant.quantize_kv(kc16, k_scale, fp8),
            reference_kv_quant.quantize_kv(vc16, v_scale, fp8),
            k_scale,
            v_scale,
        ),
    }
    scale = HEAD_DIM**-0.5
    rows: list[dict] = []
    sweep_log: list[dict] = []
    for cache_name, (kc, vc, ks, vs) in caches.items():
        deq = None
        if cache_name == "fp8":  # the quantized reference: dequantize once, then reference.paged_attention
            deq = (reference_kv_quant.dequantize_kv(kc, ks), reference_kv_quant.dequantize_kv(vc, vs))
        for batch in BATCHES:
            for ctx in CONTEXTS:
                blocks_per_seq = ctx // BLOCK_SIZE
                perm = torch.randperm(num_blocks, device=DEVICE)[: batch * blocks_per_seq]
                tables = perm.view(batch, blocks_per_seq).to(torch.int32)  # [B, ctx / bs]
                seq_lens = torch.full((batch,), ctx, dtype=torch.int64, device=DEVICE)  # [B]
                qsl = torch.arange(batch + 1, dtype=torch.int64, device=DEVICE)  # [B + 1]
                query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)  # [B, H, D]
                ref_kc, ref_vc = deq if deq is not None else (kc, vc)
                ref = reference.paged_attention(query, ref_kc, ref_vc, tables, seq_lens, qsl, 1, ctx, scale).float()
                auto = choose_num_splits(batch, NUM_KV_HEADS, ctx, num_sms, AttentionConfig().min_split_tokens)
                default_bn = 64 if cache_name == "fp16" else 128
                variants = [(None, auto, True)]  # (BLOCK_N, splits, packed fp8 reads)
                if not args.no_sweep:
                    variants += [(bn, auto, True) for bn in (32, 64, 128) if bn != default_bn]
                    variants += [(None, s, True) for s in sorted({1, 2 * auto, max(1, auto // 2)}) if s != auto]
                    if cache_name == "fp8":
                        variants.append((None, auto, False))
                timed = []
                call = functools.partial(
                    paged_attention, query, kc, vc, tables, seq_lens, qsl, 1, ctx, scale, None, ks, vs
                )
                t_eager = math.nan
                for block_n, splits, packed in variants:
                    cfg = AttentionConfig(decode_block_n=block_n, decode_packed=packed)
                    out = torch.full_like(query, float("nan"))  # poisoned; the graph writes here
                    run = functools.partial(call, out=out, num_splits=splits, config=cfg)
                    name = f"bn={block_n or default_bn},splits={splits}" + ("" if packed else ",bytes")
                    run()
                    err = rel_err(out, ref)
                    replay = graph_of(run)
                    out.fill_(float("nan"))
                    replay()
                    err = max(err, rel_err(out, ref))
                    if err > REL_TOL:
                        print(f"  WRONG {cache_name} B={batch} ctx={ctx} {name}: rel err {err:.2e}", flush=True)
                        sweep_log.append({"cache": cache_name, "batch": batch, "ctx": ctx, "cfg": name, "err": err})
                        continue
                    t = bench_us(replay)
                    if not timed:
                        t_eager = bench_us(run)
                    timed.append((t, name, err))
                    sweep_log.append(
                        {"cache": cache_name, "batch": batch, "ctx": ctx, "cfg": name, "us": t, "err": err}
                    )
                    del replay
                assert timed and timed[0][1].startswith(f"bn={default_bn},splits={auto}"), "default config failed"
                t_def, name_def, err_def = timed[0]
                t_best, name_best, _ = min(timed)
                kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * kc.element_size()
                io_bytes = kv_bytes + 2 * query.numel() * 2 + tables.numel() * 4
                t_sdpa = None
                if cache_name == "fp16":  # same bytes, contiguous KV, torch's fused SDPA
                    kd = ref_kc[tables.long()].reshape(batch, ctx, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
                    vd = ref_vc[tables.long()].reshape(batch, ctx, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
                    qd = query.unsqueeze(2)  # [B, H, 1, D]
                    try:
                        sdpa = lambda qd=qd, kd=kd, vd=vd: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                            qd, kd, vd, scale=scale, enable_gqa=True
                        )
                        err_sdpa = rel_err(sdpa().squeeze(2), ref)
                        if err_sdpa < REL_TOL:
                            t_sdpa = bench_us(graph_of(sdpa))
                        else:
                            print(f"  SDPA wrong: {err_sdpa:.2e}", flush=True)
                    except Exception as exc:  # noqa: BLE001 - reported as n/a
                        print(f"  SDPA failed: {type(exc).__name__}: {exc}", flush=True)
                    del kd, vd
                row = {
                    "cache": cache_name,
                    "batch": batch,
                    "ctx": ctx,
                    "splits": auto,
                    "us": t_def,
                    "eager_us": t_eager,
                    "kv_mb": kv_bytes / 1e6,
                    "gbps": io_bytes / (t_def * 1e-6) / 1e9,
                    "pct_bw": io_bytes / (t_def * 1e-6) / bw * 100,
                    "floor_us": io_bytes / bw * 1e6,
                    "best_us": t_best,
                    "best_cfg": name_best,
                    "sdpa_us": t_sdpa,
                    "err": err_def,
                }
                rows.append(row)
                print(
                    f"{cache_name} B={batch:4d} ctx={ctx:5d} splits={auto:2d} {t_def:8.1f} us (eager {t_eager:.1f}) "
                    f"{row['gbps']:6.0f} GB/s ({row['pct_bw']:4.1f}% copy BW) best {t_best:8.1f} ({name_best}) "
                    f"sdpa {t_sdpa if t_sdpa is None else round(t_sdpa, 1)} err {err_def:.1e} "
                    f"[{time.time() - t_start:.0f}s]",
                    flush=True,
                )
        del deq

    prefill_rows = bench_prefill(caches, scale, 64 if args.tiny else 4096, 16 if args.tiny else 512)
    write_report(args.out, bw, num_sms, rows, prefill_rows, sweep_log)


def bench_prefill(caches: dict, scale: float, ctx_len: int, extend_len: int) -> list[dict]:
    """Prefill of one ``ctx_len``-token prompt (4096), and an ``extend_len``-token (512) extend over a
    cached prefix of the rest."""
    out_rows = []
    for cache_name, (kc, vc, ks, vs) in caches.items():
        deq = (
            None if ks is None else (reference_kv_quant.dequantize_kv(kc, ks), reference_kv_quant.dequantize_kv(vc, vs))
        )
        for q_len, ctx in ((ctx_len, ctx_len), (extend_len, ctx_len)):
            tables = torch.randperm(kc.shape[0], device=DEVICE)[: ctx // BLOCK_SIZE].view(1, -1).to(torch.int32)
            seq_lens = torch.tensor([ctx], device=DEVICE)
            qsl = torch.tensor([0, q_len], device=DEVICE)
            query = torch.randn(q_len, NUM_HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)  # [T, H, D]
            ref_kc, ref_vc = deq if deq is not None else (kc, vc)
            ref = reference.paged_attention(query, ref_kc, ref_vc, tables, seq_lens, qsl, q_len, ctx, scale).float()
            run = functools.partial(
                paged_attention, query, kc, vc, tables, seq_lens, qsl, q_len, ctx, scale, None, ks, vs
            )
            out = torch.full_like(query, float("nan"))
            run(out=out)
            err = rel_err(out, ref)
            t = bench_us(run) if err < REL_TOL else math.nan
            # causal FLOPs: QK^T and PV over the visible keys of each new token
            visible = sum(ctx - q_len + i + 1 for i in range(q_len))
            tflops = 4 * visible * NUM_HEADS * HEAD_DIM / (t * 1e-6) / 1e12
            out_rows.append({"cache": cache_name, "q_len": q_len, "ctx": ctx, "us": t, "tflops": tflops, "err": err})
            print(
                f"prefill {cache_name} q={q_len} ctx={ctx}: {t:.1f} us {tflops:.0f} TFLOP/s err {err:.1e}", flush=True
            )
    return out_rows


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)"


def write_report(path: str, bw: float, num_sms: int, rows: list[dict], prefill: list[dict], sweep: list[dict]) -> None:
    lines = [
        f"# Paged decode attention, Qwen2.5-14B heads ({NUM_HEADS} q / {NUM_KV_HEADS} kv, head_dim {HEAD_DIM}), "
        f"block size {BLOCK_SIZE}",
        "",
        f"{device_name()} ({num_sms} SMs), torch {torch.__version__}; measured copy bandwidth "
        f"{bw / 1e9:.0f} GB/s (1 GiB device copy, read + write). Times: median µs, `triton.testing.do_bench` "
        "(L2 flushed before each run) of a CUDA-graph replay of the launch (decode runs under CUDA graphs); "
        "`eager`: the same launch from Python, launch overhead included. GB/s = (K/V bytes + q + out + block "
        "table) / graph time. `splits`: the default split-KV count; `best` the fastest of the swept variants "
        "(BLOCK_N 32/64/128, splits x2, /2, 1; fp8 also byte-wise reads, `bytes`). SDPA: torch "
        "`scaled_dot_product_attention` (graph replay) over the same K/V laid out contiguously (fp16, enable_gqa).",
        "",
        "| cache | batch | ctx | splits | µs | eager µs | KV MB | GB/s | % copy BW | floor µs | best µs (cfg) "
        "| SDPA contiguous µs | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sdpa = "—" if r["sdpa_us"] is None else f"{r['sdpa_us']:.1f}"
        lines.append(
            f"| {r['cache']} | {r['batch']} | {r['ctx']} | {r['splits']} | {r['us']:.1f} | {r['eager_us']:.1f} | "
            f"{r['kv_mb']:.1f} | "
            f"{r['gbps']:.0f} | {r['pct_bw']:.1f}% | {r['floor_us']:.1f} | {r['best_us']:.1f} ({r['best_cfg']}) | "
            f"{sdpa} | {r['err']:.1e} |"
        )
    lines += [
        "",
        "Prefill (one sequence, causal, 40 / 8 heads):",
        "",
        "| cache | new tokens | context | µs | TFLOP/s | rel err |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for r in prefill:
        lines.append(
            f"| {r['cache']} | {r['q_len']} | {r['ctx']} | {r['us']:.1f} | {r['tflops']:.0f} | {r['err']:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    with open(os.path.splitext(path)[0] + "_raw.json", "w") as f:
        json.dump({"copy_bw": bw, "rows": rows, "prefill": prefill, "sweep": sweep}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
