"""ALiBi paged-attention benchmark: the Triton kernels with and without ALiBi slopes.

Knows: Baichuan2-13B attention heads (40 q = 40 kv, head_dim 128: the ALiBi model), how to time
(``triton.testing.do_bench`` median; CPU: one interpreted call), and what to report: decode and
prefill time with ALiBi, the same shape without it (the bias is a few FMAs per score, so the
ratio should be ~1), and the relative error against ``reference.paged_attention`` with the same
slopes, checked on the same data before timing. Must not know: the engine.

    PYTHONPATH=. python bench/attention_alibi.py --out $OUT/attention_alibi.md
    PYTHONPATH=. TRITON_INTERPRET=1 python bench/attention_alibi.py --tiny     # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention import DEVICE, bench_us, rel_err  # noqa: E402
from qserve.layers.attention import alibi_slopes  # noqa: E402
from quant_kernels import reference  # noqa: E402
from quant_kernels.attention_triton import AttentionConfig, paged_attention  # noqa: E402

NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 40, 128, 16


def make_inputs(num_seqs: int, q_len: int, ctx: int, num_heads: int, head_dim: int, gen: torch.Generator):
    blocks = -(-ctx // BLOCK_SIZE)
    pool = num_seqs * blocks + 1
    tables = torch.randperm(pool, generator=gen)[: num_seqs * blocks].view(num_seqs, blocks).int()  # [S, blocks]
    kc = torch.randn(pool, BLOCK_SIZE, num_heads, head_dim, generator=gen).half()  # [pool, bs, H, D]
    vc = torch.randn(pool, BLOCK_SIZE, num_heads, head_dim, generator=gen).half()
    query = torch.randn(num_seqs * q_len, num_heads, head_dim, generator=gen).half()  # [T, H, D]
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int64)
    qsl = torch.arange(num_seqs + 1, dtype=torch.int64) * q_len
    return [t.to(DEVICE) for t in (query, kc, vc, tables, seq_lens, qsl)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_alibi.md")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if DEVICE == "cpu":  # the interpreter needs the same fixes as the kernel tests
        from tests.conftest import _fix_interpreter_index, _fix_interpreter_mask_dtype

        _fix_interpreter_index()
        _fix_interpreter_mask_dtype()
    heads, dim = (5, 64) if args.tiny else (NUM_HEADS, HEAD_DIM)
    shapes = [(2, 1, 40), (1, 16, 48)] if args.tiny else [(32, 1, 1024), (128, 1, 448), (1, 2048, 2048), (4, 512, 4096)]
    config = AttentionConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16) if args.tiny else None
    slopes = alibi_slopes(heads).to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for num_seqs, q_len, ctx in shapes:
        query, kc, vc, tables, seq_lens, qsl = make_inputs(num_seqs, q_len, ctx, heads, dim, gen)
        call = (query, kc, vc, tables, seq_lens, qsl, q_len, ctx, dim**-0.5)
        ref = reference.paged_attention(*call, alibi_slopes=slopes).float()
        out = paged_attention(*call, config=config, alibi_slopes=slopes)
        err = rel_err(out, ref)
        assert err < 1e-2, f"ALiBi kernel disagrees with the reference: relative error {err:.2e}"
        t_alibi = bench_us(lambda: paged_attention(*call, config=config, alibi_slopes=slopes))  # noqa: B023
        t_plain = bench_us(lambda: paged_attention(*call, config=config))  # noqa: B023
        rows.append((num_seqs, q_len, ctx, t_alibi, t_plain, err))
    lines = [
        f"# ALiBi paged attention ({DEVICE}, {heads} heads x {dim}, fp16, block {BLOCK_SIZE})",
        "",
        "| seqs | new tokens | context | ALiBi us | no ALiBi us | ratio | rel err vs reference |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {s} | {q} | {c} | {a:.1f} | {p:.1f} | {a / p:.3f} | {e:.1e} |" for s, q, c, a, p, e in rows]
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
