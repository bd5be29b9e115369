"""``qserve convert DIR OUT``: rewrite a checkpoint's pickled PyTorch weights as safetensors.

Knows: where pickled weights live (``pytorch_model.bin.index.json`` shards, else
``pytorch_model*.bin``, else any ``*.bin`` / ``*.pt`` / ``*.pth`` file), how to read them with
``torch.load(weights_only=True)`` only (tensors and plain containers; never arbitrary objects),
and that every other file of the directory (config, tokenizer, generation config) travels along.
ChatGLM2/3 and Baichuan2 ship only ``.bin`` files; qserve serves safetensors, and this is the
one offline step between them. Must not know: model families or quantization formats (the
tensors are copied as they are, names and dtypes unchanged).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from qserve.model.hub import add_revision_argument, resolve_model_path

PICKLED_SUFFIXES = (".bin", ".pt", ".pth")
BIN_INDEX = "pytorch_model.bin.index.json"
SKIP_NAMES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="DIR", help="checkpoint directory with pytorch_model*.bin weights")
    add_revision_argument(parser)
    parser.add_argument("dst", metavar="OUT", help="output directory (created; must be absent or empty)")
    parser.add_argument("--max-shard-size", default="4GiB", help="largest safetensors shard (e.g. 4GiB, 500MB)")


def pickled_weight_files(src: Path) -> list[Path]:
    """The weight files of ``src`` in shard order; a refusal names what was looked for."""
    index = src / BIN_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index}: corrupt index (field 'weight_map': {err})") from None
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise ValueError(f"{index}: lists {', '.join(missing)}, which {src} does not hold")
        return [src / n for n in names]
    files = sorted(src.glob("pytorch_model*.bin")) or sorted(
        p for p in src.iterdir() if p.suffix in PICKLED_SUFFIXES and p.name not in SKIP_NAMES
    )
    if not files:
        raise ValueError(
            f"{src}: no pickled weights to convert (looked for {BIN_INDEX}, pytorch_model*.bin, *.bin, *.pt)"
        )
    return files


def convert(src: str | Path, dst: str | Path, max_shard_bytes: int) -> list[Path]:
    """Write ``dst`` as a safetensors copy of ``src``; returns the written shard paths."""
    import torch

    from qserve.quantize.writers import ShardedSafetensorsWriter

    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: not a directory")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst}: output directory is not empty")
    files = pickled_weight_files(src)
    writer = ShardedSafetensorsWriter(dst, max_shard_bytes)
    for file in files:
        try:  # weights_only: tensors and plain containers only, never arbitrary pickled objects
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # noqa: BLE001 - torch raises several types for refused pickles
            raise ValueError(f"{file}: cannot be read with torch.load(weights_only=True): {err}") from None
        if not isinstance(state, dict):
            raise ValueError(f"{file}: holds a {type(state).__name__}, expected a dict of tensor name -> tensor")
        seen: set[tuple[int, int]] = set()
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{file}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            # safetensors refuses tensors sharing storage (tied weights): each gets its own copy
            writer.add(name, tensor.clone() if key in seen else tensor)
            seen.add(key)
        del state
    shards = writer.finish()
    pickled = {f.name for f in files} | {BIN_INDEX}
    for item in src.iterdir():
        if item.is_file() and item.name not in pickled and item.suffix not in PICKLED_SUFFIXES:
            if not (dst / item.name).exists():
                shutil.copyfile(item, dst / item.name)
    return shards


def run(args: argparse.Namespace) -> int:
    args.src = resolve_model_path(args.src, args.revision)  # a Hub id: its cached snapshot
    from qserve.memory.planner import parse_memory_budget

    shards = convert(args.src, args.dst, int(parse_memory_budget(args.max_shard_size)))
    print(f"wrote {len(shards)} safetensors file(s) to {args.dst}: {', '.join(p.name for p in shards)}")
    return 0
