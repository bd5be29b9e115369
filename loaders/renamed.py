"""A renamed view of a checkpoint: other families' tensor names as the decoder's Llama names.

Knows: how to present one checkpoint tensor under another name, optionally as a slice of its
output rows (a fused ``c_attn`` / ``W_pack`` / ``query_key_value`` split into q, k, v; a fused
``gate_up`` split into gate and up), for dense tensors and for the tensors of a GPTQ or AWQ
quantized Linear (which dimension holds N, and how many N values share one packed word). The
map itself (which source module goes where) is plain data handed in by ``qserve.model.registry``;
this module never knows a family. Must not know: the engine or the model classes.

``RenamedFiles`` offers the read interface of ``CheckpointFiles`` (``names``, ``infos``,
``file_of``, ``get``, ``info``, ``in``), so converters and the planner run on it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from loaders.safetensors_io import DTYPE_BYTES, CheckpointFiles, TensorInfo


@dataclass(frozen=True, slots=True)
class ModuleTarget:
    """Where one source module's tensors go: ``target`` module prefix, optionally only output
    rows ``[rows[0], rows[0] + rows[1])`` of it (None: the whole tensor)."""

    target: str
    rows: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class CheckpointView:
    """A family's view of its checkpoint: the Llama-style config (for the shapes the loader
    checks) and the module name map (None: names are already the decoder's)."""

    config: dict[str, Any]
    module_map: Callable[[str], list[ModuleTarget] | None] | None


@dataclass(frozen=True, slots=True)
class _Source:
    name: str  # the tensor in the checkpoint
    dim: int | None  # the dimension that holds output rows (None: not sliced)
    start: int  # in stored elements along ``dim``
    size: int


def _split_dim(suffix: str, ndim: int, method: str) -> tuple[int, bool] | None:
    """(dimension holding N, whether N is packed pf-per-word there) for a tensor suffix."""
    if suffix in ("weight", "bias"):
        return (0, False) if ndim >= 1 else None
    if suffix == "qweight":
        return (1, method == "awq")  # GPTQ [K/pf, N]; AWQ GEMM [K, N/pf]
    if suffix == "qzeros":
        return (1, True)  # [ng, N/pf] in both
    if suffix == "scales":
        return (1, False)  # [ng, N]
    return None


class RenamedFiles:
    """``CheckpointFiles`` seen through a module name map."""

    def __init__(self, files: CheckpointFiles, view: CheckpointView, method: str = "none", bits: int | None = None):
        self.base = files
        self.root = files.root
        self._sources: dict[str, _Source] = {}
        self.infos: dict[str, TensorInfo] = {}
        pack = 32 // bits if bits else 1
        for name, info in files.infos.items():
            prefix, _, suffix = name.rpartition(".")
            targets = view.module_map(prefix) if (view.module_map and prefix) else None
            if targets is None:
                targets = [ModuleTarget(prefix)]
            for target in targets:
                new_name = f"{target.target}.{suffix}" if target.target else suffix
                if target.rows is None or suffix == "g_idx":
                    source = _Source(name, None, 0, 0)
                    shape = info.shape
                else:
                    split = _split_dim(suffix, len(info.shape), method)
                    if split is None:
                        raise ValueError(
                            f"{info.file}: tensor {name!r} would have to be split into {new_name!r}, which qserve "
                            f"supports for dense, GPTQ and AWQ tensors only"
                        )
                    dim, packed = split
                    start, size = target.rows
                    if packed:
                        if start % pack or size % pack:
                            raise ValueError(
                                f"{info.file}: tensor {name!r}: output rows [{start}, {start + size}) of the fused "
                                f"layer do not fall on whole {bits}-bit words ({pack} values each)"
                            )
                        start, size = start // pack, size // pack
                    if start + size > info.shape[dim]:
                        raise ValueError(
                            f"{info.file}: tensor {name!r} has shape {list(info.shape)}; splitting it into "
                            f"{new_name!r} needs rows up to {start + size} along dim {dim} (check config.json)"
                        )
                    source = _Source(name, dim, start, size)
                    shape = info.shape[:dim] + (size,) + info.shape[dim + 1 :]
                if new_name in self._sources:
                    raise ValueError(
                        f"{info.file}: tensors {self._sources[new_name].name!r} and {name!r} both map to {new_name!r}"
                    )
                self._sources[new_name] = source
                nbytes = math.prod(shape) * DTYPE_BYTES[info.dtype]
                self.infos[new_name] = replace(info, name=new_name, shape=tuple(shape), end=info.begin + nbytes)
        self.file_of = {name: info.file for name, info in self.infos.items()}
        self._last: tuple[str, torch.Tensor] | None = None  # a fused tensor is read once for its splits

    def names(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def info(self, name: str) -> TensorInfo:
        if name not in self.infos:
            raise ValueError(f"{self.root}: tensor {name!r} is missing from the checkpoint")
        return self.infos[name]

    def get(self, name: str) -> torch.Tensor:
        source = self._sources.get(name)
        if source is None:
            raise ValueError(f"{self.root}: tensor {name!r} is missing from the checkpoint")
        if source.dim is None:
            return self.base.get(source.name)
        if self._last is None or self._last[0] != source.name:
            self._last = (source.name, self.base.get(source.name))
        tensor = self._last[1]
        return tensor.narrow(source.dim, source.start, source.size).contiguous()

    def close(self) -> None:
        self._last = None
        self.base.close()
