"""Swap preemption on the CPU engine (issue 17, item 6; ``preemption_mode="swap"``): under a KV pool so
small that preemption must happen, swapping gives the same outputs as recompute (greedy, seeded,
logprobs, prompt logprobs, stops, an abort), in both step orders, while computing fewer tokens; a
full host pool falls back to recompute; aborting a swapped request frees its host slots; bad
values are refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, SamplingParams
from tests.integration.test_async_scheduling import ENGINE_ARGS, PROMPT, _assert_logprobs_close, _run, _workload

SWAP_SPACE_GIB = 2**20 / 2**30  # 1 MiB: 512 host blocks of the tiny model (2 KiB per block of 4 tokens)


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoints) -> str:
    return tiny_checkpoints["LlamaForCausalLM"][1]


def _engine(path: str, mode: str, async_scheduling: bool = False, swap_space: float = SWAP_SPACE_GIB, **overrides):  # noqa: ANN202
    engine = LLM(
        path,
        async_scheduling=async_scheduling,
        preemption_mode=mode,
        swap_space=swap_space,
        **{**ENGINE_ARGS, **overrides},
    ).engine
    engine.scheduler.watermark, engine.scheduler.watermark_per_running = 0.0, 0  # preempt, don't hold back
    computed = []
    schedule = engine.scheduler.schedule

    def counting_schedule():  # noqa: ANN202
        out = schedule()
        computed.append(out.num_batched_tokens)
        return out

    engine.scheduler.schedule = counting_schedule
    engine.computed_tokens = computed  # tokens computed (prefill + decode) over the run
    return engine


def _host_slots_free(engine) -> bool:  # noqa: ANN001
    space = engine.scheduler.swap_space
    return space is None or (space.num_free_slots == space.num_slots and space.num_swapped == 0)


@pytest.fixture(scope="module")
def workload(llama_path):  # noqa: ANN201
    reference = LLM(llama_path, device="cpu", dtype="float32")
    greedy = reference.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    unpressured, _, _ = _run(reference.engine, _workload(greedy[0].outputs[0].token_ids[4]))
    return _workload(greedy[0].outputs[0].token_ids[4]), unpressured


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for request_id, expected in want.items():
        output = got[request_id]
        for a, b in zip(output.outputs, expected.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), request_id
            _assert_logprobs_close(a.logprobs, b.logprobs)
        _assert_logprobs_close(output.prompt_logprobs, expected.prompt_logprobs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_swap_gives_recompute_outputs_without_recomputing(llama_path, workload, async_scheduling):
    requests, unpressured = workload
    recompute = _engine(llama_path, "recompute", async_scheduling)
    recompute_final, _, _ = _run(recompute, requests)
    swap = _engine(llama_path, "swap", async_scheduling)
    swap_final, _, _ = _run(swap, requests)

    _assert_same(recompute_final, unpressured)
    _assert_same(swap_final, unpressured)  # the abort too: it ends after the 3 tokens streamed
    assert len(swap_final["abort"].outputs[0].token_ids) == 3

    assert recompute.num_preemptions > 0 and recompute.scheduler.num_swapped_out == 0
    assert swap.num_preemptions > 0, "the tiny pool should force preemptions"
    assert swap.scheduler.num_swapped_out > 0
    assert swap.scheduler.num_swapped_in <= swap.scheduler.num_swapped_out
    assert sum(swap.computed_tokens) < sum(recompute.computed_tokens)  # nothing recomputed
    for engine in (recompute, swap):
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        assert _host_slots_free(engine)


def test_a_full_host_pool_falls_back_to_recompute(llama_path, workload):
    requests, unpressured = workload
    probe = _engine(llama_path, "swap")
    one_block = probe.runner.kv_swapper.block_bytes / 2**30  # swap_space holding a single block
    engine = _engine(llama_path, "swap", swap_space=1.5 * one_block)
    assert engine.scheduler.swap_space.num_slots == 1
    final, _, _ = _run(engine, requests)
    _assert_same(final, unpressured)
    assert engine.num_preemptions > engine.scheduler.num_swapped_out  # some victims were recomputed
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks and _host_slots_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_aborting_a_swapped_request_frees_its_host_slots(llama_path, async_scheduling):
    engine = _engine(llama_path, "swap", async_scheduling, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPT[i:]}, params)
    space = engine.scheduler.swap_space
    aborted = None
    for _ in range(300):
        engine.step()
        swapped = [r for r in engine.scheduler.waiting if r.status.value == "swapped"]
        if swapped and aborted is None:
            aborted = swapped[0].request_id
            held = space.num_slots - space.num_free_slots
            engine.abort_request(aborted)
            assert not space.holds(aborted)
            assert space.num_slots - space.num_free_slots < held
        if not engine.has_unfinished_requests():
            break
    assert aborted is not None, "nothing was swapped out"
    assert not engine.has_unfinished_requests() and _host_slots_free(engine)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(preemption_mode="swapp"), "preemption_mode"),
        (dict(preemption_mode="swap", swap_space=-1.0), "swap_space"),
        (dict(preemption_mode="swap", swap_space=0), "swap_space"),
    ],
    ids=["unknown-mode", "negative-space", "space-for-no-block"],
)
def test_bad_values_are_refused_naming_the_flag(llama_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama_path, device="cpu", dtype="float32", **kwargs)


def test_serve_flags_are_checked_before_loading(tmp_path):
    import argparse

    from qserve.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--preemption-mode", "never"])
    args = parser.parse_args([str(tmp_path), "--preemption-mode", "swap", "--swap-space", "-2"])
    with pytest.raises(ValueError, match="--swap-space"):
        serve.build_host_factory(args)
    args = parser.parse_args([str(tmp_path), "--preemption-mode", "auto", "--tensor-parallel-size", "2"])
    with pytest.raises(ValueError, match="--preemption-mode"):
        serve.build_host_factory(args)


def test_llm_refuses_swap_with_tensor_parallel_before_starting_workers(llama_path, monkeypatch):
    from qserve.engine import tensor_parallel as launcher

    def no_launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("worker processes were started before the refusal")

    monkeypatch.setattr(launcher, "launch_engine", no_launch)
    with pytest.raises(ValueError, match="preemption_mode 'swap' is not supported with tensor parallelism"):
        LLM(llama_path, device="cpu", tensor_parallel_size=2, preemption_mode="swap")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_swapped_mid_prefill_sends_each_prompt_logprob_once(llama_path, async_scheduling):
    """A prompt-logprobs request swapped out halfway through its chunked prefill resumes there: its
    prompt logprobs are those of an unpressured run, none sent twice or lost."""
    long_prompt = {"prompt_token_ids": list(range(100, 160))}  # 15 of the 24 blocks
    plp_prompt = {"prompt_token_ids": list(range(200, 236))}  # 9 blocks: the two cannot both grow
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plp_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    roomy = LLM(llama_path, device="cpu", dtype="float32").generate([long_prompt, plp_prompt], [params, plp_params])
    engine = _engine(llama_path, "swap", async_scheduling, max_num_batched_tokens=8)
    swapped_at = []
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202
        out = schedule()
        swapped_at.extend(
            engine.scheduler.requests[r].num_computed_tokens for r in out.swapped_out_request_ids if r == "plp"
        )
        return out

    engine.scheduler.schedule = spy
    final, _, _ = _run(engine, [("long", long_prompt, params), ("plp", plp_prompt, plp_params)])
    assert swapped_at and 0 < swapped_at[0] < 36, f"plp was not swapped out mid-prefill: {swapped_at}"
    assert final["plp"].outputs[0].token_ids == roomy[1].outputs[0].token_ids
    assert len(final["plp"].prompt_logprobs) == 36
    _assert_logprobs_close(final["plp"].prompt_logprobs, roomy[1].prompt_logprobs)
    assert final["long"].outputs[0].token_ids == roomy[0].outputs[0].token_ids


@pytest.mark.parametrize(("bandwidth", "swaps"), [(1e15, True), (1.0, False)], ids=["fast-link", "slow-link"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_auto_measures_its_costs_and_follows_them(llama_path, workload, bandwidth, swaps, async_scheduling):
    """Both orders learn the per-token recompute cost (the async one from the time between two
    chained steps' results)."""
    requests, unpressured = workload
    engine = _engine(llama_path, "auto", async_scheduling, max_num_batched_tokens=64)
    cost = engine.swap_cost
    assert cost is engine.scheduler.swap_cost and cost.bandwidth_bytes_per_s > 0  # measured at start-up
    default_per_token = cost.recompute_seconds_per_token
    cost.bandwidth_bytes_per_s = bandwidth
    final, _, _ = _run(engine, requests)
    _assert_same(final, unpressured)
    assert engine.num_preemptions > 0
    assert (engine.scheduler.num_swapped_out > 0) is swaps
    assert cost.recompute_seconds_per_token != default_per_token  # measured on the 64-token steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_swap_same_greedy_tokens_as_recompute(llama_path, async_scheduling):
    """On the GPU (CUDA graphs, pinned pool, non_blocking copies): 8 greedy sequences of ~42 tokens
    on 8 pages of 16 tokens. Recompute rebuilds the KV with prefill-shaped GEMMs, so a flip here
    can also be numerics; tests/unit/test_kv_swap.py checks the copies themselves exactly."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = [(f"r{i}", {"prompt_token_ids": PROMPT[i:] + PROMPT[:i]}, params) for i in range(8)]
    finals, engines = {}, {}
    for mode in ("recompute", "swap"):
        engine = LLM(
            llama_path, device="cuda", dtype="float32", num_kv_blocks=8, async_scheduling=async_scheduling,
            preemption_mode=mode, swap_space=SWAP_SPACE_GIB,
        ).engine  # fmt: skip
        engine.scheduler.watermark, engine.scheduler.watermark_per_running = 0.0, 0
        finals[mode] = {k: v.outputs[0].token_ids for k, v in _run(engine, requests)[0].items()}
        engines[mode] = engine.num_preemptions, engine.scheduler.num_swapped_out, _host_slots_free(engine)
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        del engine
    assert engines["recompute"][0] > 0 and engines["swap"][1] > 0 and engines["swap"][2]
    for request_id, tokens in finals["recompute"].items():
        got = finals["swap"][request_id]
        first = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
        assert got == tokens, f"{request_id}: first difference at token {first}"
