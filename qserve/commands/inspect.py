"""``qserve inspect MODEL``: what a checkpoint is and what serving it will cost, without loading it.

First it runs the checks ``qserve serve`` runs (``qserve.model.checkpoint_check``: config,
architecture, format, tensor shapes and dtypes, tokenizer; and, unless ``--headers-only``, every
tensor streamed through the loaders on the ``meta`` device: non-finite values, scales/zeros
shapes) and exits non-zero with a one-line error if the checkpoint would not serve: a directory
without tokenizer files is refused as ``serve`` refuses it (``--skip-tokenizer-init``, vLLM's
name, describes a weights-only directory).

Knows: how to present ``loaders.detect`` / ``loaders.inventory`` results (format, bits, groups,
symmetry, act-order, zero convention, which modules are quantized, weight bytes as qserve holds
them, KV bytes per token per KV dtype) as text or one JSON object. Must not know: format details
(``loaders`` owns them) or the engine.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import loaders
from loaders.inventory import inventory
from qserve.model.hub import add_revision_argument, resolve_model_path

KV_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory (config.json + safetensors)")
    add_revision_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--headers-only",
        action="store_true",
        help="check metadata and tensor headers only (do not read tensor data: faster on large checkpoints)",
    )
    parser.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="do not check the tokenizer (a weights-only directory; serving it needs a tokenizer)",
    )


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def describe(path: str) -> dict[str, Any]:
    """Everything ``inspect`` prints, as plain JSON-able data."""
    from qserve.model.registry import checkpoint_view  # noqa: PLC0415

    spec = loaders.detect(path)
    raw = loaders.weights.read_config(path)
    view = checkpoint_view(raw, f"{path}/config.json")  # other families: their Llama-style view
    inv = inventory(path, spec, view)
    cfg = _text_config(inv.config)
    num_heads = int(cfg.get("num_attention_heads") or 0)
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size", 0)) // num_heads if num_heads else 0))
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    kv = {name: 2 * num_layers * num_kv_heads * head_dim * size for name, size in KV_DTYPE_BYTES.items()}
    kv["int4"] = 2 * num_layers * num_kv_heads * (head_dim // 2 + 4)  # packed codes + fp16 scale and zero per row
    quantized = dict(sorted(inv.quantized_counts.items()))
    return {
        "model": str(path),
        "architecture": (raw.get("architectures") or [None])[0],
        "format": spec.method,
        "pack_format": spec.pack_format,
        "config_source": spec.source,
        "bits": spec.bits,
        "group_size": spec.group_size,
        "sym": spec.sym if spec.method != "none" else None,
        "act_order": spec.desc_act,
        "act_order_layers": inv.act_order_layers,
        "zero_convention": spec.zero_convention,
        "scale_dtype": spec.scale_dtype,
        "model_dtype": spec.model_dtype,
        "lm_head_quantized": quantized.get("lm_head", 0) > 0,
        "quantized_modules": quantized,
        "num_quantized_modules": sum(quantized.values()),
        "unquantized_linear_modules": dict(sorted(inv.unquantized_linear_counts.items())),
        "dynamic_overrides": [("-:" if r.skip else "+:") + r.pattern for r in spec.dynamic],
        "weight_bytes": inv.weight_bytes,
        "quantized_weight_bytes": inv.quantized_bytes,
        "dense_weight_bytes": inv.dense_bytes,
        "checkpoint_bytes": inv.checkpoint_bytes,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "kv_bytes_per_token": kv,
    }


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def run(args: argparse.Namespace) -> int:
    args.model = resolve_model_path(args.model, args.revision)  # a Hub id: its cached snapshot
    from qserve.model.checkpoint_check import check_checkpoint

    # The same checks as serve, tokenizer included (a directory serve refuses never passes here).
    tokenizer = not args.skip_tokenizer_init
    check_checkpoint(args.model, tokenizer=tokenizer, tensors=not args.headers_only)  # ValueError: one line, exit 2
    info = describe(args.model)
    info["tokenizer"] = tokenizer
    if args.json:
        print(json.dumps(info, sort_keys=False))
        return 0
    quantized = ", ".join(f"{k} x{v}" for k, v in info["quantized_modules"].items()) or "none"
    dense = ", ".join(f"{k} x{v}" for k, v in info["unquantized_linear_modules"].items()) or "none"
    lines = [
        f"model:            {info['model']}",
        f"architecture:     {info['architecture']}",
        f"format:           {info['format']} ({info['pack_format']}; from {info['config_source']})",
        f"bits:             {info['bits']}",
        f"group size:       {info['group_size']}",
        f"sym:              {info['sym']}",
        f"act-order:        {info['act_order']} ({info['act_order_layers']} layers with a permutation)",
        f"zero convention:  {info['zero_convention']}",
        f"scale dtype:      {info['scale_dtype']}   model dtype: {info['model_dtype']}",
        f"quantized:        {quantized}",
        f"unquantized lin.: {dense}",
        f"lm_head:          {'quantized' if info['lm_head_quantized'] else 'not quantized'}",
        f"weights in qserve:{_human(info['weight_bytes']):>12}  (quantized {_human(info['quantized_weight_bytes'])}, "
        f"dense {_human(info['dense_weight_bytes'])}; on disk {_human(info['checkpoint_bytes'])})",
        "KV per token:     " + ", ".join(f"{k} {v} B" for k, v in info["kv_bytes_per_token"].items()),
    ]
    if not info["tokenizer"]:
        lines.append("tokenizer:        not checked (--skip-tokenizer-init; serving it needs one)")
    if info["dynamic_overrides"]:
        lines.append(f"dynamic:          {', '.join(info['dynamic_overrides'])}")
    print("\n".join(lines))
    return 0
