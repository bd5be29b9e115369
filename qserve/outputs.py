"""What the engine hands back to callers, shaped like vLLM's ``RequestOutput``.

Knows: the user-facing result of a request (text, token ids, logprobs, finish reasons). Must
not know: how it was computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen/actual token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # An embedding (pooling) request's vector: its last prompt token's final hidden state, pooled
    # as its PoolingParams say; None for generation requests (and embedding requests that failed).
    embedding: list[float] | None = None
    # Timing (vLLM's names: arrival_time, first_scheduled_time, time_in_queue, first_token_latency);
    # not part of the result, so two runs of the same request compare equal.
    metrics: dict[str, float] = field(default_factory=dict, compare=False)
    # The LoRA adapter it ran with (vLLM's field; a qserve.lora.request.LoRARequest), None: the base model.
    lora_request: Any = None

    @classmethod
    def pooling(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        embedding: list[float] | None,
        finish_reason: str | None,
        finished: bool,
        num_cached_tokens: int,
        metrics: dict[str, float],
        lora_request: Any = None,
    ) -> RequestOutput:
        """An embedding request's output: its vector and no generated tokens (the one token its step
        sampled is not part of the result). Finished without a vector: aborted, or the KV pool could
        never hold it (``finish_reason`` says which); with one, the reason is "stop"."""
        if finish_reason is not None and embedding is not None:
            finish_reason = "stop"
        return cls(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            prompt_logprobs=None,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish_reason)],
            finished=finished,
            num_cached_tokens=num_cached_tokens,
            embedding=embedding,
            metrics=metrics,
            lora_request=lora_request,
        )


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """``LLM.embed``'s result, shaped like vLLM's: the vector is ``.outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
