"""Config sweep of the MMA-operand MoE kernel (``moe_mma_triton``), each GEMM alone: where a
measured launch table per architecture comes from (issue 32's batch-1 target).

Knows: Qwen3-30B-A3B's expert shapes (bench/moe.py's, random weights and routing), the kernel's
launcher (``moe_mma_triton._launch``) and its config fields; how to time (CUDA-graph replay, median
of bench/moe.py's ``graph_us``). Must not know: the engine.

For each token count, the gate_up launch (``silu(gate) * up`` per pair) and the down launch run
alone on the same sort (one sort per block_m), for every config of the grid; each output is first
checked against the default config's (relative error under 1e-2), then graph-timed. At decode sizes
(<= 2 pairs per expert) the grid includes split-K (``--splits``, default 1,2,4,8): split gate_up
launches also zero the layer's down accumulator (as the layer does); split down launches add into
a float32 [T, H] accumulator, checked against the default's k-way sum, so their time includes that
sum (the unsplit down's excludes the torch sum that follows it). Printed: the
default's µs, the best config and its µs per (tokens, GEMM); a JSON line per timing.

    PYTHONPATH=. python bench/moe_sweep.py --tokens 1,8,32,128 --jobs 12 --out $OUT/moe_sweep.md

``--jobs N``: N subprocesses first launch each config once (their shard of the grid) on the same
shapes, so the compiles (~1 s each, CPU-bound) fill Triton's on-disk cache in parallel and the
timing process finds every kernel compiled.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.moe import GROUP, HIDDEN, INTER, NUM_EXPERTS, TOP_K, graph_us, make_experts  # noqa: E402
from quant_kernels import moe_mma_triton, moe_reference, moe_triton  # noqa: E402

SPLITS = (1, 2, 4, 8)


def grid(num_tokens: int, splits: tuple[int, ...] = SPLITS) -> list[moe_mma_triton.MoEMmaConfig]:
    """block_n >= 16 per warp (the launcher's rule); block_m past 16 and split-K only where an expert
    gets many / few pairs (split-K: the decode grid's few programs; 4x the configs there)."""
    decode = num_tokens * TOP_K / NUM_EXPERTS <= 2
    block_ms = (16,) if decode else (16, 32, 64)
    configs = []
    for block_m, warps, block_n, block_k, stages, split in itertools.product(
        block_ms, (2, 4, 8), (32, 64, 128, 256), (128, 256), (2, 3, 4), splits if decode else (1,)
    ):
        if block_n >= 16 * warps and not (block_n == 256 and block_k == 256):
            configs.append(moe_mma_triton.MoEMmaConfig(block_m, block_n, block_k, warps, stages, split))
    return configs


@dataclass
class Case:
    """One GEMM's launch inputs at one token count; ``sorts`` caches the token sort per block_m."""

    a: torch.Tensor  # [rows, K]: x [T, H] (gate_up) or the intermediate [T*k, I] (down)
    weight: moe_mma_triton.StackedMmaWeight
    n_out: int
    flat_w: torch.Tensor  # float32 [T*k]
    ids: torch.Tensor  # int32 [T, k]
    num_pairs: int
    row_div: int
    gate_up: bool
    sorts: dict
    token_rows: torch.Tensor  # float32 [T, H]: split-K gate_up zeroes it (the layer's down accumulator)

    def run(self, cfg: moe_mma_triton.MoEMmaConfig, out: torch.Tensor) -> None:
        if cfg.block_m not in self.sorts:
            self.sorts[cfg.block_m] = moe_triton.moe_align_block_size(self.ids, NUM_EXPERTS, cfg.block_m)
        s_ids, e_ids, n_pad = self.sorts[cfg.block_m]
        # split-K as the layer launches it: gate_up also zeroes down's accumulator (its cost counted
        # here); down adds into the token rows (k-way sum included; replays keep adding, timing only)
        split = {} if cfg.split_k == 1 else {"zero_out": self.token_rows} if self.gate_up else {"out_row_div": TOP_K}
        moe_mma_triton._launch(
            self.a, self.weight, out, self.n_out, self.flat_w, s_ids, e_ids, n_pad, self.num_pairs, self.row_div,
            self.gate_up, cfg, **split,
        )  # fmt: skip

    def output(self, cfg: moe_mma_triton.MoEMmaConfig, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed output for ``cfg`` and what it must equal: ``want`` ([T*k, N], the default config's),
        or for split-K down its k-way sum (float32 [T, H])."""
        if cfg.split_k > 1 and not self.gate_up:
            tokens = self.num_pairs // TOP_K
            return torch.zeros_like(self.token_rows), want.view(tokens, TOP_K, -1).float().sum(dim=1)
        return torch.zeros_like(want), want


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,32,128")
    parser.add_argument("--out", default=None, help="markdown table (a .json beside it)")
    parser.add_argument("--jobs", type=int, default=1, help="compile the grid in this many processes first")
    parser.add_argument("--splits", default=",".join(map(str, SPLITS)), help="split_k values at decode sizes")
    parser.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # "i/n": compile only (a --jobs worker)
    args = parser.parse_args()
    if args.jobs > 1:
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--tokens",
                    args.tokens,
                    "--splits",
                    args.splits,
                    "--shard",
                    f"{i}/{args.jobs}",
                ]
            )
            for i in range(args.jobs)
        ]
        for worker in workers:
            worker.wait()
    shard = tuple(map(int, args.shard.split("/"))) if args.shard else None
    splits = tuple(int(v) for v in args.splits.split(","))
    torch.manual_seed(0)
    w13, _ = make_experts(HIDDEN, 2 * INTER, seed=1)
    w2, _ = make_experts(INTER, HIDDEN, seed=2)
    mma13, mma2 = moe_mma_triton.prepare_stacked(w13), moe_mma_triton.prepare_stacked(w2)
    results, lines = [], []
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.float16)  # [T, H]
        weights, ids = moe_reference.select_experts(torch.randn(t, NUM_EXPERTS, device="cuda"), TOP_K, True)
        flat_w = weights.reshape(-1).float().contiguous()  # [T*k]
        num_pairs = t * TOP_K
        inter_in = torch.randn(num_pairs, INTER, device="cuda", dtype=torch.float16) * 0.1  # [T*k, I]
        sorts = {}
        default = moe_mma_triton.default_config(t, TOP_K, NUM_EXPERTS)
        for gemm in ("gate_up", "down"):
            gate_up = gemm == "gate_up"
            weight, a, n_out, row_div = (mma13, x, INTER, TOP_K) if gate_up else (mma2, inter_in, HIDDEN, 1)

            token_rows = torch.zeros(t, HIDDEN, device="cuda", dtype=torch.float32)  # [T, H]
            case = Case(a, weight, n_out, flat_w, ids, num_pairs, row_div, gate_up, sorts, token_rows)
            want = torch.zeros(num_pairs, n_out, device="cuda", dtype=torch.float16)
            if shard is not None:  # compile this worker's share of the grid, once per token count's grid
                for i, cfg in enumerate(grid(t, splits)):
                    if i % shard[1] == shard[0]:
                        try:
                            case.run(cfg, case.output(cfg, want)[0])
                        except Exception:  # noqa: BLE001, S112 - the timing process reports refused configs
                            continue
                continue
            case.run(default, want)
            default_us = graph_us(lambda c=case, d=default, w=want: c.run(d, w))
            best = (default_us, default)
            for cfg in grid(t, splits):
                out, expected = case.output(cfg, want)
                try:
                    case.run(cfg, out)
                except Exception as err:  # noqa: BLE001 - a config the launcher or compiler refuses
                    print(f"T={t} {gemm} {cfg}: {str(err).splitlines()[0][:120]}", file=sys.stderr)
                    continue
                err = rel(out, expected)
                if err > 1e-2:
                    print(f"T={t} {gemm} {cfg}: relative error {err:.3g}; not timed", file=sys.stderr)
                    continue
                us = graph_us(lambda c=case, cfg=cfg, out=out: c.run(cfg, out))
                results.append({"tokens": t, "gemm": gemm, **cfg.__dict__, "us": us})
                print(json.dumps(results[-1]), flush=True)
                if us < best[0]:
                    best = (us, cfg)
            line = (
                f"| {t} | {gemm} | {default_us:.1f} | {best[0]:.1f} | {default_us / best[0]:.2f} | "
                f"{best[1].block_m} | {best[1].block_n} | {best[1].block_k} | {best[1].num_warps} | {best[1].num_stages} | "
                f"{best[1].split_k} |"
            )
            lines.append(line)
            print(line, flush=True)
    if shard is not None:
        return
    header = [
        f"MoE MMA kernel config sweep, Qwen3-30B-A3B experts (H {HIDDEN}, E {NUM_EXPERTS}, top-{TOP_K}, "
        f"I {INTER}, g{GROUP}), {torch.cuda.get_device_name()}, graph-timed µs per launch",
        "",
        "| tokens | GEMM | default µs | best µs | default / best | block_m | block_n | block_k | warps | stages | split_k |",
        "|" + "---|" * 11,
    ]
    text = "\n".join(header + lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
