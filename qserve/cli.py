"""The ``qserve`` command line: one sub-command per module in ``qserve.commands``.

Knows: which sub-commands exist. Each sub-command module owns its arguments (``register``) and
its behaviour (``run``); this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Sub-command name -> module in qserve.commands defining register(parser) and run(args) -> int.
SUBCOMMANDS = {
    "generate": "qserve.commands.generate",
    "inspect": "qserve.commands.inspect",
    "plan": "qserve.commands.plan",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qserve", description="Quantization-first LLM serving.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=module.__doc__.strip().splitlines()[0] if module.__doc__ else None)
        module.register(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"qserve {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
