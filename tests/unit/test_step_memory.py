"""The memory planner reserves at least what the runner's worst step allocates (issue 17, item 5).

Measured on CPU with the runner's own code on a tiny model (``tests.helpers.live_bytes``
counts every tensor storage an op creates while it lives): the same torch ops allocate the
same tensors on the GPU, so a step that outgrows the plan here outgrows it there. The vocabulary
is made large next to the hidden size so logits and the sampler dominate, as on real models.

Worst steps: a full batch of decodes whose rows ask for everything the sampler does (penalties,
min_tokens, top-k + top-p + min-p, seeds, logprobs), more rows than one sampler chunk; and a
prompt longer than one prompt-logprobs slice asking for prompt logprobs. Before the fix the
planner counted 16 bytes per sampled logit (the sampler takes ~40) and nothing for prompt
logprobs ([P, vocab] float32 logits, log-softmax and ranks at once).
"""

from __future__ import annotations

import pytest
import torch

from qserve.engine.engine import Engine, EngineConfig
from qserve.memory.planner import activation_bytes_estimate, sampling_bytes
from qserve.model.registry import read_model_config
from qserve.runner.sampler import (
    PROMPT_LOGPROBS_CHUNK_ROWS,
    SAMPLER_CHUNK_ROWS,
    Sampler,
    build_sampling_metadata,
)
from qserve.sampling_params import SamplingParams
from qserve.scheduler.output import RunnerOutput, ScheduledSequence, SchedulerOutput
from tests.helpers.live_bytes import LiveBytes
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

VOCAB = 4096
MAX_NUM_SEQS = SAMPLER_CHUNK_ROWS + 32  # more rows than one sampler chunk
MAX_BATCHED = PROMPT_LOGPROBS_CHUNK_ROWS * 2 + 88  # more prompt positions than one slice
BLOCK = 16

WORST = SamplingParams(
    temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=0.3, frequency_penalty=0.2,
    repetition_penalty=1.1, min_tokens=4, logprobs=20, seed=7,
)  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    model = make_tiny_model("LlamaForCausalLM", seed=3, vocab_size=VOCAB, max_position_embeddings=1024)
    path = save_tiny_checkpoint(model, tmp_path_factory.mktemp("step-memory"))
    config = EngineConfig(
        model=str(path), device="cpu", dtype="float32", max_model_len=1024, num_kv_blocks=256,
        max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED, block_size=BLOCK,
    )  # fmt: skip
    return Engine(config)


def _measure(engine: Engine, sequences: list[ScheduledSequence]) -> tuple[int, int, RunnerOutput]:
    """(peak bytes of the whole step, peak bytes of its sampling part, the step's output)."""
    runner = engine.runner
    sample = runner._sample  # noqa: SLF001 - wrapped to measure the sampling part alone
    sampling_peak = []

    def measured_sample(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with LiveBytes() as inner:
            result = sample(*args, **kwargs)
        sampling_peak.append(inner.peak)
        return result

    runner._sample = measured_sample  # noqa: SLF001
    try:
        output = SchedulerOutput(sequences=sequences, num_batched_tokens=sum(s.num_new_tokens for s in sequences))
        with LiveBytes() as step:
            result = runner.execute(output)
    finally:
        del runner._sample  # noqa: SLF001 - back to the class's method
    assert len(result.sampled_token_ids) == sum(s.sample for s in sequences)
    return step.peak, sampling_peak[0], result


def test_full_batch_of_worst_case_sampling_rows_fits_the_plan(engine):
    sequences = []
    for i in range(MAX_NUM_SEQS):
        prompt = [(i * 7 + j) % 300 + 3 for j in range(8)]
        sequences.append(ScheduledSequence(f"r{i}", 9, 1, [i], prompt, [5, 6], WORST, True))
    step_peak, sampling_peak, _ = _measure(engine, sequences)
    config = engine.model_config
    planned_sampling = sampling_bytes(config, MAX_NUM_SEQS, 0, torch.float32)
    assert sampling_peak <= planned_sampling
    assert step_peak <= activation_bytes_estimate(config, MAX_BATCHED, MAX_NUM_SEQS, torch.float32)
    assert planned_sampling < 2.5 * sampling_peak  # the plan is a bound, not a blanket


def test_long_prompt_with_prompt_logprobs_fits_the_plan(engine):
    prompt = [(j * 13) % 390 + 3 for j in range(MAX_BATCHED)]
    params = SamplingParams(temperature=0.0, prompt_logprobs=20, max_tokens=1)
    blocks = list(range(-(-MAX_BATCHED // BLOCK)))
    sequence = ScheduledSequence("p", 0, MAX_BATCHED, blocks, prompt, [], params, True)
    step_peak, sampling_peak, result = _measure(engine, [sequence])
    # The slices add up to every position, in order: entry i scores prompt token i + 1.
    entries = result.prompt_logprobs["p"]
    assert [e.token_ids[0] for e in entries] == prompt[1:]
    assert all(len(e.token_ids) == 21 and e.ranks[0] >= 1 for e in entries)
    config = engine.model_config
    assert sampling_peak <= sampling_bytes(config, 1, MAX_BATCHED, torch.float32)
    assert step_peak <= activation_bytes_estimate(config, MAX_BATCHED, MAX_NUM_SEQS, torch.float32)


def test_chunked_sampler_rows_match_rows_sampled_alone():
    """Row chunks change nothing for greedy and seeded rows (their tokens never depend on the batch)."""
    rows = SAMPLER_CHUNK_ROWS * 2 + 9
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, 300, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=2, min_tokens=3, stop_token_ids=[7])
        if i % 3 == 0
        else SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=i, repetition_penalty=1.2, logprobs=1)
        for i in range(rows)
    ]
    prompts = [[1 + i % 5, 2, 3] for i in range(rows)]
    outputs = [[4, 7][: i % 3] for i in range(rows)]
    md = build_sampling_metadata(params, prompts, outputs, [0], 300, "cpu")
    tokens, logprobs = Sampler(seed=1)(logits, md)
    for i in range(rows):
        alone = build_sampling_metadata([params[i]], [prompts[i]], [outputs[i]], [0], 300, "cpu")
        token, lp = Sampler(seed=1)(logits[i : i + 1], alone)
        assert tokens[i] == token[0], i
        assert logprobs[i].token_ids == lp[0].token_ids and logprobs[i].ranks == lp[0].ranks, i


def test_a_measured_peak_below_the_samplers_worst_case_is_raised_to_it(engine):
    """The GPU profiler measures a forward and a plain softmax + sort; the plan must still hold
    the sampler's worst case and a prompt-logprobs slice."""
    from qserve.memory.planner import make_plan

    config = engine.model_config
    plan = make_plan(
        config, weights_bytes=0, budget_bytes=1 << 30, dtype=torch.float32, max_model_len=1024,
        max_num_batched_tokens=MAX_BATCHED, max_num_seqs=MAX_NUM_SEQS, activation_bytes=1, overhead_bytes=0,
    )  # fmt: skip
    assert plan.activation_bytes == sampling_bytes(config, MAX_NUM_SEQS, MAX_BATCHED, torch.float32) > 1


def test_weight_bytes_cover_everything_the_loaded_model_holds(tmp_path):
    """Parameters and buffers of a loaded GPTQ model, rotary tables included (they were not counted)."""
    import loaders
    from bench.e2e import SMALL, write_random_gptq
    from qserve.memory.planner import weight_bytes
    from qserve.model.loader import load_model

    write_random_gptq(tmp_path, SMALL)
    config = read_model_config(tmp_path)
    model, _ = load_model(str(tmp_path), torch.float16, torch.device("cpu"))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.parameters()}
    storages |= {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.buffers()}
    held = sum(storages.values())
    planned = weight_bytes(config, loaders.detect(str(tmp_path)), torch.float16)
    assert held <= planned < 1.5 * held


def test_warm_start_runs_every_step_kind_without_touching_the_pool(engine):
    """The start-up warm-up (run on GPUs before /health is ready): prefill chunks at every
    power-of-two size up to max_num_batched_tokens, a mixed step, every sampler path, prompt logprobs."""
    from qserve.runner.warmup import warm_up, warmup_steps

    shapes = dict(max_num_batched_tokens=MAX_BATCHED, max_num_seqs=MAX_NUM_SEQS, max_model_len=1024,
                  block_size=BLOCK, num_blocks=engine.block_pool.num_blocks, vocab_size=VOCAB)  # fmt: skip
    steps = warmup_steps(**shapes)
    prefill_sizes = [
        s.sequences[0].num_new_tokens for s in steps if len(s.sequences) == 1 and s.sequences[0].start_position == 0
    ]
    assert prefill_sizes[:6] == [16, 32, 64, 128, 256, 512] and MAX_BATCHED in prefill_sizes
    mixed = [s for s in steps if len({q.num_new_tokens > 1 for q in s.sequences}) == 2]
    assert mixed, "no step mixes a prefill chunk with decodes"
    assert any(len(s.sequences) == MAX_NUM_SEQS for s in steps)
    free = engine.block_pool.num_free_blocks
    assert warm_up(engine.runner, **shapes) == len(steps)
    assert engine.block_pool.num_free_blocks == free
