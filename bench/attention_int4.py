"""Paged decode attention over an int4 KV cache vs fp16 and fp8 caches of the same context (issue 15).

Knows: the attention heads to measure (Qwen-14B v1: 40 q / 40 kv; Qwen2.5-14B: 40 / 8; head_dim 128),
how to time (``triton.testing.do_bench`` median of a CUDA-graph replay, as decode runs in the engine),
and the floor (bytes of K/V one decode step reads / copy bandwidth measured in this run). Must not
know: the engine. Every timed launch is first checked against its reference on fresh random data
(poisoned output, relative error bound); the int4 store kernel is timed too.

    PYTHONPATH=. python bench/attention_int4.py --out $OUT/attention_int4.md   # on the GPU
    PYTHONPATH=. python bench/attention_int4.py --tiny                          # CPU smoke (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

if __name__ == "__main__" and "--tiny" in sys.argv and not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import attention_int4_triton, attention_triton, reference_kv_int4, reference_kv_quant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = {"qwen14b-v1 40/40": (40, 40), "qwen2.5-14b 40/8": (40, 8)}
HEAD_DIM, BLOCK_SIZE = 128, 16
REL_TOL = 1e-2  # fp16 kernels vs the fp32 reference over the same cache


def bench_us(fn) -> float:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def graph_of(fn):
    """``fn`` as a CUDA-graph replay (CPU: ``fn``)."""
    if DEVICE != "cuda":
        return fn
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def copy_bandwidth() -> float:
    src = torch.empty(1 << (30 if DEVICE == "cuda" else 20), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench_us(lambda: dst.copy_(src)) * 1e-6)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_int4.md")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    batches, contexts = ([1, 32, 128], [448, 1024, 4096]) if not args.tiny else ([1, 2], [48])
    heads = HEADS if not args.tiny else {"tiny 4/4": (4, 4)}
    if DEVICE == "cpu":
        from tests.conftest import _fix_interpreter_index

        _fix_interpreter_index()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    lines = [
        f"# int4 KV decode attention, {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, "
        f"copy bandwidth {bw / 1e9:.0f} GB/s, head_dim {HEAD_DIM}, block {BLOCK_SIZE}",
        "",
        "| heads | batch | ctx | cache | µs | KV MB | GB/s | % copy BW | vs fp16 | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fp8 = torch.float8_e4m3fn
    for name, (num_heads, num_kv_heads) in heads.items():
        max_tokens = max(batches) * max(contexts)
        num_blocks = max_tokens // BLOCK_SIZE + 8
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        kc16 = torch.randn(shape, dtype=torch.float16, device=DEVICE)  # [blocks, bs, Hkv, D]
        vc16 = torch.randn(shape, dtype=torch.float16, device=DEVICE)
        ks, vs = reference_kv_quant.compute_kv_scale(kc16, fp8), reference_kv_quant.compute_kv_scale(vc16, fp8)
        caches = {
            "fp16": (kc16, vc16, None, None),
            "fp8": (
                reference_kv_quant.quantize_kv(kc16, ks, fp8),
                reference_kv_quant.quantize_kv(vc16, vs, fp8),
                ks,
                vs,
            ),
            "int4": (reference_kv_int4.quantize_int4(kc16), reference_kv_int4.quantize_int4(vc16), None, None),
        }
        for batch in batches:
            for ctx in contexts:
                blocks_per_seq = -(-ctx // BLOCK_SIZE)
                perm = torch.randperm(num_blocks, device=DEVICE)[: batch * blocks_per_seq]
                tables = perm.view(batch, blocks_per_seq).to(torch.int32)  # [B, blocks]
                seq_lens = torch.full((batch,), ctx, dtype=torch.int64, device=DEVICE)
                qsl = torch.arange(batch + 1, dtype=torch.int64, device=DEVICE)
                query = torch.randn(batch, num_heads, HEAD_DIM, dtype=torch.float16, device=DEVICE)
                common = (tables, seq_lens, qsl, 1, ctx, HEAD_DIM**-0.5)
                fp16_us = None
                for cache, (kc, vc, k_scale, v_scale) in caches.items():
                    out = torch.full_like(query, float("nan"))  # poisoned
                    if cache == "int4":
                        ref = reference_kv_int4.paged_attention(query, kc, vc, *common)

                        def launch(kc=kc, vc=vc, out=out, query=query, common=common):
                            attention_int4_triton.paged_attention(query, kc, vc, *common, out=out)

                        kv_bytes = attention_int4_triton.decode_kv_bytes(batch, ctx, num_kv_heads, HEAD_DIM)
                    else:
                        ref = reference_kv_quant.paged_attention(query, kc, vc, *common, None, k_scale, v_scale)

                        def launch(kc=kc, vc=vc, k_scale=k_scale, v_scale=v_scale, out=out, query=query, common=common):
                            attention_triton.paged_attention(query, kc, vc, *common, None, k_scale, v_scale, out=out)

                        kv_bytes = attention_triton.decode_kv_bytes(batch, ctx, num_kv_heads, HEAD_DIM, kc.dtype)
                    launch()
                    err = rel_err(out, ref)
                    if err > REL_TOL:
                        raise SystemExit(f"{name} b{batch} ctx{ctx} {cache}: relative error {err:.2e} > {REL_TOL}")
                    us = bench_us(graph_of(launch))
                    fp16_us = us if cache == "fp16" else fp16_us
                    gbs = kv_bytes / (us * 1e-6) / 1e9
                    lines.append(
                        f"| {name} | {batch} | {ctx} | {cache} | {us:.1f} | {kv_bytes / 1e6:.1f} | {gbs:.0f} | "
                        f"{100 * gbs * 1e9 / bw:.0f}% | {fp16_us / us:.2f}x | {err:.1e} |"
                    )
                    print(lines[-1], flush=True)
        # the int4 store kernel for one decode step's new tokens and one 2,048-token prefill step
        for tokens in (max(batches), 2048 if not args.tiny else 8):
            key = torch.randn(tokens, num_kv_heads, HEAD_DIM, dtype=torch.float16, device=DEVICE)
            kc, vc = caches["int4"][0].clone(), caches["int4"][1].clone()
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens]
            us = bench_us(graph_of(lambda: attention_int4_triton.store_kv(key, key, kc, vc, slots)))  # noqa: B023
            moved = 2 * tokens * num_kv_heads * (HEAD_DIM * 2 + HEAD_DIM // 2 + 4)
            lines.append(f"| {name} | store {tokens} tokens | — | int4 | {us:.1f} | {moved / 1e6:.2f} | "
                         f"{moved / (us * 1e-6) / 1e9:.0f} | — | — | — |")  # fmt: skip
            print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
