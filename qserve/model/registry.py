"""The model registry: HF ``architectures`` name -> family adapter.

Knows: which families qserve serves and, per family, three things (see families.md): how its
``config.json`` translates into the Llama-style config the one decoder reads, how its checkpoint
tensor names map onto that decoder's HF-Llama names (including row slices of fused tensors such
as Qwen's ``c_attn`` or Baichuan's ``W_pack``), and which declared behaviours it switches on
(``ModelConfig`` fields: partial / interleaved rotary, ALiBi, normalized lm_head, dynamic NTK +
logn, sandwich norms). Every family runs through ``qserve.model.llama``; there is no second
decoder. Must not know: tensors, devices, checkpoint formats (``loaders`` applies the name map).

Plain Llama-family names (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) are read by
``ModelConfig.from_hf`` directly; ``translate_config`` only handles the other families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loaders.renamed import ModuleTarget

# (source module prefix, the translated config) -> where its rows go; [] drops the tensor.
ModuleMap = Callable[[str, dict[str, Any]], list[ModuleTarget] | None]
# (raw config.json, its path for messages) -> (Llama-style config, ModelConfig behaviour fields)
Translate = Callable[[dict[str, Any], str], tuple[dict[str, Any], dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class FamilyAdapter:
    family: str
    architectures: tuple[str, ...]
    needs: str  # one line for the README's architecture table
    translate: Translate
    module_map: ModuleMap | None  # None: the checkpoint already uses the decoder's names


def _families() -> list[FamilyAdapter]:
    from qserve.model.families import baichuan, chatglm, glm, moe, qwen  # noqa: PLC0415 - keeps import light

    return [
        qwen.ADAPTER,
        chatglm.ADAPTER,
        glm.GLM_ADAPTER,
        glm.GLM4_ADAPTER,
        baichuan.ADAPTER,
        moe.QWEN3_MOE_ADAPTER,
        moe.QWEN2_MOE_ADAPTER,
        moe.MIXTRAL_ADAPTER,
    ]


def llama_family_architectures() -> tuple[str, ...]:
    from qserve.config import SUPPORTED_ARCHITECTURES  # noqa: PLC0415

    return tuple(SUPPORTED_ARCHITECTURES)


def supported_architectures() -> list[str]:
    """Every ``architectures`` name qserve loads."""
    names = list(llama_family_architectures())
    for adapter in _families():
        names.extend(adapter.architectures)
    return names


def adapter_for(cfg: dict[str, Any]) -> FamilyAdapter | None:
    """The adapter of a non-Llama config (by its ``architectures`` list), or None."""
    names = cfg.get("architectures") or []
    for adapter in _families():
        if any(name in adapter.architectures for name in names):
            return adapter
    return None


def translate_config(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(Llama-style config, behaviour fields incl. ``architecture`` and ``family``) or None."""
    adapter = adapter_for(cfg)
    if adapter is None:
        return None
    canonical, behaviours = adapter.translate(cfg, source)
    arch = next(a for a in cfg["architectures"] if a in adapter.architectures)
    return canonical, {**behaviours, "architecture": arch, "family": adapter.family}


def checkpoint_view(cfg: dict[str, Any], source: str = "config.json"):  # noqa: ANN201 - loaders.CheckpointView | None
    """The name map ``loaders`` applies to this checkpoint's tensors (None for Llama names)."""
    from loaders.renamed import CheckpointView  # noqa: PLC0415

    adapter = adapter_for(cfg)
    if adapter is None:
        return None
    canonical, _ = adapter.translate(cfg, source)
    if adapter.module_map is None:
        return CheckpointView(config=canonical, module_map=None)
    module_map = adapter.module_map
    return CheckpointView(config=canonical, module_map=lambda prefix: module_map(prefix, canonical))


def architecture_table() -> list[tuple[str, str, str]]:
    """(architecture, family, what it needs) rows, for the README and ``qserve inspect``."""
    rows = [(name, "llama", "Llama-style names; the reference layout") for name in llama_family_architectures()]
    for adapter in _families():
        rows.extend((name, adapter.family, adapter.needs) for name in adapter.architectures)
    return rows


def require(cfg: dict[str, Any], source: str, *keys: str) -> Any:
    """The first of ``keys`` present in ``cfg`` (aliases), or a refusal naming them all."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise ValueError(f"{source}: field {' / '.join(repr(k) for k in keys)} is missing")


def refuse_unless(cond: bool, source: str, field: str, value: Any, supported: str) -> None:
    if not cond:
        raise ValueError(f"{source}: {field}={value!r} is not supported; supported: {supported}")


def torch_dtype_name(cfg: dict[str, Any]) -> str:
    """Remote-code configs declare dtype by flags (Qwen: bf16/fp16/fp32) or ``torch_dtype``."""
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    if name:
        return str(name)
    for flag, dtype in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        if cfg.get(flag):
            return dtype
    return "bfloat16"
