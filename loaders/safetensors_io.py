"""Streaming reads of (sharded) safetensors checkpoints.

Knows: where each tensor of a checkpoint directory lives (``model.safetensors``, any
``*.safetensors`` files, or the shards listed in ``model.safetensors.index.json``), the
safetensors container format (8-byte little-endian header length, JSON header, raw
little-endian data), and how to read one tensor at a time with plain positional file reads.
Must not know: what the tensors mean (formats, models).

Why not ``safe_open``: it memory-maps whole files, and every page touched stays resident (and
counted in RSS) while the handle lives, so a streaming load would briefly hold two copies of the
model. Here each tensor is read straight into its own fresh buffer; nothing else stays mapped.

Every header is validated when the directory is opened: a truncated or corrupt file, an
index that names a missing shard or a tensor whose byte range disagrees with its dtype and
shape is refused with a ``ValueError`` naming the file. Shard names in an index are resolved
and refused, before anything is opened, if they point outside the checkpoint directory
(``../../etc/passwd``). Every floating-point tensor read is checked for NaN / inf: a NaN scale
used to load and serve empty text.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# safetensors dtype tag -> (torch dtype, bytes per element)
_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
for _tag, _name in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _name):
        _DTYPES[_tag] = (getattr(torch, _name), int(_tag[1:]) // 8)
for _tag, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _name):
        _DTYPES[_tag] = (getattr(torch, _name), 1)

DTYPE_BYTES: dict[str, int] = {tag: size for tag, (_, size) in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes are, from the header only."""

    name: str
    file: Path
    dtype: str  # safetensors tag, e.g. "F16", "I32"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int  # absolute byte offset (exclusive)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header; never reads tensor data."""
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise ValueError(f"{file}: safetensors file is missing") from None
    with open(file, "rb") as handle:
        raw_len = handle.read(8)
        if len(raw_len) < 8:
            raise ValueError(f"{file}: truncated or corrupt safetensors file ({size} bytes, no header length)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise ValueError(
                f"{file}: truncated or corrupt safetensors file (header length {header_len} bytes, file {size} bytes)"
            )
        raw_header = handle.read(header_len)
    try:
        header = json.loads(raw_header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: corrupt safetensors header (not valid JSON: {err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: corrupt safetensors header (expected a JSON object)")
    data_start = 8 + header_len
    data_len = size - data_start
    infos: dict[str, TensorInfo] = {}
    max_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{file}: corrupt safetensors header entry for tensor {name!r}: {entry!r}") from None
        if dtype not in _DTYPES:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {dtype!r}, which qserve does not read; supported: {', '.join(_DTYPES)}"
            )
        expected = math.prod(shape) * DTYPE_BYTES[dtype]
        if not (0 <= begin <= end) or end - begin != expected:
            raise ValueError(
                f"{file}: corrupt safetensors header: tensor {name!r} ({dtype} {list(shape)}) needs {expected} bytes "
                f"but data_offsets are [{begin}, {end}]"
            )
        if end > data_len:
            raise ValueError(
                f"{file}: truncated safetensors file: tensor {name!r} ends at data byte {end} but the file holds "
                f"only {data_len} data bytes"
            )
        max_end = max(max_end, end)
        infos[name] = TensorInfo(name, file, dtype, shape, data_start + begin, data_start + end)
    return infos


def read_metadata(file: Path) -> dict[str, str]:
    """The free-form ``__metadata__`` map of a safetensors file (empty if none)."""
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len).decode("utf-8"))
    return dict(header.get("__metadata__") or {})


_FINITE_CHUNK = 1 << 20  # elements per isfinite pass: the check must not double a tensor's memory


def _all_finite(tensor: torch.Tensor) -> bool:
    flat = tensor.reshape(-1)  # [numel], a view (the buffer is contiguous)
    for start in range(0, flat.numel(), _FINITE_CHUNK):
        if not bool(torch.isfinite(flat[start : start + _FINITE_CHUNK]).all()):
            return False
    return True


class CheckpointFiles:
    """Maps tensor names to the safetensors file that holds them; reads one tensor at a time."""

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: not a directory")
        self.infos: dict[str, TensorInfo] = self._index()
        self.file_of: dict[str, Path] = {name: info.file for name, info in self.infos.items()}
        self._fds: dict[Path, int] = {}

    def _index(self) -> dict[str, TensorInfo]:
        index_path = self.root / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("expected an object of tensor name -> shard file")
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
                raise ValueError(f"{index_path}: corrupt index (field 'weight_map': {err})") from None
            shard_of = {fname: self._shard_path(index_path, fname) for fname in set(weight_map.values())}
            files = sorted(set(shard_of.values()))
            headers = {file: read_header(file) for file in files}
            infos: dict[str, TensorInfo] = {}
            for name, fname in weight_map.items():
                file = shard_of[fname]
                if name not in headers[file]:
                    raise ValueError(
                        f"{index_path}: tensor {name!r} is listed in {fname} but that file does not hold it"
                    )
                infos[name] = headers[file][name]
            return infos
        files = sorted(self.root.glob("*.safetensors"))
        if not files:
            pickled = sorted(p.name for p in self.root.iterdir() if p.suffix in PICKLED_SUFFIXES)
            if pickled:
                raise ValueError(
                    f"{self.root}: only pickled weights found ({', '.join(pickled)}); qserve never unpickles "
                    "checkpoints. Supported: safetensors (model.safetensors or a model.safetensors.index.json); "
                    f"convert them once with `qserve convert {self.root} OUT` (torch.load weights_only=True)."
                )
            raise ValueError(f"{self.root}: no safetensors weights found (expected {SINGLE_FILE} or {INDEX_FILE})")
        infos = {}
        for file in files:
            for name, info in read_header(file).items():
                if name in infos:
                    raise ValueError(f"{file}: tensor {name!r} is also stored in {infos[name].file.name}")
                infos[name] = info
        return infos

    def _shard_path(self, index_path: Path, fname: object) -> Path:
        """The shard file an index names, refused unless it lies inside the checkpoint directory."""
        if not isinstance(fname, str) or not fname:
            raise ValueError(f"{index_path}: field 'weight_map' names a shard {fname!r}; expected a file name")
        root = self.root.resolve()
        file = (root / fname).resolve()
        if not file.is_relative_to(root) or file == root:
            raise ValueError(
                f"{index_path}: field 'weight_map' names shard {fname[:200]!r}, which is outside the checkpoint "
                f"directory {root}"
            )
        return file

    def names(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def info(self, name: str) -> TensorInfo:
        if name not in self.infos:
            raise ValueError(f"{self.root}: tensor {name!r} is missing from the checkpoint")
        return self.infos[name]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into a fresh CPU buffer of its stored dtype and shape."""
        info = self.info(name)
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)  # [nbytes]
        view = memoryview(buf.numpy()) if info.nbytes else memoryview(b"")
        done = 0
        while done < info.nbytes:
            got = os.preadv(fd, [view[done:]], info.begin + done)
            if got <= 0:
                raise ValueError(f"{info.file}: truncated safetensors file while reading tensor {name!r}")
            done += got
        tensor = buf.view(info.torch_dtype).reshape(info.shape)
        if tensor.is_floating_point() and not _all_finite(tensor):
            raise ValueError(
                f"{info.file}: tensor {name!r} holds non-finite values (NaN or inf); the checkpoint is broken"
            )
        return tensor

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one at a time, file by file in on-disk order."""
        for name in sorted(self.infos, key=lambda n: (str(self.infos[n].file), self.infos[n].begin)):
            yield name, self.get(name)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter shutdown
            pass
