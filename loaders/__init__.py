"""loaders: read checkpoint directories into qserve's canonical weights.

Knows: checkpoint files, quantization metadata and on-disk tensor layouts (see
shared/docs/formats.md), and how to convert them to ``quant_kernels.layout``. Must not know: the
engine, the model classes or the device they will run on.
"""
