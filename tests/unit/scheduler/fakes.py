"""Torch-free stand-ins for the engine pieces the scheduler tests need."""

from __future__ import annotations

from dataclasses import dataclass

from qserve.request import Request, RequestStatus
from qserve.scheduler import BlockPool, KVCacheManager, RunnerOutput, Scheduler, SchedulerOutput

SAMPLED_TOKEN = 7


@dataclass(frozen=True, slots=True)
class Params:
    """The SamplingParams fields the scheduler looks at."""

    max_tokens: int = 16
    prompt_logprobs: int | None = None


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    arrival_index: int = 0,
    max_tokens: int = 16,
    prompt_logprobs: int | None = None,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=Params(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
        arrival_index=arrival_index,
    )


def make_scheduler(
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
) -> tuple[Scheduler, BlockPool]:
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len), pool


def fake_run(scheduler_output: SchedulerOutput) -> RunnerOutput:
    """A deterministic model: every sampled sequence gets token 7."""
    sampled = {seq.request_id: SAMPLED_TOKEN for seq in scheduler_output.sequences if seq.sample}
    return RunnerOutput(sampled_token_ids=sampled, logprobs={}, prompt_logprobs={})


def step(scheduler: Scheduler) -> SchedulerOutput:
    """schedule -> fake runner -> update, then finish requests that reached max_tokens (the engine's job)."""
    out = scheduler.schedule()
    for request in scheduler.update_from_output(out, fake_run(out)):
        if request.num_output_tokens >= request.sampling_params.max_tokens:
            scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    return out


def scheduled(out: SchedulerOutput) -> dict[str, tuple[int, int, bool]]:
    """request_id -> (start_position, num_new_tokens, sample)."""
    return {s.request_id: (s.start_position, s.num_new_tokens, s.sample) for s in out.sequences}
