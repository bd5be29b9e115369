"""Fused MoE W4A16 benchmark: the grouped kernel vs a per-expert loop of the dense W4A16 kernel vs
cuBLAS fp16 (grouped, and a per-expert loop), in Qwen3-30B-A3B's expert shapes, against the
bandwidth floor.

Knows: Qwen3-30B-A3B's MoE shapes (hidden 2048, 128 experts, top-8, expert MLP 768, GPTQ g128),
random routing (softmax top-k of random logits, renormalized), how to time (CUDA-graph replay
for the sync-free fused kernel and cuBLAS grouped GEMM; ``do_bench`` medians for the loops, which sync with the host to
learn the hit experts and cannot be captured), and the floor: the bytes of the experts a step
actually reads (packed codes + scales of every hit expert, plus activations) over this run's
measured copy bandwidth. Must not know: the engine. Every timed path is first checked against the
PyTorch reference (``moe_reference.fused_moe_w4a16``, float32 dequant) on the same inputs.

    PYTHONPATH=. python bench/moe.py --out $OUT/moe.md

Columns: µs per MoE layer call of each path, ratios in the same run (loop / fused and
cuBLAS grouped / fused: > 1 means the fused kernel is faster), the fused kernel's share of the floor;
``mma``: the MMA-operand kernel (``moe_mma_triton``, the default; ``QSERVE_MOE_KERNEL=fused`` leaves it), graph-timed on the
same inputs, with its share of the floor; ``mma split``: the same with ``QSERVE_MOE_SPLIT_K=auto``'s config
(split-K, opt-in; its split in brackets, "—" where auto does not split); and the token sort by expert alone, graph-timed: the
reference's torch ops (``moe_reference.moe_align_block_size``) vs the one-launch Triton kernel the fused
paths run (``moe_triton.moe_align_block_size``, its kernel timed at every size, past
``QSERVE_MOE_ALIGN_MAX_PAIRS`` too, where the launcher would run the torch ops), at the fused path's block_m, after checking they agree;
and the router's softmax + top-k alone, graph-timed: ``moe_reference.select_experts`` (about six torch
ops) vs ``moe_router_triton.router_topk`` (one launch, the default; ``QSERVE_FUSED_ROUTER=0`` takes the torch ops).

A second table, at the token counts where ``QSERVE_MOE_DIRECT_BLOCKS=32`` applies (T * top-8 <= 32: 1-4
tokens): the sort-free layout (one pair per block, written by the router's launch) against the sort, both
through ``moe_ops.route`` + ``moe_experts`` with the MMA kernel and ``QSERVE_FUSED_ROUTER=1``, graph-timed on
the same logits: the experts alone given each path's routing (direct: no sort launch, but an expert hit by
two tokens is read twice) and the whole routed step from the logits (router, sort or not, two GEMMs, sum),
after checking the two outputs (expected equal bit for bit: each row of a block is computed on its own).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from unittest import mock

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import moe_mma_triton, moe_ops, moe_reference, moe_router_triton, moe_triton, ops  # noqa: E402
from quant_kernels.layout import pack_codes  # noqa: E402
from quant_kernels.moe_layout import StackedQuantWeight  # noqa: E402

HIDDEN, NUM_EXPERTS, TOP_K, INTER, GROUP = 2048, 128, 8, 768, 128
TOKENS = [1, 8, 32, 128, 512, 1024, 2048, 4096]
DIRECT_PAIRS = 32  # QSERVE_MOE_DIRECT_BLOCKS for the second table: 1-4 tokens at top-8 (the rows --tokens adds)
DIRECT_TOKENS = [1, 2, 4]


def bench_us(fn, rep: int = 50) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def graph_us(fn, rep: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return statistics.median(bench_us(graph.replay, rep=rep) for _ in range(3))


def copy_bandwidth() -> float:
    src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")  # [1 GiB]
    dst = torch.empty_like(src)
    return 2 * (1 << 30) / (bench_us(lambda: dst.copy_(src), rep=100) * 1e-6)


def make_experts(k: int, n: int, seed: int) -> tuple[StackedQuantWeight, torch.Tensor]:
    """A random stacked 4-bit weight and its fp16 dense copy in torch orientation [E, N, K]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 16, (NUM_EXPERTS, k, n), device="cuda", generator=gen, dtype=torch.int32)
    scales = (torch.rand(NUM_EXPERTS, k // GROUP, n, device="cuda", generator=gen) * 0.01 + 0.002).half()
    qweight = torch.stack([pack_codes(codes[e], 4) for e in range(NUM_EXPERTS)])  # [E, K/8, N]
    dense = ((codes - 8).half() * scales.repeat_interleave(GROUP, dim=1)).transpose(1, 2).contiguous()  # [E, N, K]
    return StackedQuantWeight(4, GROUP, qweight, scales), dense


def grouped_dense(
    x: torch.Tensor,  # [T, H]
    w13t: torch.Tensor,  # [E, H, 2I] (a transposed view of the dense [E, 2I, H])
    w2t: torch.Tensor,  # [E, I, H]
    weights: torch.Tensor,  # float32 [T, k]
    ids: torch.Tensor,  # int32 [T, k]
) -> torch.Tensor:  # [T, H]
    """The fp16 experts as two cuBLAS grouped GEMMs (``torch._grouped_mm``) over the pairs sorted
    by expert: no host sync, so it is graph-timed like the fused kernel."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    tokens = order // top_k
    counts = torch.zeros(w13t.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E]
    gate_up = torch._grouped_mm(x[tokens], w13t, offs=offs)  # [T*k, 2I]
    inter = gate_up.shape[-1] // 2
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch._grouped_mm(act, w2t, offs=offs) * weights.reshape(-1)[order, None].to(x.dtype)  # [T*k, H]
    return torch.zeros_like(x).index_add_(0, tokens, y)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def direct_blocks(
    x: torch.Tensor,  # [T, H] fp16
    logits: torch.Tensor,  # [T, E] fp16, no ties in a row
    experts: moe_ops.PreparedExperts,  # kind "mma"
) -> dict[str, float | bool | None]:
    """The sort-free step (``QSERVE_MOE_DIRECT_BLOCKS``) against the sorted one through ``moe_ops``, both
    with ``QSERVE_FUSED_ROUTER=1``: µs of the experts alone given each path's routing, and of the whole
    routed step (split-K as the environment says: ``auto`` by default); ``direct equal``: whether the
    two outputs are equal bit for bit with split-K off (``QSERVE_MOE_SPLIT_K=0``: split-K's fp32 atomic
    adds sum in block order, which the two layouts differ in)."""
    paths: dict[str, dict[str, str]] = {
        "sorted": {moe_ops.FUSED_ROUTER_ENV: "1", moe_ops.DIRECT_BLOCKS_ENV: "0"},
        "direct": {moe_ops.FUSED_ROUTER_ENV: "1", moe_ops.DIRECT_BLOCKS_ENV: str(DIRECT_PAIRS)},
    }
    row: dict[str, float | bool | None] = {}
    outs = {}
    for name, env in paths.items():
        with mock.patch.dict(os.environ, env):
            routing = moe_ops.route(logits, TOP_K, True, experts)
            assert (routing.layout is not None) == (name == "direct"), f"the {name} path did not run as asked"

            def step(routing=routing) -> torch.Tensor:
                return moe_ops.moe_experts(x, experts, routing.weights, routing.ids, routing.layout)

            def routed() -> torch.Tensor:
                r = moe_ops.route(logits, TOP_K, True, experts)
                return moe_ops.moe_experts(x, experts, r.weights, r.ids, r.layout)

            with mock.patch.dict(os.environ, {moe_mma_triton.SPLIT_K_ENV: "0"}):
                outs[name] = routed()
            row[f"experts {name}"] = graph_us(step)
            row[f"routed {name}"] = graph_us(routed)  # captured with this path's environment
    row["direct equal"] = torch.equal(outs["sorted"], outs["direct"])
    if not row["direct equal"]:
        err = rel_err(outs["direct"], outs["sorted"])
        print(
            f"T={x.shape[0]}: the direct layout's output differs from the sorted one's (rel {err:.2e})", file=sys.stderr
        )
        if err > 2e-2:
            row.update({key: None for key in row if key != "direct equal"})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="markdown table (a .json beside it)")
    parser.add_argument("--tokens", default=",".join(map(str, sorted(set(TOKENS + DIRECT_TOKENS)))))
    args = parser.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    w13, dense13 = make_experts(HIDDEN, 2 * INTER, seed=1)
    w2, dense2 = make_experts(INTER, HIDDEN, seed=2)
    loop = moe_ops.PreparedExperts(
        "per_expert",
        NUM_EXPERTS,
        INTER,
        gate_up_list=[ops.prepare_w4a16(w13.expert(e)) for e in range(NUM_EXPERTS)],
        down_list=[ops.prepare_w4a16(w2.expert(e)) for e in range(NUM_EXPERTS)],
    )
    dense13_bf16, dense2_bf16 = dense13.bfloat16(), dense2.bfloat16()
    mma13, mma2 = moe_mma_triton.prepare_stacked(w13), moe_mma_triton.prepare_stacked(w2)  # QSERVE_MOE_KERNEL=mma
    direct_experts = moe_ops.PreparedExperts("mma", NUM_EXPERTS, INTER, gate_up=mma13, down=mma2, fused=True)
    expert_bytes = (w13.nbytes() + w2.nbytes()) / NUM_EXPERTS
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.float16)
        logits = torch.randn(t, NUM_EXPERTS, device="cuda")
        weights, ids = moe_reference.select_experts(logits, TOP_K, renormalize=True)
        ref = moe_reference.fused_moe_w4a16(x.float(), w13, w2, weights, ids)
        hit = int(torch.unique(ids).numel())
        floor_bytes = hit * expert_bytes + t * HIDDEN * 2 * 2 + t * TOP_K * (2 * INTER + HIDDEN) * 2
        floor_us = floor_bytes / bw * 1e6
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        split_cfg = moe_mma_triton.default_config(t, TOP_K, NUM_EXPERTS, "auto", HIDDEN, INTER, sms)
        paths = {
            "fused": (lambda x=x, weights=weights, ids=ids: moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids), True),
            "mma": (
                lambda x=x, weights=weights, ids=ids: moe_mma_triton.fused_moe_w4a16_mma(x, mma13, mma2, weights, ids),
                True,
            ),
            # QSERVE_MOE_SPLIT_K=auto's config (opt-in split-K); where auto does not split, not run again
            "mma split": (
                lambda x=x, weights=weights, ids=ids, cfg=split_cfg: moe_mma_triton.fused_moe_w4a16_mma(
                    x, mma13, mma2, weights, ids, cfg
                ),
                True,
            ),
            "w4a16 loop": (lambda x=x, weights=weights, ids=ids: moe_ops.moe_experts(x, loop, weights, ids), False),
            # torch's grouped GEMM has a graph-safe (CUTLASS) path on Hopper for bf16 only: its fp16 fallback
            # copies the offsets to the host, which CUDA graph capture refuses (seen on the H200); bf16 runs
            # at fp16's tensor-core rate, so it stands in for "fp16 grouped"
            "cuBLAS fp16 grouped": (
                lambda x=x, weights=weights, ids=ids: grouped_dense(
                    x.bfloat16(), dense13_bf16.transpose(1, 2), dense2_bf16.transpose(1, 2), weights, ids
                ),
                True,
            ),
            "cuBLAS fp16 loop": (
                lambda x=x, weights=weights, ids=ids: moe_reference.fused_moe_dense(x, dense13, dense2, weights, ids),
                False,
            ),
        }
        row = {"tokens": t, "experts_hit": hit, "floor_us": floor_us, "split_k": split_cfg.split_k}
        if split_cfg.split_k == 1:
            del paths["mma split"]
            row["mma split"] = None
        for name, (fn, graphed) in paths.items():
            try:
                out = fn()
            except (RuntimeError, NotImplementedError) as err:  # e.g. no fp16 grouped GEMM on this card
                print(f"T={t} {name}: {str(err).splitlines()[0]}", file=sys.stderr)
                row[name] = row[f"{name} err"] = None
                continue
            err = rel_err(out, ref)
            row[f"{name} err"] = err
            if err > 2e-2:
                print(f"T={t} {name}: relative error {err:.3g} against the reference; not timed", file=sys.stderr)
                row[name] = None
                continue
            try:
                row[name] = graph_us(fn) if graphed else bench_us(fn)
            except RuntimeError as err:  # one path's failure (e.g. refused by graph capture) leaves the others' rows
                print(f"T={t} {name}: not timed: {str(err).splitlines()[0]}", file=sys.stderr)
                row[name] = None
        block_m = moe_triton.default_config(t, TOP_K, NUM_EXPERTS).block_m
        aligns = {"align torch": moe_reference.moe_align_block_size, "align triton": moe_triton.moe_align_block_size}
        # the kernel itself at every size (whatever QSERVE_MOE_ALIGN_MAX_PAIRS says): the crossover is read here
        limit = os.environ.get(moe_triton.ALIGN_MAX_PAIRS_ENV)
        os.environ[moe_triton.ALIGN_MAX_PAIRS_ENV] = str(1 << 62)
        sorts = {name: fn(ids, NUM_EXPERTS, block_m) for name, fn in aligns.items()}
        agree = all(torch.equal(a, b) for a, b in zip(*sorts.values()))
        for name, fn in aligns.items():
            row[name] = graph_us(lambda fn=fn, ids=ids, bm=block_m: fn(ids, NUM_EXPERTS, bm)) if agree else None
        if limit is None:
            del os.environ[moe_triton.ALIGN_MAX_PAIRS_ENV]
        else:
            os.environ[moe_triton.ALIGN_MAX_PAIRS_ENV] = limit
        if not agree:
            print(f"T={t}: the Triton token sort differs from the reference's; not timed", file=sys.stderr)
        # the router's softmax + top-k on the model-dtype logits the MoE block has: torch ops vs one launch
        # (QSERVE_FUSED_ROUTER=1), after checking they pick the same experts. The logits are a permutation of
        # an evenly spaced spread per row: random fp16 logits tie from ~128 tokens on, and a tie's pick is
        # each implementation's own
        spread = torch.argsort(torch.rand(t, NUM_EXPERTS, device="cuda"), dim=1)  # [T, E]
        router_in = (spread.float() * (8.0 / NUM_EXPERTS) - 4.0).half()
        routers = {"router torch": moe_reference.select_experts, "router triton": moe_router_triton.router_topk}
        picks = [fn(router_in, TOP_K, True)[1] for fn in routers.values()]
        if torch.equal(*picks):
            for name, fn in routers.items():
                row[name] = graph_us(lambda fn=fn, lg=router_in: fn(lg, TOP_K, True))
        else:
            print(f"T={t}: the Triton router picks other experts than the reference; not timed", file=sys.stderr)
        if t * TOP_K <= DIRECT_PAIRS:  # the sort-free layout against the sort, on the router's own logits
            row.update(direct_blocks(x, router_in, direct_experts))
        fused = row["fused"]
        row["loop/fused"] = row["w4a16 loop"] / fused if fused and row["w4a16 loop"] else None
        row["cublas/fused"] = row["cuBLAS fp16 grouped"] / fused if fused and row["cuBLAS fp16 grouped"] else None
        row["fused % of floor"] = 100 * floor_us / fused if fused else None
        row["mma % of floor"] = 100 * floor_us / row["mma"] if row["mma"] else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = (
        f"Fused MoE W4A16, Qwen3-30B-A3B experts (H {HIDDEN}, E {NUM_EXPERTS}, top-{TOP_K}, I {INTER}, g{GROUP}), "
        f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s"
    )
    lines = [header, "", "| tokens | experts hit | fused µs | mma µs | mma split µs (split) | w4a16 loop µs | "
             "torch grouped bf16 µs | cuBLAS fp16 loop µs | loop/fused | grouped/fused | floor µs | fused % of floor | "
             "mma % of floor | sort: torch µs | sort: Triton µs | router: torch µs | router: Triton µs |",
             "|" + "---|" * 17]  # fmt: skip

    def fmt(v: float | None, spec: str = ".1f") -> str:
        return "—" if v is None else format(v, spec)

    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['experts_hit']} | {fmt(r['fused'])} | {fmt(r['mma'])} | "
            f"{fmt(r['mma split'])} ({r['split_k']}) | {fmt(r['w4a16 loop'])} | "
            f"{fmt(r['cuBLAS fp16 grouped'])} | {fmt(r['cuBLAS fp16 loop'])} | {fmt(r['loop/fused'], '.2f')} | "
            f"{fmt(r['cublas/fused'], '.2f')} | "
            f"{fmt(r['floor_us'])} | {fmt(r['fused % of floor'], '.0f')} | {fmt(r['mma % of floor'], '.0f')} | "
            f"{fmt(r['align torch'])} | {fmt(r['align triton'])} | {fmt(r.get('router torch'))} | "
            f"{fmt(r.get('router triton'))} |"
        )
    direct_rows = [r for r in rows if "direct equal" in r]
    if direct_rows:
        lines += ["", f"Sort-free MoE steps (QSERVE_MOE_DIRECT_BLOCKS={DIRECT_PAIRS}, QSERVE_FUSED_ROUTER=1, MMA kernel)",
                  "", "| tokens | experts: sorted µs | experts: direct µs | router + experts: sorted µs | "
                  "router + experts: direct µs | sorted / direct | outputs equal |", "|" + "---|" * 7]  # fmt: skip
    for r in direct_rows:
        speedup = r["routed sorted"] / r["routed direct"] if r["routed sorted"] and r["routed direct"] else None
        lines.append(
            f"| {r['tokens']} | {fmt(r['experts sorted'])} | {fmt(r['experts direct'])} | {fmt(r['routed sorted'])} | "
            f"{fmt(r['routed direct'])} | {fmt(speedup, '.2f')} | {'yes' if r['direct equal'] else 'NO'} |"
        )
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
