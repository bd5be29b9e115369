"""A request as the scheduler sees it: token ids, progress counters and status.

Knows: the token ids of one sequence and how far its KV has been computed. Must not know:
torch, tensors, text or the tokenizer (the engine owns detokenization). Pure Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV was dropped and will be recomputed
    SWAPPED = "swapped"  # back in the waiting queue; its KV is in host memory and will be copied back
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    """One sequence to generate. ``n > 1`` requests are fanned out into several of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # qserve.sampling_params.SamplingParams (plain data; typed loosely to stay torch-free)
    arrival_index: int = 0  # FCFS order; smaller is older
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    num_preemptions: int = 0
    # Async scheduling: tokens sampled by a step still in flight, not yet in output_token_ids
    # (the scheduler plans the next step as if they were there; 0 when scheduling is synchronous).
    num_output_placeholders: int = 0
    status: RequestStatus = RequestStatus.WAITING
    tenant: str | None = None  # who sent it (API key's tenant); the scheduler shares seats by tenant weight
    # An embedding request: the runner returns its last prompt token's final hidden state.
    pooling: bool = False
    # The LoRA adapter it runs with (qserve.lora: the id the engine's adapter registry gave it;
    # None: the base model). Keys its prefix-cache blocks and counts toward max_loras per step.
    lora_id: int | None = None
    # Prefix-cache hashes of this sequence's full blocks, filled lazily by the prefix cache.
    block_hashes: list[int] = field(default_factory=list)
    # Speculative decoding: draft tokens proposed for the next step (set by the engine before
    # ``schedule()``, which verifies them after the last known token); never part of the tokens.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_at(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
