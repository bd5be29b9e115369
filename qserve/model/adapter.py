"""The family adapter: what each non-Llama family declares so the one decoder can serve it, and
the small helpers adapters use to read their ``config.json`` with errors that name the field.

Knows: the shape of an adapter (its architectures, config translation, checkpoint name map, one
line for the README) and how a config field is required or refused. Must not know: which
families exist (``qserve.model.registry`` lists them), tensors, devices, checkpoint formats.
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
