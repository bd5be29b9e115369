"""The model registry: HF ``architectures`` name -> family adapter.

Knows: which families qserve serves and, per family, three things (see families.md): how its
``config.json`` translates into the Llama-style config the one decoder reads, how its checkpoint
tensor names map onto that decoder's HF-Llama names (including row slices of fused tensors such
as Qwen's ``c_attn`` or Baichuan's ``W_pack``), and which declared behaviours it switches on
(``ModelConfig`` fields: partial / interleaved rotary, ALiBi, normalized lm_head, dynamic NTK +
logn, sandwich norms). Every family runs through ``qserve.model.llama``; there is no second
decoder. Must not know: tensors, devices, checkpoint formats (``loaders`` applies the name map).

``model_config`` / ``read_model_config`` are how the rest of qserve reads any checkpoint's
config: plain Llama-family names (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) go straight to
``ModelConfig.from_hf``; the other families are translated by their adapter first. ``config``
itself knows no family but Llama's, so it imports nothing from here.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from qserve.config import SUPPORTED_ARCHITECTURES, ModelConfig
from qserve.model.adapter import FamilyAdapter


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


def model_config(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The ``ModelConfig`` of any supported ``config.json`` (translated first for non-Llama families)."""
    architectures = cfg.get("architectures") or []
    if any(name in SUPPORTED_ARCHITECTURES for name in architectures):
        return ModelConfig.from_hf(cfg, source)
    translated = translate_config(cfg, source)
    if translated is None:
        raise ValueError(
            f"{source}: architecture {architectures or cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    canonical, behaviours = translated
    config = ModelConfig.from_hf(canonical, source)
    return replace(config, architecture=behaviours.pop("architecture"), raw=cfg, **behaviours)


def read_model_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint directory; every user error is one line naming the file
    and the field (no traceback)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    try:
        cfg = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(cfg).__name__}")
    try:
        return model_config(cfg, source=str(config_path))
    except KeyError as err:
        raise ValueError(f"{config_path}: required field {err.args[0]!r} is missing") from None
    except (TypeError, ValueError, ZeroDivisionError) as err:
        if str(err).startswith(str(config_path)):
            raise
        raise ValueError(f"{config_path}: a field has an invalid value ({err})") from None
