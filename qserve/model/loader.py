"""Build a model from a checkpoint directory: config, linear methods, streamed weights.

Knows: the glue between ``loaders`` (formats and tensors) and ``qserve.model`` (modules). Must
not know: format details (``loaders`` owns them) or the engine.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import loaders
from qserve.config import ModelConfig
from qserve.layers.quant_methods import make_linear_method
from qserve.model.llama import LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device | str
) -> tuple[LlamaFamilyForCausalLM, ModelConfig]:
    """Instantiate the model on ``device`` in ``dtype`` and stream the checkpoint into it."""
    config = ModelConfig.from_path(path)
    spec = loaders.detect(path)
    with torch.device(device):
        model = LlamaFamilyForCausalLM(config, dtype, lambda names: make_linear_method(spec, names))
    model.load_weights(_on_device(loaders.iter_weights(path, spec), device))
    model.eval()
    return model, config


def _on_device(weights, device):  # noqa: ANN001, ANN202 - a thin generator adapter
    for name, value in weights:
        yield name, value.to(device)
