"""Build a model from a checkpoint directory: config, linear methods, streamed weights.

Knows: the glue between ``loaders`` (formats and tensors) and ``qserve.model`` (modules), and where
on the GPU the prepared weights go. Must not know: format details (``loaders`` owns them) or the engine.

``QSERVE_WEIGHTS_POOL`` (on CUDA unless ``0``): each linear layer's prepared tensors are copied into a private
allocator pool of the weights alone (``torch.cuda.MemPool``), one layer after another, as the model prepares
each layer once its last shard arrives. The checkpoint's canonical tensors and the repacking's temporaries
stay in the default pool with nothing long-lived between them, so ``empty_cache`` gives their pages back
whole. Without it the prepared weights land among them and strand the free parts of the allocator's 20 MiB
pages: the 14B engine held 3.42% over its memory plan, with the pool 0.24% under it, at the same decode
speed (H100, bench/RESULTS.md, twenty-sixth session; bench/memory_history.py names what lay in each hole).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import loaders
from qserve.config import ModelConfig
from qserve.distributed.parallel_state import TPGroup
from qserve.layers.linear import Linear
from qserve.layers.quant_methods import make_linear_method, reference_path_layers
from qserve.model.llama import LlamaFamilyForCausalLM
from qserve.model.registry import checkpoint_view, read_model_config
from quant_kernels.switches import env_switch

logger = logging.getLogger(__name__)

WEIGHTS_POOL_ENV = "QSERVE_WEIGHTS_POOL"


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
    pool = _weights_pool(device)
    model.weights_pool = pool  # the pool lives as long as the model that holds its tensors
    try:
        model.load_weights(
            _on_device(loaders.iter_weights(path, spec, view, keep), device),
            after_prepare=None if pool is None else (lambda layer: _relocate(layer, pool, device)),
        )
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


def _weights_pool(device: torch.device | str) -> object | None:
    """A private allocator pool for the prepared weights (on CUDA unless ``QSERVE_WEIGHTS_POOL=0``), else None."""
    if torch.device(device).type != "cuda" or not env_switch(WEIGHTS_POOL_ENV, default=True):
        return None
    if not hasattr(torch.cuda, "MemPool"):
        logger.warning(
            "this torch has no torch.cuda.MemPool: the weights stay in the default pool (%s)", WEIGHTS_POOL_ENV
        )
        return None
    with torch.cuda.device(_cuda_index(device)):  # a pool belongs to the device current when it is made
        return torch.cuda.MemPool()


def _relocate(layer: Linear, pool: object, device: torch.device | str) -> None:
    """Copy one prepared layer into the weights pool; its default-pool tensors die with the old references."""
    with torch.cuda.use_mem_pool(pool, device=_cuda_index(device)):
        layer.relocate()


def _cuda_index(device: torch.device | str) -> int:
    """The CUDA device's index; "cuda" alone is the current device (torch's pool calls refuse an index-less
    device, and a pool used on another device than it was made on would route nothing)."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _on_device(weights, device):  # noqa: ANN001, ANN202 - a thin generator adapter
    for name, value in weights:
        yield name, value.to(device)
