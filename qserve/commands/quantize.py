"""Quantize an fp16/bf16 Hugging Face checkpoint to a standard 4-bit (or 8-bit) GPTQ or AWQ checkpoint.

Knows: the ``qserve quantize`` arguments and how to report the result. Must not know: the
algorithms or layouts (``qserve.quantize`` owns them).
"""

from __future__ import annotations

import argparse
import sys

from qserve.model.hub import add_revision_argument, resolve_model_path
from qserve.quantize.pipeline import METHODS


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="fp16/bf16 Hugging Face model directory (safetensors)")
    add_revision_argument(parser)
    parser.add_argument("dst", help="output directory (created; must be absent or empty)")
    parser.add_argument("--method", default="gptq", help=f"one of {', '.join(METHODS)} (rtn needs no calibration)")
    parser.add_argument("--bits", type=int, default=4, help="4 (all methods) or 8 (gptq, rtn)")
    parser.add_argument("--group-size", type=int, default=128, help="group size, or -1 for per-channel")
    parser.add_argument("--desc-act", action="store_true", help="GPTQ act-order (writes a permuted g_idx)")
    sym = parser.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=None, help="symmetric (gptq/rtn default)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric, with zero points (awq always)")
    parser.add_argument(
        "--calib",
        default=None,
        help="calibration text: .txt, .jsonl ('text' field) or a saved datasets dir (default: the demo's "
        "calibration text, Python source packaged with qserve: right for the demo, give text like a real "
        "model's traffic for one)",
    )
    parser.add_argument("--num-samples", type=int, default=128, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--seed", type=int, default=0, help="seed for choosing the windows")
    parser.add_argument("--damp-percent", type=float, default=0.01, help="GPTQ dampening, fraction of mean diag(H)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--max-shard-size", default="4GiB", help="largest safetensors shard (e.g. 4GiB, 500MB)")


def run(args: argparse.Namespace) -> int:
    args.src = resolve_model_path(args.src, args.revision)  # a Hub id: its cached snapshot
    from qserve.memory.planner import parse_memory_budget
    from qserve.quantize.pipeline import QuantizeOptions, quantize_checkpoint

    calib = args.calib
    if calib is None and args.method != "rtn":
        from qserve.quantize.recipes import DEMO_CALIB

        calib = str(DEMO_CALIB)
        print(f"qserve quantize: no --calib: calibrating on the demo's text ({calib})", file=sys.stderr)
    options = QuantizeOptions(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        sym=args.sym,
        desc_act=args.desc_act,
        damp_percent=args.damp_percent,
        calib=calib,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        seed=args.seed,
        device=args.device,
        max_shard_bytes=parse_memory_budget(args.max_shard_size),
    )
    report = quantize_checkpoint(args.src, args.dst, options)
    layout = "AWQ GEMM" if report.method == "awq" else "GPTQ v1"
    print(
        f"wrote {report.path} ({layout}, {args.bits}-bit, group size {args.group_size}; "
        f"{report.bytes_written / 2**20:.1f} MiB of tensors) in {report.seconds:.1f} s"
    )
    return 0
