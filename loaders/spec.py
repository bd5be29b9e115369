"""``CheckpointSpec``: what a checkpoint's quantization metadata says, as plain frozen data.

Knows: the normalised meaning of GPTQ / AWQ / compressed-tensors quantization configs (method,
bits, groups, symmetry, act-order, zero convention, which modules stay unquantized, GPTQModel
``dynamic`` overrides, compressed-tensors ``config_groups``/``ignore``) and how to answer "is this
HF module quantized, and how" from them. Must not know: files, tensors, or the engine; it is
built by ``loaders.detect`` and read by the converters and ``qserve.layers.quant_methods``.

Only Linear modules inside decoder layers (``q/k/v/o_proj``, ``gate/up/down_proj``) and,
optionally, ``lm_head`` are ever quantized, plus mixture-of-experts linears (``mlp.experts.N.*``,
``mlp.shared_expert.*``); everything else (embeddings, norms, routers) is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METHODS = ("gptq", "awq", "compressed-tensors", "none")
PACK_FORMATS = ("gptq", "awq-gemm", "pack-quantized", "dense")

# HF names of the Linear modules that quantized checkpoints may hold packed.
DECODER_LINEAR_RE = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
)
# Mixture-of-experts linears: routed experts (Qwen names; Mixtral's w1/w3/w2) and Qwen2-MoE's
# shared expert. The router (``mlp.gate``) and ``shared_expert_gate`` are never quantized.
MOE_LINEAR_RE = re.compile(
    r"(^|\.)layers\.\d+\.mlp\.(experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)|"
    r"shared_expert\.(gate_proj|up_proj|down_proj))$"
)
LM_HEAD = "lm_head"


def is_quantizable(hf_module_name: str) -> bool:
    """Whether a module is one qserve may hold quantized (a decoder Linear or ``lm_head``)."""
    return (
        hf_module_name == LM_HEAD
        or bool(DECODER_LINEAR_RE.search(hf_module_name))
        or bool(MOE_LINEAR_RE.search(hf_module_name))
    )


@dataclass(frozen=True, slots=True)
class ModuleQuant:
    """How one quantized Linear module is stored."""

    bits: int
    group_size: int  # as configured: -1 = one group over all of K
    sym: bool
    desc_act: bool  # act-order: a non-trivial g_idx may be present


@dataclass(frozen=True, slots=True)
class DynamicRule:
    """One GPTQModel ``dynamic`` entry: ``-:`` skips matching modules, ``+:`` (or none) overrides."""

    pattern: str  # regex, matched with re.match on the HF module name
    skip: bool
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None
    desc_act: bool | None = None


@dataclass(frozen=True, slots=True)
class CTScheme:
    """One compressed-tensors ``config_groups`` entry (weight-only INT, pack-quantized)."""

    name: str
    targets: tuple[str, ...]  # "Linear", exact module names or "re:<regex>"
    bits: int
    group_size: int  # -1 for strategy "channel"
    sym: bool
    actorder: str | None  # None | "group" | "weight"


def _ct_match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear"  # every module we consider is a Linear


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """Normalised quantization metadata of one checkpoint directory (see ``loaders.detect``)."""

    method: str  # "gptq" | "awq" | "compressed-tensors" | "none"
    bits: int | None = None  # default bits (None when unquantized)
    group_size: int | None = None  # default configured group size; -1 = per-channel
    sym: bool = True
    desc_act: bool = False  # GPTQ desc_act / compressed-tensors actorder == "group"
    zero_convention: str | None = None  # "v1" (stored zero - 1) | "v2" (true zero) | None
    scale_dtype: str | None = None  # "float16" | "bfloat16" | "float32", from a tensor header if known
    model_dtype: str | None = None  # config.json torch_dtype / dtype
    pack_format: str = "dense"  # "gptq" | "awq-gemm" | "pack-quantized" | "dense"
    lm_head_quantized: bool = False
    modules_to_not_convert: tuple[str, ...] = ()  # AWQ: substrings of HF names left unquantized
    modules_in_block_to_quantize: tuple[str, ...] | None = None  # optimum: substrings; None = all
    ignore: tuple[str, ...] = ()  # compressed-tensors: exact names or "re:<regex>"
    dynamic: tuple[DynamicRule, ...] = ()  # GPTQModel overrides, in file order (first match wins)
    ct_schemes: tuple[CTScheme, ...] = ()
    actorder: str | None = None  # compressed-tensors actorder of the default scheme
    source: str = ""  # the file and key the config was read from
    raw: tuple[tuple[str, str], ...] = ()  # the raw config as (key, json) pairs, for display

    @property
    def is_quantized_checkpoint(self) -> bool:
        return self.method != "none"

    def module_quant(self, hf_module_name: str) -> ModuleQuant | None:
        """How ``hf_module_name`` is quantized, or None if it is stored unquantized."""
        if self.method == "none" or not is_quantizable(hf_module_name):
            return None
        name = hf_module_name
        if self.method == "compressed-tensors":
            if any(_ct_match(name, t) for t in self.ignore if t != "Linear"):
                return None
            for scheme in self.ct_schemes:
                if any(_ct_match(name, t) for t in scheme.targets):
                    return ModuleQuant(scheme.bits, scheme.group_size, scheme.sym, scheme.actorder == "group")
            return None
        if name == LM_HEAD and not self.lm_head_quantized:
            return None
        if any(sub in name for sub in self.modules_to_not_convert):
            return None
        if self.modules_in_block_to_quantize is not None and name != LM_HEAD:
            if not any(sub in name for sub in self.modules_in_block_to_quantize):
                return None
        assert self.bits is not None and self.group_size is not None
        quant = ModuleQuant(self.bits, self.group_size, self.sym, self.desc_act)
        for rule in self.dynamic:
            if re.match(rule.pattern, name):
                if rule.skip:
                    return None
                return ModuleQuant(
                    rule.bits if rule.bits is not None else quant.bits,
                    rule.group_size if rule.group_size is not None else quant.group_size,
                    rule.sym if rule.sym is not None else quant.sym,
                    rule.desc_act if rule.desc_act is not None else quant.desc_act,
                )
        return quant

    def is_quantized(self, hf_module_name: str) -> bool:
        return self.module_quant(hf_module_name) is not None

    def bits_for(self, hf_module_name: str) -> int | None:
        quant = self.module_quant(hf_module_name)
        return None if quant is None else quant.bits

    def group_size_for(self, hf_module_name: str) -> int | None:
        quant = self.module_quant(hf_module_name)
        return None if quant is None else quant.group_size
