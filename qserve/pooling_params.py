"""PoolingParams: what an embedding (pooling) request asks of the engine, with vLLM's names.

Knows: the per-request pooling knobs and how a pooled hidden state becomes the returned vector.
Must not know: torch, tensors, the tokenizer or the engine. Pure Python value object.

The pooling is fixed, as vLLM's default for a generative (``*ForCausalLM``) model run as an
embedding model: the final hidden state (after the model's final norm) of the LAST prompt
token, L2-normalized unless ``normalize=False``. ``dimensions`` (OpenAI's and vLLM's name)
is for Matryoshka models only; a generative model is not one, so any other size than its
hidden size is refused (as vLLM refuses it), never silently truncated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, kw_only=True)
class PoolingParams:
    dimensions: int | None = None
    normalize: bool = True

    # A pooling request is one sequence that generates nothing (queues and admission read these).
    n: ClassVar[int] = 1
    max_tokens: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")

    def verify(self, hidden_size: int) -> None:
        """ValueError unless the model can give ``dimensions`` (only its own hidden size)."""
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(
                f"dimensions={self.dimensions} is not supported: this model is not a Matryoshka embedding model, "
                f"its embeddings have exactly {hidden_size} dimensions (omit dimensions or pass {hidden_size})"
            )

    def pool(self, hidden: Sequence[float]) -> list[float]:
        """The returned vector from the last prompt token's final hidden state."""
        vector = [float(x) for x in hidden]
        if self.normalize:
            norm = math.sqrt(math.fsum(x * x for x in vector))
            if norm > 0.0:
                vector = [x / norm for x in vector]
        return vector
