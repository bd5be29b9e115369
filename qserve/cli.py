"""The ``qserve`` command line: one sub-command per module in ``qserve.commands``.

Knows: which sub-commands exist. Each sub-command module owns its arguments (``register``) and
its behaviour (``run``); this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback

# Sub-command name -> (module in qserve.commands defining register(parser) and run(args) -> int,
# one-line help). Only the chosen command's module is imported, so one command's heavy or
# optional imports never affect another.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("qserve.commands.serve", "serve models over an OpenAI-compatible HTTP API"),
    "generate": ("qserve.commands.generate", "generate text for one prompt, streamed to the terminal"),
    "plan": ("qserve.commands.plan", "print the memory plan for a model under a budget"),
    "inspect": ("qserve.commands.inspect", "describe a checkpoint: format, quantization, bytes"),
    "quantize": ("qserve.commands.quantize", "quantize an fp16 checkpoint to a standard GPTQ or AWQ checkpoint"),
    "eval-ppl": ("qserve.commands.eval_ppl", "sliding-window perplexity of a text under a model"),
    "recipe": ("qserve.commands.recipe", "run a quantize-then-serve recipe (or --dry-run / --list)"),
    # model families (issue 15): ChatGLM / Baichuan ship pickled .bin weights only
    "convert": ("qserve.commands.convert", "rewrite a checkpoint's .bin weights as safetensors (weights_only load)"),
    "bench": ("qserve.commands.bench", "load-test a running OpenAI-compatible server (throughput, TTFT, TPOT, ITL)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qserve", description="Quantization-first LLM serving.")
    parser.add_argument("--log-level", default=None, help="logging level (DEBUG, INFO, WARNING, ...; default WARNING)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error, not just its message")
    subparsers = parser.add_subparsers(dest="command", required=True)
    chosen = next((arg for arg in argv if arg in SUBCOMMANDS), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.register(sub)
            sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=(args.log_level or "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        # User errors (bad arguments, broken checkpoints) are one line; --debug shows where.
        if args.debug:
            traceback.print_exc()
        print(f"qserve {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
