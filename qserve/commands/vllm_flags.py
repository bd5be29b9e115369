"""More of ``vllm serve``'s flags, so vLLM launch lines start qserve: CORS
(``--allowed-origins`` ...), ``--enable-auto-tool-choice``, ``--quantization`` and
``--root-path``.

Knows: the flags' names, vLLM's defaults and syntax (the CORS lists are JSON lists, e.g.
``--allowed-origins '["https://a.example"]'``), which ``--quantization`` values name the
formats qserve serves (the Marlin variants are vLLM's kernel choices for the same
checkpoints) and how a value is checked against the format a checkpoint declares. Must not
know: routes, engines, uvicorn (``serve`` passes the values on).
"""

from __future__ import annotations

import argparse
import json

# vLLM's --quantization values for the formats qserve serves -> qserve's format (loaders.detect).
QUANTIZATION_FORMATS = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors",
}


def json_list(value: str) -> list[str]:
    """vLLM's syntax, a JSON list of strings (``'["*"]'``); a plain comma-separated list is
    taken too (``a.example,b.example``)."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list") from None
        if not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError(f"{value!r}: the list must hold strings")
        return items
    return [item.strip() for item in text.split(",") if item.strip()]


def register_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("more vLLM-compatible options")
    group.add_argument(
        "--allowed-origins",
        type=json_list,
        default=["*"],
        metavar="JSON_LIST",
        help="""CORS: origins allowed to call the API from a browser (default '["*"]'; '[]' turns CORS off)""",
    )
    group.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON_LIST", help="CORS methods")
    group.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON_LIST", help="CORS headers")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's launch lines; qserve always parses tool calls with tool_choice 'auto'",
    )
    group.add_argument(
        "--quantization",
        "-q",
        default=None,
        metavar="METHOD",
        help=f"the checkpoint's format, checked against what it declares ({', '.join(QUANTIZATION_FORMATS)}); "
        "default: as declared",
    )
    group.add_argument(
        "--root-path", default=None, help="the path prefix a proxy serves the API under (uvicorn's root_path)"
    )


def cors_config(args: argparse.Namespace) -> object | None:
    """The app's CORS settings, or None when ``--allowed-origins '[]'`` turned CORS off."""
    from qserve.server.cors import CorsConfig

    if not args.allowed_origins:
        return None
    return CorsConfig(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def check_quantization(requested: str | None, detected: str, model: str) -> None:
    """ValueError when ``--quantization`` names a format this checkpoint does not have."""
    if requested is None:
        return
    wanted = QUANTIZATION_FORMATS.get(requested.lower().replace("_", "-").replace("-marlin", "_marlin"))
    if wanted is None:
        raise ValueError(
            f"--quantization {requested}: qserve serves 4-bit {', '.join(QUANTIZATION_FORMATS)} checkpoints only"
        )
    if wanted != detected:
        declared = "is not quantized" if detected == "none" else f"is a {detected} checkpoint"
        raise ValueError(f"--quantization {requested}: model {model!r} {declared} (leave --quantization out)")


def add_speculative_config_argument(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--speculative-config JSON`` (docs/spec_decode.md); checked by the command before
    any model loads (``qserve.spec_decode.parse_speculative_config``)."""
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\'; methods ngram, draft_model, eagle, eagle3 '
        "(default: off; docs/spec_decode.md)",
    )
