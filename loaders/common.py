"""Checks shared by the per-format converters: tensor presence, dtype and shape against the
layer shape that ``config.json`` implies.

Knows: how to phrase a refusal so that it names the file, the tensor (field), the value and what
was expected. Must not know: any one format's layout.
"""

from __future__ import annotations

import math

import torch

from loaders.safetensors_io import CheckpointFiles

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fetch(files: CheckpointFiles, name: str, module_hint: str = "") -> torch.Tensor:
    """Read a tensor the format requires; a missing one is refused naming the checkpoint and tensor."""
    if name not in files:
        hint = f" ({module_hint})" if module_hint else ""
        raise ValueError(f"{files.root}: required tensor {name!r} is missing from the checkpoint{hint}")
    return files.get(name)


def check_dtype(
    files: CheckpointFiles, name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str
) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(
            f"{files.file_of[name]}: tensor {name!r} has dtype {tensor.dtype}; supported: "
            f"{', '.join(str(d).replace('torch.', '') for d in allowed)} ({what})"
        )


def check_shape(files: CheckpointFiles, name: str, tensor: torch.Tensor, expected: tuple[int, ...], why: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"{files.file_of[name]}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(expected)} ({why})"
        )


def check_layer_shape(
    files: CheckpointFiles, name: str, got_kn: tuple[int, int], expected_kn: tuple[int, int] | None, detail: str
) -> None:
    """Compare a quantized layer's (K, N) as stored with what config.json implies."""
    if expected_kn is not None and tuple(got_kn) != tuple(expected_kn):
        raise ValueError(
            f"{files.file_of[name]}: tensor {name!r} implies in_features K={got_kn[0]}, out_features N={got_kn[1]} "
            f"({detail}), but config.json implies K={expected_kn[0]}, N={expected_kn[1]}"
        )


def effective_group(group_size: int, in_features: int) -> tuple[int, int]:
    """(effective group size, number of groups) for a configured size (-1 = per-channel)."""
    geff = in_features if group_size == -1 else group_size
    return geff, math.ceil(in_features / geff)


def fetch_words(files: CheckpointFiles, name: str, module_hint: str, what: str) -> torch.Tensor:
    """A required 2-D int32 tensor of packed codes (``what`` names the layout in refusals)."""
    words = fetch(files, name, module_hint)
    check_dtype(files, name, words, (torch.int32,), what)
    if words.dim() != 2:
        raise ValueError(f"{files.file_of[name]}: tensor {name!r} must be 2-D, got {list(words.shape)}")
    return words


def fetch_group_scales(
    files: CheckpointFiles, name: str, module_hint: str, num_groups: int, out_features: int, group_size: int
) -> torch.Tensor:
    """Required GPTQ/AWQ-style scales ``[num_groups, N]`` in a float dtype."""
    scales = fetch(files, name, module_hint)
    check_dtype(files, name, scales, SCALE_DTYPES, "scales")
    check_shape(files, name, scales, (num_groups, out_features), f"[ceil(K/group_size), N], group_size={group_size}")
    return scales
