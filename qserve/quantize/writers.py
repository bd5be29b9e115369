"""Writers of standard quantized checkpoints: GPTQ v1 and AWQ GEMM, as other tools expect them.

Knows: the on-disk layouts (shared/docs/formats.md §2 GPTQ, §3 AWQ GEMM): GPTQ ``qweight`` int32
``[K/pf, N]`` packed along K, ``qzeros`` int32 ``[ng, N/pf]`` packed along N holding ``zero − 1``
(v1), ``scales`` fp16 ``[ng, N]``, ``g_idx`` int32 ``[K]``; AWQ ``qweight`` int32 ``[K, N/8]`` and
``qzeros`` ``[K/G, N/8]`` packed along N in the nibble order ``[0, 2, 4, 6, 1, 3, 5, 7]`` with true
zeros, ``scales`` fp16 ``[K/G, N]``; the ``quantization_config`` each tool reads; sharded
safetensors with ``model.safetensors.index.json``; which side files (tokenizer, generation
config) travel with a checkpoint. Must not know: how the codes were chosen (GPTQ, AWQ, RTN).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qserve.quantize.quantizer import QuantizedLinear

logger = logging.getLogger(__name__)

QUANTIZER_TAG = "qserve:0.1.0"
# GPTQModel (checked: 7.7.0, models/loader.py) refuses to load sym=False + format "gptq" unless
# meta.quantizer names "gptqmodel:<version >= 0.9.0>", its marker for "v1 zeros written as the
# whole-word v2 -> v1 subtraction" that its loader inverts by whole-word addition. qserve's v1 zeros
# are never 0 (gptq_tensors refuses them), so per-nibble "zero - 1" and the whole-word subtraction
# give the same bytes: the marker is true of these files.
GPTQMODEL_V1_ASYM_TAG = "gptqmodel:0.9.0"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
DEFAULT_SHARD_BYTES = 4 * 1024**3
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# ------------------------------------------------------------------------------------------------
# Bit packing (int64 arithmetic, then wrapped into int32)
# ------------------------------------------------------------------------------------------------


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes ``[R, C]`` -> int32 ``[R / pf, C]``: row ``r`` in word ``r // pf`` at bits ``bits·(r % pf)``."""
    pf = 32 // bits
    if codes.shape[0] % pf:
        raise ValueError(f"cannot pack {codes.shape[0]} rows of {bits}-bit codes: not a multiple of {pf}")
    grouped = codes.to(torch.int64).reshape(-1, pf, codes.shape[1])  # [R/pf, pf, C]
    shifts = (torch.arange(pf, dtype=torch.int64, device=codes.device) * bits).view(1, pf, 1)
    return _to_int32((grouped << shifts).sum(dim=1))


def pack_along_cols(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned codes ``[R, C]`` -> int32 ``[R, C / pf]``; slot ``i`` of word ``c`` holds column
    ``pf·c + order[i]`` (sequential when ``order`` is None)."""
    pf = 32 // bits
    if codes.shape[1] % pf:
        raise ValueError(f"cannot pack {codes.shape[1]} columns of {bits}-bit codes: not a multiple of {pf}")
    grouped = codes.to(torch.int64).reshape(codes.shape[0], -1, pf)  # [R, C/pf, pf]
    if order is not None:
        grouped = grouped[:, :, list(order)]
    shifts = (torch.arange(pf, dtype=torch.int64, device=codes.device) * bits).view(1, 1, pf)
    return _to_int32((grouped << shifts).sum(dim=2))


# ------------------------------------------------------------------------------------------------
# Tensors of one Linear
# ------------------------------------------------------------------------------------------------


def gptq_tensors(prefix: str, q: QuantizedLinear) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of one Linear (``prefix`` = HF module name)."""
    if bool((q.zeros < 1).any()):
        raise ValueError(
            f"{prefix}: a zero point of 0 cannot be stored in GPTQ v1 (zero - 1); quantize with min_zero=1"
        )
    out = {
        f"{prefix}.qweight": pack_along_rows(q.codes.cpu(), q.bits),  # int32 [K/pf, N]
        f"{prefix}.qzeros": pack_along_cols((q.zeros.to(torch.int32) - 1).cpu(), q.bits),  # int32 [ng, N/pf]
        f"{prefix}.scales": q.scales.cpu().to(torch.float16).contiguous(),  # fp16 [ng, N]
        f"{prefix}.g_idx": q.g_idx.cpu().to(torch.int32).contiguous(),  # int32 [K]
    }
    if q.bias is not None:
        out[f"{prefix}.bias"] = q.bias.cpu().to(torch.float16).contiguous()
    return out


def awq_tensors(prefix: str, q: QuantizedLinear) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors of one Linear (4-bit, zero_point=true)."""
    if q.bits != 4 or q.sym:
        raise ValueError(f"{prefix}: AWQ GEMM holds 4-bit asymmetric weights only (got bits={q.bits}, sym={q.sym})")
    group = q.in_features if q.group_size == -1 else q.group_size
    trivial = torch.arange(q.in_features, device=q.g_idx.device) // group
    if not torch.equal(q.g_idx.long(), trivial):
        raise ValueError(f"{prefix}: AWQ has no act-order (g_idx); got a permuted grouping")
    out = {
        f"{prefix}.qweight": pack_along_cols(q.codes.cpu(), 4, AWQ_ORDER),  # int32 [K, N/8]
        f"{prefix}.qzeros": pack_along_cols(q.zeros.cpu(), 4, AWQ_ORDER),  # int32 [K/G, N/8]
        f"{prefix}.scales": q.scales.cpu().to(torch.float16).contiguous(),  # fp16 [K/G, N]
    }
    if q.bias is not None:
        out[f"{prefix}.bias"] = q.bias.cpu().to(torch.float16).contiguous()
    return out


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------


def gptq_quantization_config(
    bits: int, group_size: int, desc_act: bool, sym: bool, damp_percent: float, method: str = "gptq"
) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq",
        "damp_percent": damp_percent,
        "true_sequential": True,
        "static_groups": False,
        "lm_head": False,
        "model_name_or_path": None,
        "model_file_base_name": None,
        "meta": {
            "quantizer": [QUANTIZER_TAG] if sym else [QUANTIZER_TAG, GPTQMODEL_V1_ASYM_TAG],
            "qserve_method": method,
        },
    }


def awq_quantization_config(
    bits: int, group_size: int, modules_to_not_convert: list[str] | None = None
) -> dict[str, Any]:
    """AutoAWQ's keys; ``modules_to_not_convert``: substrings of module names kept 16-bit (MoE routers)."""
    return {
        "quant_method": "awq",
        "bits": bits,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


class ShardedSafetensorsWriter:
    """Collects tensors in order and writes safetensors shards of at most ``max_shard_bytes``.

    One shard is ``model.safetensors``; several are ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json``. Tensors are flushed to disk as shards fill, so a large
    model's quantized layers never all sit in memory.
    """

    def __init__(self, directory: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        tensor = tensor.detach().cpu().contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def add_all(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.add(name, tensor)

    def _flush(self) -> None:
        path = self.directory / f".shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        if self._pending or not self._shards:
            self._flush()
        total = len(self._shards)
        if total == 1:
            final = self.directory / "model.safetensors"
            self._shards[0][0].replace(final)
            return [final]
        weight_map: dict[str, str] = {}
        finals = []
        for i, (path, names) in enumerate(self._shards, 1):
            final = self.directory / f"model-{i:05d}-of-{total:05d}.safetensors"
            path.replace(final)
            finals.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return finals


def write_configs(src: str | Path, dst: str | Path, quantization_config: dict[str, Any]) -> None:
    """``config.json`` (the source's, fp16, with ``quantization_config``), ``quantize_config.json``
    for GPTQ (AutoGPTQ / GPTQModel / vLLM read it), and the tokenizer / generation side files."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    for key in ("torch_dtype", "dtype"):
        if key in config or key == "torch_dtype":
            config[key] = "float16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if quantization_config["quant_method"] == "gptq":
        (dst / "quantize_config.json").write_text(json.dumps(quantization_config, indent=2) + "\n")
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
