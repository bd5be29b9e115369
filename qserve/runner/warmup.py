"""Warm start: every kind of step a server can meet is run once before it reports ready.

Knows: which step shapes reach distinct kernel configurations or first-use costs — a prefill
chunk at every power-of-two token count up to ``max_num_batched_tokens`` (W4A16 GEMMs pick a
config per M bucket; the prefill attention kernel), a mixed step (a prefill chunk with decodes:
attention's mixed variant), a full batch of decodes whose rows take every sampler path (greedy,
temperature with top-k / top-p / min-p, penalties, min_tokens, seeds, logprobs) and a prompt
with prompt logprobs — and how to build them as ``SchedulerOutput``s over KV pages that nobody
holds yet. Must not know: the scheduler's policy. Decode steps are warmed by CUDA-graph capture.

Only before the first request: the steps write garbage into free KV pages (harmless: a page's
content matters only once a request holds it, and the prefix cache is empty at start-up).
"""

from __future__ import annotations

import logging
import math
import time

from qserve.sampling_params import SamplingParams
from qserve.scheduler.output import ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)

SAMPLER_VARIANTS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.7, seed=1, logprobs=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.2, min_tokens=2, logprobs=0),
)


def _prompt(length: int, vocab_size: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % vocab_size for i in range(length)]


def warmup_steps(
    *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int, num_blocks: int,
    vocab_size: int,
) -> list[SchedulerOutput]:  # fmt: skip
    """The warm-up steps, each one ``SchedulerOutput`` over block ids ``0 .. num_blocks - 1``."""
    longest = min(max_num_batched_tokens, max_model_len - 1, num_blocks * block_size)
    steps: list[SchedulerOutput] = []

    def prefill(tokens: int, params: SamplingParams, name: str) -> ScheduledSequence:
        blocks = list(range(math.ceil(tokens / block_size)))
        return ScheduledSequence(name, 0, tokens, blocks, _prompt(tokens, vocab_size, tokens), [], params, True)

    sizes = sorted({min(2**k, longest) for k in range(4, max(4, longest.bit_length()) + 1)} | {longest})
    for tokens in sizes:  # every M bucket of a prefill chunk
        steps.append(SchedulerOutput([prefill(tokens, SAMPLER_VARIANTS[0], f"warmup-prefill-{tokens}")], tokens))
    # A mixed step: one prefill chunk and a few decodes (each decode reads one page, its own).
    chunk = min(64, longest)
    mixed = [prefill(chunk, SAMPLER_VARIANTS[0], "warmup-mixed-prefill")]
    first_free = math.ceil(chunk / block_size)
    for i in range(min(3, max_num_seqs - 1, num_blocks - first_free)):
        position = block_size - 1
        prompt = _prompt(position + 1, vocab_size, i)
        mixed.append(ScheduledSequence(f"warmup-mixed-{i}", position, 1, [first_free + i], prompt, [], SAMPLER_VARIANTS[0], True))  # fmt: skip
    steps.append(SchedulerOutput(mixed, chunk + len(mixed) - 1))
    # A full batch of decodes taking every sampler path (all rows read page 0).
    rows = []
    for i in range(max_num_seqs):
        params = SAMPLER_VARIANTS[i % len(SAMPLER_VARIANTS)]
        rows.append(ScheduledSequence(f"warmup-decode-{i}", 3, 1, [0], _prompt(3, vocab_size, i), [1], params, True))
    steps.append(SchedulerOutput(rows, len(rows)))
    # Prompt logprobs (their own logits slices).
    with_prompt_logprobs = SamplingParams(temperature=0.0, prompt_logprobs=5)
    steps.append(SchedulerOutput([prefill(min(32, longest), with_prompt_logprobs, "warmup-prompt-logprobs")], 32))
    return steps


def warm_up(runner, **shapes: int) -> int:  # noqa: ANN001 - a ModelRunner
    """Run every warm-up step through ``runner``; returns how many ran. Logs the time taken."""
    start = time.perf_counter()
    steps = warmup_steps(**shapes)
    for step in steps:
        runner.execute(step)
    finished = [seq.request_id for step in steps for seq in step.sequences]
    runner.execute(SchedulerOutput([], 0, finished_request_ids=finished))  # drop any per-request state
    logger.info("warm start: %d steps (prefill sizes, mixed, sampler paths) in %.1f s", len(steps),
                time.perf_counter() - start)  # fmt: skip
    return len(steps)
