"""PEFT-format LoRA adapter directories for tests, written without peft, plus the merged reference.

Knows: PEFT's file names, tensor names (``base_model.model.<module>.lora_A.weight`` ``[r, in]``,
``.lora_B.weight`` ``[out, r]``) and ``adapter_config.json`` fields, and LoRA's math: merging
``W + scale * B @ A`` into a dense weight is the adapter's exact effect. Must not know: qserve internals.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def projection_shapes(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """HF projection -> (in_features, out_features) of a Llama-style layer."""
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_peft_adapter(
    path: str | Path,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    *,
    targets: tuple[str, ...],
    rank: int,
    alpha: float,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
    config_extra: dict | None = None,
    layers: tuple[int, ...] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Write a random adapter; returns HF module name -> (A [r, in], B [out, r], scale), float32."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    tensors: dict[str, torch.Tensor] = {}
    result = {}
    for layer in layers if layers is not None else range(num_layers):
        for proj in targets:
            module = f"model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            k, n = shapes[proj]
            a = torch.randn(rank, k, generator=gen) * std
            b = torch.randn(n, rank, generator=gen) * std
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            result[module] = (a, b, scale)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": use_rslora,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": "tiny-test-base",
    }
    config.update(config_extra or {})
    (root / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "adapter_model.safetensors"))
    return result


def merged_state_dict(
    state: dict[str, torch.Tensor], adapter: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
) -> dict[str, torch.Tensor]:
    """``state`` (HF names, dense float weights) with ``W + scale * B @ A`` for every adapted module."""
    merged = dict(state)
    for module, (a, b, scale) in adapter.items():
        name = f"{module}.weight"
        merged[name] = (state[name].double() + scale * (b.double() @ a.double())).to(state[name].dtype)
    return merged
