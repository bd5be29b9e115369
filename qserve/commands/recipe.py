"""Run a quantize-then-serve recipe: quantize a local fp16 model, then serve the result.

Knows: the ``qserve recipe`` arguments and the order quantize → serve. Must not know: what
either command does inside (it runs them through the qserve CLI).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="recipe name, e.g. qwen2.5-7b-instruct-gptq-rtx4090 (omit with --list)")
    parser.add_argument("--model-path", help="local directory of the fp16 model the recipe names")
    parser.add_argument("--output-path", default=None, help="where the quantized model goes (default from the recipe)")
    parser.add_argument(
        "--calib",
        default=None,
        help="calibration text (.txt / .jsonl / saved datasets dir; default: the demo's calibration text, "
        "packaged with qserve — give text like the model's real traffic)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the two commands and exit")
    parser.add_argument("--list", action="store_true", help="list the recipes")


def run(args: argparse.Namespace) -> int:
    from qserve.quantize.recipes import all_recipes, find_recipe

    if args.list or not args.name:
        for name, recipe in sorted(all_recipes().items()):
            plan = recipe.data.get("plan", {})
            print(f"{name:45s} weights {plan.get('weights_gib', '?')} GiB, "
                  f"{plan.get('max_concurrent_seqs_at_context', '?')} x 4k sequences under {plan.get('gpu_memory_budget', '?')}")  # fmt: skip
        return 0
    if not args.model_path:
        raise ValueError("--model-path is required: the local directory of the fp16 model")
    recipe = find_recipe(args.name)
    calib = args.calib
    if calib is None:
        from qserve.quantize.recipes import DEMO_CALIB

        calib = str(DEMO_CALIB)  # the same default as qserve quantize's, so the printed commands run as they are
    quantize_cmd, serve_cmd = recipe.commands(args.model_path, args.output_path, calib)
    if args.dry_run:
        print(quantize_cmd)
        print(serve_cmd)
        return 0
    if args.calib is None:
        print(f"no --calib: calibrating on the demo's text ({calib}); give text like the model's traffic", flush=True)
    if not Path(args.model_path).is_dir():
        raise FileNotFoundError(f"--model-path {args.model_path} is not a directory")
    from qserve.cli import main as cli_main

    output = shlex.split(quantize_cmd)[3]
    if (Path(output) / "config.json").is_file():
        print(f"{output} already exists; skipping quantize")
    else:
        print(f"$ {quantize_cmd}", flush=True)
        code = cli_main(shlex.split(quantize_cmd)[1:])
        if code:
            return code
    print(f"$ {serve_cmd}", flush=True)
    return cli_main(shlex.split(serve_cmd)[1:])
