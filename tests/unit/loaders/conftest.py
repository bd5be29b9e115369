"""Shared fixtures for the loader tests: tiny configs and checkpoint builders (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.quant_packers import (
    QuantizedModel,
    quantize_state_dict,
    random_llama_state,
    tiny_llama_config,
    write_checkpoint,
)


@pytest.fixture
def tiny_config() -> dict[str, Any]:
    return tiny_llama_config()


@pytest.fixture
def tiny_state(tiny_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return random_llama_state(tiny_config)


@pytest.fixture
def make_ckpt(tmp_path: Path, tiny_config: dict[str, Any], tiny_state: dict[str, torch.Tensor]):
    """Build a quantized tiny checkpoint: make_ckpt(fmt, quant_config, **quantize_kwargs)."""
    counter = [0]

    def build(
        fmt: str | None,
        quant_config: dict[str, Any] | None,
        *,
        num_shards: int = 1,
        config_overrides: dict[str, Any] | None = None,
        edit=None,  # callable(tensors) -> None, to corrupt/alter before writing
        **kwargs: Any,
    ) -> tuple[Path, QuantizedModel]:
        counter[0] += 1
        path = tmp_path / f"ckpt{counter[0]}"
        config = {**tiny_config, **(config_overrides or {})}
        if fmt is None:
            qm = QuantizedModel(dict(tiny_state), {})
        else:
            qm = quantize_state_dict(tiny_state, fmt, **kwargs)
        if quant_config is not None:
            config["quantization_config"] = quant_config
        tensors = dict(qm.tensors)
        if edit is not None:
            edit(tensors)
        write_checkpoint(path, config, tensors, num_shards=num_shards)
        return path, qm

    return build
