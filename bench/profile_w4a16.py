"""Launch the W4A16 MMA kernel's built-in dispatch a few times per (shape, M), for ``ncu`` to profile.

Knows: Qwen2.5-14B linear shapes and the kernel launcher. Must not know: the engine. Run under
Nsight Compute on the GPU machine, e.g.

    ncu --clock-control none --kernel-name regex:w4a16_mma_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python bench/profile_w4a16.py --cases gate_up:1,qkv:1,gate_up:64,qkv:64
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quant_kernels import w4a16_mma_triton as mma  # noqa: E402
from quant_kernels.layout import PackedQuantWeight, pack_codes  # noqa: E402

SHAPES = {"qkv": (5120, 7168), "o": (5120, 5120), "gate_up": (5120, 27648), "down": (13824, 5120)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="gate_up:1,qkv:1", help="shape:M,...")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    for case in args.cases.split(","):
        name, m = case.split(":")
        k, n = SHAPES[name]
        codes = torch.randint(0, 16, (k, n), dtype=torch.int32, device="cuda")  # [K, N]
        scales = (torch.rand(k // 128, n, device="cuda") * 0.02 + 0.005).half()  # [K/G, N]
        weight = mma.prepare(PackedQuantWeight(4, 128, pack_codes(codes, 4), scales))
        counters = torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device="cuda")
        x = torch.randn(int(m), k, dtype=torch.float16, device="cuda")  # [M, K]
        print(name, m, mma.select_config(weight, torch.float16, int(m)).short(), flush=True)
        for _ in range(args.calls):
            mma.w4a16_gemm(x, weight, None, None, counters)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
