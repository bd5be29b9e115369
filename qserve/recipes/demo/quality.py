"""Build the demo model's quality table: held-out perplexity of fp16, RTN, GPTQ and AWQ, and quantize times.

Knows: the commands to run (``qserve quantize`` for each method with the demo's settings, then
``qserve eval-ppl`` on ``recipes/demo/heldout.txt``) and how to print a Markdown table. Must not
know: qserve internals (it drives the CLI in-process).

Run (CPU, one thread, a few minutes)::

    nice -n 10 python recipes/demo/quality.py --work /tmp/demo-quality
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout's qserve, not a stale install

import torch  # noqa: E402


def qserve(argv: list[str]) -> int:
    """``qserve <command> ...`` in-process (only the named sub-command's module is imported)."""
    module = importlib.import_module(f"qserve.commands.{argv[0].replace('-', '_')}")
    parser = argparse.ArgumentParser(prog=f"qserve {argv[0]}")
    module.register(parser)
    return int(module.run(parser.parse_args(argv[1:])) or 0)


HERE = Path(__file__).resolve().parent
METHODS = ("rtn", "gptq", "awq")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/qserve-demo-quality")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[128, -1])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model, heldout, calib = HERE / "model", HERE / "heldout.txt", HERE / "calib.txt"

    rows = []
    paths: dict[str, tuple[Path, float | None]] = {"fp16 (reference)": (model, None)}
    for group in args.group_sizes:
        for method in METHODS:
            dst = work / f"{method}-g{group}"
            cmd = ["quantize", str(model), str(dst), "--method", method, "--bits", "4", "--group-size", str(group),
                   "--device", "cpu", "--num-samples", "32", "--seq-len", "256"]  # fmt: skip
            if method != "rtn":
                cmd += ["--calib", str(calib)]
            start = time.perf_counter()
            assert qserve(cmd) == 0
            label = f"{method.upper()} 4-bit " + (
                "g128" if group == 128 else "per-channel" if group == -1 else f"g{group}"
            )
            paths[label] = (dst, time.perf_counter() - start)
    for label, (path, seconds) in paths.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = qserve(["eval-ppl", str(path), "--text", str(heldout), "--max-length", str(args.max_length),
                           "--stride", str(args.stride), "--device", "cpu", "--dtype", "float32", "--json"])  # fmt: skip
        assert code == 0
        result = json.loads(out.getvalue().strip().splitlines()[-1])
        size = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
        rows.append((label, result["perplexity"], seconds, size, result["tokens_scored"]))
    print(f"held-out tokens scored: {rows[0][4]} (max-length {args.max_length}, stride {args.stride})")
    print("| weights | held-out perplexity | time to quantize | size on disk |")
    print("|---|---|---|---|")
    for label, ppl, seconds, size, _ in rows:
        took = "—" if seconds is None else f"{seconds:.1f} s"
        print(f"| {label} | {ppl:.2f} | {took} | {size / 2**20:.1f} MiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
