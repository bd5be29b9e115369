"""Spec-exact test packers: write GPTQ / AWQ GEMM / compressed-tensors checkpoints from float weights.

Knows: round-to-nearest quantization (GPTQ's quantizer grid), and the on-disk bit layouts and
``quantization_config`` dicts of the real producers exactly as shared/docs/formats.md describes
them (GPTQ v1 via GPTQModel's whole-word subtraction with borrow, v2, AWQ's
``[0, 2, 4, 6, 1, 3, 5, 7]`` nibble interleave, compressed-tensors' ``[N, K/pf]`` packing of
``q + 2^(b-1)`` and ``[N/pf, ng]`` zero points). Deliberately independent of ``loaders`` (its own
bit packing, int64 arithmetic) so that tests compare two implementations of the spec.
Must not know: qserve internals.

Every packer returns the float dequantized weight ``scale * (q - z)`` in input order ([K, N],
float32), which is what loading must reproduce bit-exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
DECODER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$")


@dataclass
class Quantized:
    """RTN result for one weight W [K, N] (input-major)."""

    bits: int
    group_size: int  # as configured (-1 = per-channel)
    codes: torch.Tensor  # int64 [K, N], unsigned in [0, 2^bits - 1]
    scales: torch.Tensor  # [ng, N], stored dtype
    zeros: torch.Tensor  # int64 [ng, N], true zero point (2^(bits-1) for sym)
    g_idx: torch.Tensor  # int64 [K], group of each input row
    dequant: torch.Tensor  # float32 [K, N] = scales[g_idx] * (codes - zeros[g_idx])


def rtn_quantize(
    w: torch.Tensor,  # [K, N]
    bits: int,
    group_size: int,
    sym: bool,
    scale_dtype: torch.dtype = torch.float16,
    act_order_seed: int | None = None,
) -> Quantized:
    """GPTQ-grid RTN. With ``act_order_seed`` the groups are a shuffled g_idx (act-order)."""
    w = w.detach().to(torch.float32)
    num_rows, num_cols = w.shape
    geff = num_rows if group_size == -1 else group_size
    num_groups = -(-num_rows // geff)
    g_idx = torch.arange(num_rows) // geff  # [K]
    if act_order_seed is not None:
        gen = torch.Generator().manual_seed(act_order_seed)
        g_idx = g_idx[torch.randperm(num_rows, generator=gen)]
    maxq = (1 << bits) - 1
    scales = torch.empty(num_groups, num_cols, dtype=scale_dtype)
    zeros = torch.empty(num_groups, num_cols, dtype=torch.int64)
    codes = torch.empty(num_rows, num_cols, dtype=torch.int64)
    for g in range(num_groups):
        rows = (g_idx == g).nonzero().flatten()
        block = w[rows]  # [G, N]
        xmin = block.min(0).values.clamp(max=0)
        xmax = block.max(0).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        scale = (xmax - xmin) / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(scale_dtype)
        s32 = scale.to(torch.float32)
        zero = (
            torch.full_like(xmin, (maxq + 1) // 2, dtype=torch.int64)
            if sym
            else torch.round(-xmin / s32).to(torch.int64).clamp(0, maxq)
        )
        scales[g], zeros[g] = scale, zero
        codes[rows] = torch.clamp(torch.round(block / s32).to(torch.int64) + zero, 0, maxq)
    dequant = scales.to(torch.float32)[g_idx] * (codes - zeros[g_idx]).to(torch.float32)
    return Quantized(bits, group_size, codes, scales, zeros, g_idx, dequant)


# ----------------------------------------------------------------------------------------------
# bit packing (independent of loaders)
# ----------------------------------------------------------------------------------------------


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_last(vals: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack along the last dim: int64 [..., L] -> int32 [..., L/pf]; slot i holds element order[i]."""
    pf = 32 // bits
    order = order or list(range(pf))
    grouped = vals.to(torch.int64).reshape(*vals.shape[:-1], -1, pf)  # [..., L/pf, pf]
    words = torch.zeros(grouped.shape[:-1], dtype=torch.int64)
    for slot, col in enumerate(order):
        words |= grouped[..., col] << (bits * slot)
    return _to_int32(words)


def pack_gptq(q: Quantized, *, v1: bool, write_g_idx: bool = True) -> dict[str, torch.Tensor]:
    """GPTQ tensors for one Linear: qweight [K/pf, N], qzeros [ng, N/pf], scales [ng, N], g_idx [K]."""
    bits = q.bits
    qweight = _pack_last(q.codes.t(), bits).t().contiguous()  # [K/pf, N]
    words = _pack_last(q.zeros, bits).to(torch.int64) & 0xFFFFFFFF  # v2 words [ng, N/pf]
    if v1:  # GPTQModel convert_gptq_v2_to_v1_format: whole-word subtraction (borrows on a zero of 0)
        words = words - {4: 0x11111111, 8: 0x01010101}[bits]
    out = {"qweight": qweight, "qzeros": _to_int32(words), "scales": q.scales.clone()}
    if write_g_idx:
        out["g_idx"] = q.g_idx.to(torch.int32)
    return out


def pack_awq(q: Quantized) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors: qweight [K, N/8] and qzeros [ng, N/8] interleaved, scales [ng, N]."""
    assert q.bits == 4
    return {
        "qweight": _pack_last(q.codes, 4, AWQ_ORDER),
        "qzeros": _pack_last(q.zeros, 4, AWQ_ORDER),
        "scales": q.scales.clone(),
    }


def pack_ct(q: Quantized, *, sym: bool, actorder: str | None) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors (torch [N, K] orientation)."""
    bits = q.bits
    num_rows, num_cols = q.codes.shape
    out = {
        "weight_packed": _pack_last(q.codes.t(), bits),  # [N, K/pf], nibble = q_signed + 2^(b-1)
        "weight_scale": q.scales.t().contiguous(),  # [N, ng]
        "weight_shape": torch.tensor([num_cols, num_rows], dtype=torch.int64),
    }
    if not sym:
        out["weight_zero_point"] = _pack_last(q.zeros, bits).t().contiguous()  # [N/pf, ng], unsigned zero
    if actorder == "group":
        out["weight_g_idx"] = q.g_idx.to(torch.int32)
    return out


# ----------------------------------------------------------------------------------------------
# quantization_config dicts, as the tools write them
# ----------------------------------------------------------------------------------------------


def gptq_config(
    bits: int = 4,
    group_size: int = 128,
    *,
    sym: bool = True,
    desc_act: bool = False,
    v2: bool = False,
    lm_head: bool = False,
    dynamic: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    fmt = "gptq_v2" if v2 else "gptq"
    cfg: dict[str, Any] = {
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "lm_head": lm_head,
        "quant_method": "gptq",
        "checkpoint_format": fmt,
        "format": fmt,
        "pack_dtype": "int32",
        "damp_percent": 0.05,
        "true_sequential": True,
        "static_groups": False,
        "meta": {"quantizer": ["gptqmodel:4.0.0"], "uri": "https://github.com/modelcloud/gptqmodel"},
    }
    if dynamic:
        cfg["dynamic"] = dynamic
    return cfg


def awq_config(
    group_size: int = 128, *, zero_point: bool = True, modules_to_not_convert: list[str] | None = None
) -> dict[str, Any]:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": zero_point,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }


def ct_config(
    bits: int = 4,
    group_size: int | None = 128,
    *,
    sym: bool = True,
    actorder: str | None = None,
    ignore: list[str] | None = None,
) -> dict[str, Any]:
    strategy = "channel" if group_size in (None, -1) else "group"
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": bits,
                    "type": "int",
                    "symmetric": sym,
                    "strategy": strategy,
                    "group_size": None if strategy == "channel" else group_size,
                    "actorder": actorder,
                    "dynamic": False,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "block_structure": None,
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"] if ignore is None else ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": "0.12.0",
    }


# ----------------------------------------------------------------------------------------------
# checkpoint directories
# ----------------------------------------------------------------------------------------------


def write_checkpoint(
    path: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    num_shards: int = 1,
    config_file_extra: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Write config.json (+ any extra JSON files) and single or sharded safetensors."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    for fname, content in (config_file_extra or {}).items():
        (root / fname).write_text(json.dumps(content, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(root / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return root


@dataclass
class QuantizedModel:
    tensors: dict[str, torch.Tensor]  # what goes on disk
    dequant: dict[str, torch.Tensor]  # HF Linear name -> float32 [N, K] dequantized (torch orientation)


def quantize_state_dict(
    state: dict[str, torch.Tensor],
    fmt: str,
    *,
    bits: int = 4,
    group_size: int = 32,
    sym: bool = True,
    v1: bool = True,
    act_order: bool = False,
    actorder: str | None = None,
    scale_dtype: torch.dtype = torch.float16,
    skip: tuple[str, ...] = (),
    quantize_lm_head: bool = False,
    dense_dtype: torch.dtype | None = None,
    share_fused_g_idx: bool = True,
) -> QuantizedModel:
    """Quantize every decoder Linear (and optionally lm_head) of an HF state dict into ``fmt``.

    ``fmt``: "gptq" | "awq" | "ct". Modules whose name contains a string in ``skip`` stay dense.
    With act-order, q/k/v (and gate/up) share one shuffled g_idx as real GPTQ produces (they see the
    same inputs) unless ``share_fused_g_idx`` is False.
    """
    tensors: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for index, (name, value) in enumerate(state.items()):
        module = name.removesuffix(".weight")
        quantize = name.endswith(".weight") and (
            DECODER_LINEAR.search(module) is not None or (quantize_lm_head and module == "lm_head")
        )
        if quantize and any(s in module for s in skip):
            quantize = False
        if not quantize:
            tensors[name] = (
                value.detach().to(dense_dtype) if dense_dtype and value.is_floating_point() else value.detach()
            )
            continue
        w = value.detach().t().to(torch.float32)  # [K, N]
        seed = None
        if act_order or actorder == "group":
            group_key = re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", module))
            seed = 1000 + (sum(map(ord, group_key)) * 31 + len(group_key) if share_fused_g_idx else index)
        q = rtn_quantize(w, bits, group_size, sym, scale_dtype, act_order_seed=seed)
        dequant[module] = q.dequant.t().contiguous()
        if fmt == "gptq":
            packed = pack_gptq(q, v1=v1)
        elif fmt == "awq":
            packed = pack_awq(q)
        elif fmt == "ct":
            packed = pack_ct(q, sym=sym, actorder=actorder)
        else:
            raise ValueError(fmt)
        tensors.update({f"{module}.{suffix}": t for suffix, t in packed.items()})
    return QuantizedModel(tensors, dequant)


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    """A tiny Llama config dict (what ``LlamaConfig.to_dict()`` gives, trimmed)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    cfg.update(overrides)
    return cfg


def random_llama_state(
    config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float16
) -> dict[str, torch.Tensor]:
    """A random state dict with HF Llama names for ``config`` (no transformers needed)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)

    state = {"model.embed_tokens.weight": rnd(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        state[f"{p}.self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        state[f"{p}.self_attn.k_proj.weight"] = rnd(kv * head_dim, hidden)
        state[f"{p}.self_attn.v_proj.weight"] = rnd(kv * head_dim, hidden)
        state[f"{p}.self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        state[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        state[f"{p}.mlp.gate_proj.weight"] = rnd(inter, hidden)
        state[f"{p}.mlp.up_proj.weight"] = rnd(inter, hidden)
        state[f"{p}.mlp.down_proj.weight"] = rnd(hidden, inter)
    state["model.norm.weight"] = torch.ones(hidden, dtype=dtype)
    if not config.get("tie_word_embeddings"):
        state["lm_head.weight"] = rnd(config["vocab_size"], hidden)
    return state
