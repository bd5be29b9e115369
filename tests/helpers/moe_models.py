"""Tiny random mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral) with their native
transformers model as the oracle, unquantized or as GPTQ / AWQ / compressed-tensors W4A16.

Knows: the per-expert names these families' checkpoints use on disk (``mlp.experts.N.gate_proj``,
Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2``), which transformers 5 fuses in memory
(``experts.gate_up_proj`` [E, 2I, H] gate rows first, ``experts.down_proj`` [E, H, I]). Quantized
checkpoints quantize every attention, dense-MLP, expert and shared-expert linear with
``tests.helpers.quant_packers`` and write the dequantized weights back into the oracle, keeping
the router (``mlp.gate``) and ``shared_expert_gate`` 16-bit; ``load_into_oracle`` puts a
checkpoint's float (or dequantized) tensors back into the oracle. Must not know: qserve internals.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import transformers

from tests.helpers.quant_packers import (
    awq_config,
    ct_config,
    gptq_config,
    pack_awq,
    pack_ct,
    pack_gptq,
    rtn_quantize,
    write_checkpoint,
)
from tests.helpers.tokenizer import make_tokenizer

_CONFIGS = {
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, head_dim=16,
                                                    norm_topk_prob=True, mlp_only_layers=[0])),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(num_experts=8, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=8, intermediate_size=32, sliding_window=None)),
}  # fmt: skip


def moe_oracle(architecture: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    tokenizer = make_tokenizer()
    config_name, extra = _CONFIGS[architecture]
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.3 if name.endswith("mlp.gate.weight") else 0.08)  # routers: well-separated top-k
            elif "bias" in name:
                param.normal_(0, 0.02)
            else:  # norms: not all ones, so that a missing or misplaced norm shows
                param.uniform_(0.5, 1.5)
    return model


def expert_names(architecture: str) -> tuple[str, str, str, str]:
    """(block name on disk, gate, up, down)."""
    if architecture == "MixtralForCausalLM":
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def checkpoint_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's state in its on-disk names (per-expert linears, torch orientation [N, K])."""
    arch = model.config.architectures[0]
    block, gate, up, down = expert_names(arch)
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        value = value.detach().clone()
        match = re.match(r"^(model\.layers\.\d+)\.mlp\.(.+)$", name)
        if match is None:
            out[name] = value
            continue
        layer, rest = match.groups()
        if rest == "experts.gate_up_proj":
            for e, fused in enumerate(value):
                g, u = fused.chunk(2)
                out[f"{layer}.{block}.experts.{e}.{gate}.weight"] = g.clone()
                out[f"{layer}.{block}.experts.{e}.{up}.weight"] = u.clone()
        elif rest == "experts.down_proj":
            for e, w in enumerate(value):
                out[f"{layer}.{block}.experts.{e}.{down}.weight"] = w.clone()
        else:
            out[f"{layer}.{block}.{rest}"] = value
    return out


_QUANTIZED = re.compile(
    r"\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj|(mlp|block_sparse_moe)\.experts\.\d+\.\w+|"
    r"mlp\.shared_expert\.(gate|up|down)_proj)\.weight$"
)


def save_moe(
    model: transformers.PreTrainedModel,
    path: Path,
    fmt: str = "none",
    group_size: int = 32,
    sym: bool = True,
    act_order: bool = False,
) -> Path:
    """Write ``model`` as a checkpoint (``fmt``: none | gptq | awq | ct). Quantized formats
    overwrite ``model``'s weights with their dequantized values, so it stays the oracle. GPTQ
    ``act_order``: a shuffled g_idx per linear, shared by each expert's gate and up (one input)."""
    tensors = checkpoint_tensors(model)
    config = model.config.to_dict()
    if fmt != "none":
        dequant: dict[str, torch.Tensor] = {}
        for name in [n for n in tensors if _QUANTIZED.search(n)]:
            module = name.removesuffix(".weight")
            seed = None
            if act_order:  # gate and up of one module see the same input: one permutation
                key = re.sub(r"(gate_proj|up_proj|w1|w3)$", "gate_up", module)
                seed = sum(map(ord, key)) * 31 + len(key)
            q = rtn_quantize(tensors.pop(name).t(), 4, group_size, sym=sym, act_order_seed=seed)
            packed = _pack(q, fmt, sym)
            tensors.update({f"{module}.{suffix}": t for suffix, t in packed.items()})
            dequant[module] = q.dequant.t().contiguous()  # [N, K]
        _write_back(model, dequant)
        not_convert = ["gate"] if model.config.architectures[0] == "MixtralForCausalLM" else None
        config["quantization_config"] = {
            "gptq": lambda: gptq_config(group_size=group_size, sym=sym, desc_act=act_order),
            # AutoAWQ's Mixtral releases keep the router out by the substring "gate" (safe: w1/w2/w3)
            "awq": lambda: awq_config(group_size=group_size, zero_point=not sym, modules_to_not_convert=not_convert),
            "ct": lambda: ct_config(group_size=group_size, sym=sym, ignore=["lm_head", "re:.*mlp.gate$"]),
        }[fmt]()
    config["dtype"] = "float32"
    write_checkpoint(path, config, tensors)
    make_tokenizer(str(path))
    return Path(path)


def _pack(q, fmt: str, sym: bool) -> dict[str, torch.Tensor]:  # noqa: ANN001 - a quant_packers.Quantized
    if fmt == "gptq":
        return pack_gptq(q, v1=True)
    if fmt == "awq":
        return pack_awq(q)
    return pack_ct(q, sym=sym, actorder=None)


def _write_back(model: transformers.PreTrainedModel, dequant: dict[str, torch.Tensor]) -> None:
    block, gate, up, down = expert_names(model.config.architectures[0])
    state = model.state_dict()
    with torch.no_grad():
        for module, weight in dequant.items():
            match = re.match(rf"^(model\.layers\.\d+)\.{block}\.experts\.(\d+)\.(\w+)$", module)
            if match is None:
                state[f"{module}.weight"].copy_(weight)
                continue
            layer, e, proj = match.group(1), int(match.group(2)), match.group(3)
            inter = weight.shape[0] if proj != down else weight.shape[1]
            if proj == down:
                state[f"{layer}.mlp.experts.down_proj"][e].copy_(weight)
            else:
                rows = slice(0, inter) if proj == gate else slice(inter, 2 * inter)
                state[f"{layer}.mlp.experts.gate_up_proj"][e, rows].copy_(weight)


def load_into_oracle(model: transformers.PreTrainedModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy float tensors under their on-disk names (``checkpoint_tensors``'s, every linear's
    ``.weight`` in torch orientation ``[N, K]``) into ``model``: the oracle of a checkpoint that
    someone else quantized (dequantized linears plus its norms and routers as written)."""
    block = expert_names(model.config.architectures[0])[0]
    expected = checkpoint_tensors(model)
    if set(tensors) != set(expected):
        raise ValueError(f"tensor names differ from the model's: {sorted(set(tensors) ^ set(expected))[:6]}")
    linears = {n.removesuffix(".weight"): t.float() for n, t in tensors.items() if _QUANTIZED.search(n)}
    _write_back(model, linears)
    state = model.state_dict()
    with torch.no_grad():
        for name, value in tensors.items():
            if not _QUANTIZED.search(name):
                state[name.replace(f".{block}.", ".mlp.")].copy_(value.float())
