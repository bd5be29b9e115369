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
from qserve.distributed.parallel_state import TPGroup
from qserve.layers.quant_methods import make_linear_method, reference_path_layers
from qserve.model.llama import LlamaFamilyForCausalLM
from qserve.model.registry import checkpoint_view, read_model_config

logger = logging.getLogger(__name__)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup | None = None,
    enable_expert_parallel: bool = False,
) -> tuple[LlamaFamilyForCausalLM, ModelConfig]:
    """Instantiate the model on ``device`` in ``dtype`` and stream the checkpoint into it.

    With a tensor-parallel group ``tp`` the model is this rank's shard: every rank streams the
    checkpoint (one tensor at a time) and keeps its slice; with ``enable_expert_parallel`` a
    rank does not even read the routed experts other ranks hold (``holds_weight``).
    """
    config = read_model_config(path)
    spec = loaders.detect(path)
    view = checkpoint_view(config.raw, str(Path(path) / "config.json"))  # other families' names -> Llama's
    with torch.device(device):
        model = LlamaFamilyForCausalLM(
            config,
            dtype,
            lambda names: make_linear_method(spec, names),
            tp=tp,
            enable_expert_parallel=enable_expert_parallel,
        )
    keep = model.holds_weight if tp is not None and enable_expert_parallel and config.moe_layers else None
    try:
        model.load_weights(_on_device(loaders.iter_weights(path, spec, view, keep), device))
    except ValueError as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"{path}: {err}") from err  # name the checkpoint in every user error
    slow = reference_path_layers(model)
    if slow:
        logger.warning(
            "%d quantized layers (first: %s) have no W4A16 kernel on this GPU (the kernels need Triton, sm80 "
            "or newer and groups in steps of 16 rows): each step dequantizes their weights in PyTorch, which is slow",
            len(slow),
            slow[0],
        )
    model.eval()
    return model, config


def _on_device(weights, device):  # noqa: ANN001, ANN202 - a thin generator adapter
    for name, value in weights:
        yield name, value.to(device)
