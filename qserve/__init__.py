"""qserve: quantization-first LLM serving.

The offline API mirrors vLLM: ``from qserve import LLM, SamplingParams``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "PoolingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]

__version__ = "0.1.0"  # the package version (pyproject.toml reads it)

if TYPE_CHECKING:
    from qserve.engine.llm import LLM
    from qserve.lora.request import LoRARequest
    from qserve.outputs import CompletionOutput, RequestOutput
    from qserve.pooling_params import PoolingParams
    from qserve.sampling_params import SamplingParams
    from qserve.structured.params import StructuredOutputsParams


def __getattr__(name: str):  # noqa: ANN202 - lazy imports keep `import qserve` light (no torch for the CLI's help)
    if name == "LLM":
        from qserve.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from qserve.lora.request import LoRARequest

        return LoRARequest
    if name == "PoolingParams":
        from qserve.pooling_params import PoolingParams

        return PoolingParams
    if name == "SamplingParams":
        from qserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from qserve.structured.params import StructuredOutputsParams

        return StructuredOutputsParams
    if name in ("RequestOutput", "CompletionOutput"):
        from qserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'qserve' has no attribute {name!r}")
