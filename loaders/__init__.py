"""loaders: read checkpoint directories into qserve's canonical weights.

Knows: checkpoint files, quantization metadata and on-disk tensor layouts (see
shared/docs/formats.md), and how to convert them to ``quant_kernels.layout``. Must not know: the
engine, the model classes or the device they will run on (never imports ``qserve``).

Public API::

    spec = loaders.detect(path)                 # CheckpointSpec, from metadata only
    for name, value in loaders.iter_weights(path, spec):
        ...                                     # (module_prefix, PackedQuantWeight) or (param_name, Tensor)
"""

from __future__ import annotations

from loaders.detect import detect
from loaders.renamed import CheckpointView, ModuleTarget
from loaders.spec import CheckpointSpec, ModuleQuant, is_quantizable
from loaders.weights import iter_weights, plan_checkpoint

__all__ = [
    "CheckpointSpec",
    "CheckpointView",
    "ModuleQuant",
    "ModuleTarget",
    "detect",
    "is_quantizable",
    "iter_weights",
    "plan_checkpoint",
]
