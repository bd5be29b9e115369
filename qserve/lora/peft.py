"""Read a PEFT LoRA adapter directory and lay it out for qserve's adapter slots.

Knows: PEFT's files (``adapter_config.json``, ``adapter_model.safetensors``), its tensor names
(``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]``), its
scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``), and which of its
options qserve serves: plain LoRA on the decoder's q/k/v/o/gate/up/down projections (and the fused
``qkv_proj`` / ``gate_up_proj`` names some models use). Everything else is refused with a message
naming the field (DoRA, biases, ``modules_to_save``, per-module rank or alpha patterns, a rank past
``--max-lora-rank``, a target qserve does not adapt, a shape the base model does not have). Must not
know: the engine, devices, the kernels.

Layout produced (``quant_kernels.reference_lora``): per target layer, ``a`` ``[S * R, K]`` (slice s's
A in rows ``s*R : s*R + r``) and ``b`` ``[N, R]`` (slice s's B times the scale in its rows), R the
maximum rank, zero elsewhere. A PEFT module of one projection fills one slice of a fused layer; a
module that is itself fused (``qkv_proj``) shares its A between the slices and splits its B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Per-projection module names and the fused names, as the base model's layers hold them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_NAMES = ("qkv_proj", "gate_up_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# adapter_config.json fields that change the math and that qserve does not implement: refused
# when set to anything but their "off" values.
_REFUSED_WHEN_SET = {
    "use_dora": "DoRA adapters (use_dora) are not supported; only plain LoRA is",
    "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2 Conv1D layers) are not supported",
    "modules_to_save": "modules_to_save (full copies of base layers) is not supported; only LoRA matrices are",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported; only on linear layers",
    "trainable_token_indices": "trainable embedding tokens (trainable_token_indices) are not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
}


@dataclass(frozen=True)
class TargetLayer:
    """A base-model layer LoRA may adapt: its input size and output slices (one per HF projection)."""

    name: str  # qserve's module name, e.g. model.layers.0.self_attn.qkv_proj
    in_features: int
    slice_names: tuple[str, ...]  # HF module names of the slices (q_proj, k_proj, v_proj) in order
    slice_sizes: tuple[int, ...]

    @property
    def slice_starts(self) -> tuple[int, ...]:
        starts = [0]
        for size in self.slice_sizes:
            starts.append(starts[-1] + size)
        return tuple(starts)


@dataclass
class LoRAAdapter:
    """One adapter in slot layout (host memory), ready to copy into a slot."""

    name: str
    path: str
    rank: int  # the adapter's r
    scale: float
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer name -> (a [S*R, K], b [N, R])

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.layers.values())


class AdapterError(ValueError):
    """An adapter qserve cannot serve; the message names the file and the field."""


def read_adapter_config(path: Path) -> dict:
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterError(f"LoRA adapter {path}: not a directory (lora_path must be a PEFT adapter directory)")
    if not config_path.is_file():
        raise AdapterError(f"LoRA adapter {path}: no {CONFIG_FILE} (is it a PEFT adapter directory?)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as err:
        raise AdapterError(f"LoRA adapter {config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter {config_path}: expected a JSON object")
    return config


def check_adapter_config(config: dict, where: Path, max_rank: int) -> tuple[int, float]:
    """``(r, scale)`` of a supported config; AdapterError naming the field otherwise."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"LoRA adapter {where}: field 'peft_type' is {peft_type!r}; only LORA adapters are served")
    for field, message in _REFUSED_WHEN_SET.items():
        if config.get(field):
            raise AdapterError(f"LoRA adapter {where}: field {field!r} is set: {message}")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"LoRA adapter {where}: field 'bias' is {bias!r}; only 'none' is supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"LoRA adapter {where}: field 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"LoRA adapter {where}: field 'r' is {rank}, more than max_lora_rank={max_rank} "
            "(--max-lora-rank); raise it to serve this adapter"
        )
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"LoRA adapter {where}: field 'lora_alpha' must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def load_peft_adapter(
    name: str,
    path: str | Path,
    targets: dict[str, TargetLayer],
    max_rank: int,
    dtype: torch.dtype,
    *,
    b_row_order: dict[str, torch.Tensor] | None = None,
) -> LoRAAdapter:
    """Read and check the adapter at ``path`` against the base model's ``targets`` (qserve layer
    name -> ``TargetLayer``); ``b_row_order``: HF projection leaf (``q_proj``) -> the order of its
    output rows in the base layer (the rows the base model reordered at load), or none."""
    from safetensors import safe_open

    root = Path(path)
    config = read_adapter_config(root)
    rank, scale = check_adapter_config(config, root, max_rank)
    weights_path = root / WEIGHTS_FILE
    if not weights_path.is_file():
        extra = (
            " (pickled adapter_model.bin is not loaded: convert it to safetensors)"
            if (root / "adapter_model.bin").is_file()
            else ""
        )
        raise AdapterError(f"LoRA adapter {root}: no {WEIGHTS_FILE}{extra}")
    base_name = config.get("base_model_name_or_path")
    by_module = _modules_of(targets)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            if "lora_magnitude_vector" in key:
                raise AdapterError(
                    f"LoRA adapter {root}: tensor {key} is a DoRA magnitude (field 'use_dora'): not supported"
                )
            match = _KEY.match(key)
            if match is None:
                raise AdapterError(
                    f"LoRA adapter {root}: tensor {key} is not a LoRA A/B matrix of a linear layer "
                    "(embedding LoRA, biases and modules_to_save are not supported)"
                )
            module = match["module"]
            leaf = module.rpartition(".")[2]
            if module not in by_module:
                supported = ", ".join(PROJECTIONS + FUSED_NAMES)
                what = (
                    "this base model has no such layer"
                    if leaf in PROJECTIONS + FUSED_NAMES
                    else (f"qserve adapts {supported} only")
                )
                raise AdapterError(
                    f"LoRA adapter {root}: field 'target_modules' includes {leaf!r} (tensor {key}): {what}"
                )
            pairs.setdefault(module, {})[match["which"]] = f.get_tensor(key)
    if not pairs:
        raise AdapterError(f"LoRA adapter {root}: {WEIGHTS_FILE} holds no LoRA tensors")
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"LoRA adapter {root}: module {module} has no {missing} weight")
        layer_name, slices = by_module[module]
        target = targets[layer_name]
        a, b = ab["A"], ab["B"]
        expect_b = sum(target.slice_sizes[s] for s in slices)
        for tensor, which, expected in ((a, "A", (rank, target.in_features)), (b, "B", (expect_b, rank))):
            if tuple(tensor.shape) != expected:
                hint = f"; it was trained for {base_name}" if base_name else ""
                raise AdapterError(
                    f"LoRA adapter {root}: {module}.lora_{which} has shape {tuple(tensor.shape)}, but field 'r' = "
                    f"{rank} and the base model's {module} need {expected}: wrong base model{hint}"
                )
        if layer_name not in layers:
            num_slices = len(target.slice_sizes)
            layers[layer_name] = (
                torch.zeros(num_slices * max_rank, target.in_features, dtype=dtype),  # [S*R, K]
                torch.zeros(target.slice_starts[-1], max_rank, dtype=dtype),  # [N, R]
            )
        slot_a, slot_b = layers[layer_name]
        row = 0
        for s in slices:
            lo, hi = target.slice_starts[s], target.slice_starts[s + 1]
            b_part = b[row : row + (hi - lo)].float() * scale  # [N_s, r]
            order = (b_row_order or {}).get(target.slice_names[s].rpartition(".")[2])
            if order is not None:
                b_part = b_part.index_select(0, order)
            slot_a[s * max_rank : s * max_rank + rank] = a.to(dtype)
            slot_b[lo:hi, :rank] = b_part.to(dtype)
            row += hi - lo
    return LoRAAdapter(name=name, path=str(root), rank=rank, scale=scale, layers=layers)


def _modules_of(targets: dict[str, TargetLayer]) -> dict[str, tuple[str, list[int]]]:
    """PEFT module name -> (qserve layer, its slices): each projection's own name, and the fused
    layer's name for all of its slices."""
    result: dict[str, tuple[str, list[int]]] = {}
    for layer_name, target in targets.items():
        for s, hf_name in enumerate(target.slice_names):
            result[hf_name] = (layer_name, [s])
        if len(target.slice_names) > 1:
            result[layer_name] = (layer_name, list(range(len(target.slice_names))))
    return result
