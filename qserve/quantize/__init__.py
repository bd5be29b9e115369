"""qserve.quantize: write standard GPTQ / AWQ checkpoints from fp16 ones (quantize-then-serve).

Knows: calibration text, the GPTQ / AWQ / RTN algorithms, the layer-by-layer pipeline, the
checkpoint writers, perplexity evaluation and the built-in demo model. Must not know: the
serving engine's internals (it loads what this writes like any other checkpoint).

Public API::

    from qserve.quantize import QuantizeOptions, quantize_checkpoint
    quantize_checkpoint("Qwen2.5-7B-Instruct", "out-gptq", QuantizeOptions(method="gptq", calib="calib.txt"))
"""

from __future__ import annotations

from qserve.quantize.pipeline import METHODS, QuantizeOptions, QuantizeReport, quantize_checkpoint

__all__ = ["METHODS", "QuantizeOptions", "QuantizeReport", "quantize_checkpoint"]
