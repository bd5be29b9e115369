"""The only messages that cross between the scheduler and the model runner.

Knows: plain data describing one step's work (``SchedulerOutput``) and its result
(``RunnerOutput``). Must not know: torch. Lists are shared references to the request's own
lists (no copies on the hot path); the runner must treat them as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One request's share of a step: compute ``num_new_tokens`` tokens from ``start_position``."""

    request_id: str
    start_position: int  # == num_computed_tokens before this step
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table (covers start_position + num_new_tokens)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any  # SamplingParams
    sample: bool  # this chunk reaches the last known token: sample the next one
    pooling: bool = False  # an embedding request: return the last prompt token's final hidden state
    lora_id: int | None = None  # its LoRA adapter (Request.lora_id); None: the base model
    # Speculative decoding: draft tokens verified by this step, at the positions after the last
    # known token (they are the last ``len(spec_token_ids)`` of the ``num_new_tokens``); the step
    # samples one row per draft plus one.
    spec_token_ids: list[int] | tuple[()] = ()

    def input_token_ids(self) -> list[int]:
        """The token ids at positions [start_position, start_position + num_new_tokens)."""
        if self.spec_token_ids:
            return self._known_token_ids(self.num_new_tokens - len(self.spec_token_ids)) + list(self.spec_token_ids)
        return self._known_token_ids(self.num_new_tokens)

    def _known_token_ids(self, num_new_tokens: int) -> list[int]:
        end = self.start_position + num_new_tokens
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[self.start_position : end]
        head = self.prompt_token_ids[self.start_position : num_prompt] if self.start_position < num_prompt else []
        out_start = max(self.start_position - num_prompt, 0)
        return head + self.output_token_ids[out_start : end - num_prompt]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    sequences: list[ScheduledSequence]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that finished since the previous step (finish_request / abort_request, or the
    # scheduler itself, below): the runner drops any per-request state it keeps for them.
    finished_request_ids: list[str] = field(default_factory=list)
    # Requests the scheduler finished itself (status FINISHED_LENGTH) because the KV pool can
    # never hold their next token; the engine emits their final output.
    capacity_finished_request_ids: list[str] = field(default_factory=list)
    # Structured outputs (set by the engine, not the scheduler): the sampling sequences under a
    # grammar and their next-token bitmasks, row g for grammar_request_ids[g]. The bitmask is a
    # numpy int32 array [G, ceil(vocab / 32)]; bit j of word w allows token 32 w + j.
    grammar_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # Swap preemption (vLLM V0's names): (device block, host slot) pairs to copy to the host and
    # (host slot, device block) pairs to copy back. The runner applies both before this step's
    # forward, swap-outs first (a device block swapped out may be rewritten by this very step).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The preempted requests (a subset of preempted_request_ids) whose KV went to the host: they
    # resume without recomputing, so their prompt logprobs are not sent again.
    swapped_out_request_ids: list[str] = field(default_factory=list)
    # Speculative decoding: draft tokens scheduled in this step, over all sequences (0: none, and
    # the runner takes exactly the path it takes without speculation).
    num_spec_tokens: int = 0
    # Speculative decoding with an EAGLE head (set by the engine, not the scheduler): return the
    # target's hidden states of every token of the step (RunnerOutput.spec_hidden_states); such a
    # step runs eagerly.
    spec_hidden_states: bool = False
    # Speculative decoding with drafts left on the device (set by the engine, not the scheduler;
    # EAGLE heads unless QSERVE_EAGLE_DEVICE_DRAFTS=0): each sequence's spec_token_ids are placeholders of the right
    # count, its ids the first ones of its row of this object (qserve.spec_decode.proposer.DeviceDrafts),
    # which the runner reads on the device; None: the spec_token_ids are the drafts.
    spec_device_drafts: Any = None

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner: no sequence and no swap copy."""
        return not (self.sequences or self.blocks_to_swap_out or self.blocks_to_swap_in)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs at one position: entry 0 is the chosen (or actual) token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1-based rank of each token in the distribution


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    # request_id -> sampled token, for sequences scheduled with sample=True
    sampled_token_ids: dict[str, int]
    # request_id -> logprobs of the sampled token (only when SamplingParams.logprobs is set)
    logprobs: dict[str, TokenLogprobs]
    # request_id -> one entry per prompt position computed this step whose next token is a
    # prompt token (only when SamplingParams.prompt_logprobs is set)
    prompt_logprobs: dict[str, list[TokenLogprobs]]
    # request_id -> the final hidden state (after the model's last norm) of the last prompt token,
    # as float32 values, for pooling sequences whose step computed that token
    hidden_states: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: request_id -> every token this step emits for a sequence that had
    # drafts (the accepted drafts, then the target's own token); its sampled_token_ids entry is
    # the last of them. Logprobs (when asked for) one per emitted token.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # EAGLE (SchedulerOutput.spec_hidden_states): the target's hidden states of every token of the
    # step, in the step's token order (each sequence's num_new_tokens rows in turn): a tensor on the
    # device, [num_tokens, width], opaque here (the proposer reads it); None when not asked for.
    spec_hidden_states: Any = None
