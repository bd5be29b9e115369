"""Sliding-window perplexity of a text under any checkpoint qserve loads (computed by qserve itself).

Knows: the ``qserve eval-ppl`` arguments. Must not know: the windowing math
(``qserve.quantize.perplexity``) or the engine's insides (it uses the offline ``LLM`` API).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from qserve.model.hub import add_revision_argument, resolve_model_path


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory (fp16, GPTQ, AWQ, compressed-tensors)")
    add_revision_argument(parser)
    parser.add_argument("--text", required=True, help="a UTF-8 text file to score")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per window")
    parser.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "int8", "int4"],
        help="KV cache storage (auto: the model dtype); scores what the cache does to quality",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    args.model = resolve_model_path(args.model, args.revision)  # a Hub id: its cached snapshot
    from qserve import LLM
    from qserve.quantize.perplexity import perplexity, qserve_scorer

    text_path = Path(args.text)
    if not text_path.is_file():
        raise ValueError(f"--text {text_path} does not exist")
    start = time.perf_counter()
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_length + 1,
        enable_prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    token_ids = llm.get_tokenizer()(text_path.read_text(encoding="utf-8"))["input_ids"]
    if args.max_tokens:
        token_ids = token_ids[: args.max_tokens]
    result = perplexity(token_ids, qserve_scorer(llm), args.max_length, args.stride)
    seconds = time.perf_counter() - start
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "text": str(text_path),
                    "perplexity": result.perplexity,
                    "nll": result.nll,
                    "tokens_scored": result.num_scored,
                    "windows": result.num_windows,
                    "seconds": seconds,
                }
            )
        )
    else:
        print(
            f"perplexity {result.perplexity:.3f} (nll {result.nll:.4f} nats/token) over {result.num_scored} tokens, "
            f"{result.num_windows} windows of {args.max_length} (stride {args.stride}), {seconds:.1f} s"
        )
    return 0
