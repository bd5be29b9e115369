"""Async scheduling (``EngineConfig.async_scheduling``): the same tokens, text, logprobs, finish
reasons and token counts as the synchronous order over a mixed workload (stops, max_tokens, an
abort mid-stream, preemption under a tiny KV pool, chunked prefill, n > 1, prompt logprobs,
penalties, logit bias), no extra token ever emitted, and the next step launched before the
previous step's outputs are processed (penalties included)."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.outputs import RequestOutput

PROMPT = list(range(40, 58))  # 18 tokens
# A small pool (24 pages of 4 tokens for ~10 sequences of up to ~50 tokens) forces preemptions;
# a 16-token budget chunks the prefills.
ENGINE_ARGS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)


def _engine(path: str, async_scheduling: bool, **overrides):  # noqa: ANN202 - an Engine
    return LLM(path, async_scheduling=async_scheduling, **{**ENGINE_ARGS, **overrides}).engine


def _workload(stop_token: int) -> list[tuple[str, dict, SamplingParams]]:
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        ("greedy", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=12, **greedy)),
        ("prefix", {"prompt_token_ids": PROMPT + [3, 4]}, SamplingParams(max_tokens=10, **greedy)),
        (
            "n2",
            {"prompt_token_ids": PROMPT[:7]},
            SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=9, logprobs=2, ignore_eos=True),
        ),
        ("seeded", {"prompt_token_ids": [9, 8, 7]}, SamplingParams(temperature=1.0, seed=11, min_tokens=4, max_tokens=8)),
        ("stop_str", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(temperature=0, max_tokens=16, stop=["e"])),
        ("stop_tok", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token])),
        ("plp", {"prompt_token_ids": [60, 61, 62, 63, 64]}, SamplingParams(max_tokens=5, prompt_logprobs=1, **greedy)),
        ("penalty", {"prompt_token_ids": PROMPT[3:]}, SamplingParams(temperature=0, max_tokens=7, repetition_penalty=1.3, min_tokens=3)),
        ("bias", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=6, logit_bias={5: 2.0}, logprobs=1, **greedy)),
        ("abort", {"prompt_token_ids": PROMPT[::-1]}, SamplingParams(max_tokens=40, **greedy)),
        ("long", {"prompt_token_ids": PROMPT[5:]}, SamplingParams(max_tokens=24, **greedy)),
    ]  # fmt: skip


def _run(
    engine, requests, abort_after: int = 3
) -> tuple[dict[str, RequestOutput], dict[str, list[RequestOutput]], int]:
    """Run to the end; ``abort`` is aborted once the caller has seen ``abort_after`` of its tokens.
    Returns the final outputs, every output streamed per request, and the number of step() calls."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final: dict[str, RequestOutput] = {}
    streamed: dict[str, list[RequestOutput]] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        num_steps += 1
        assert num_steps < 500
        for output in engine.step():
            assert output.request_id not in final, "an output after the final one"
            streamed.setdefault(output.request_id, []).append(output)
            if output.finished:
                final[output.request_id] = output
            elif output.request_id == "abort" and len(output.outputs[0].token_ids) >= abort_after:
                engine.abort_request("abort")
    return final, streamed, num_steps


def _assert_logprobs_close(a, b) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for position_a, position_b in zip(a, b):
        assert (position_a is None) == (position_b is None)
        if position_a is None:
            continue
        assert set(position_a) == set(position_b)
        for token, entry in position_a.items():
            # 1e-3: the same tokens, but (likely) a step whose batch differs between the two orders (async keeps
            # a finished request one step longer) replays another graph bucket, whose kernels sum in
            # another order; in float32 that moved a logprob by 1.1e-4 on the H200 (2026-12-05)
            assert entry.logprob == pytest.approx(position_b[token].logprob, abs=1e-3)
            assert entry.rank == position_b[token].rank


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoints) -> str:
    return tiny_checkpoints["LlamaForCausalLM"][1]


def test_mixed_workload_same_outputs_with_async_scheduling_on_and_off(llama_path):
    reference = LLM(llama_path, device="cpu", dtype="float32", async_scheduling=False)
    greedy = reference.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    stop_token = greedy[0].outputs[0].token_ids[4]  # "stop_tok" stops mid-stream, at the latest at its 5th token
    requests = _workload(stop_token)
    max_tokens = {request_id: params.max_tokens for request_id, _, params in requests}

    runs = {}
    for mode in (False, True):
        engine = _engine(llama_path, mode)
        final, streamed, _ = _run(engine, requests)
        assert engine.num_preemptions > 0, "the tiny pool should force preemptions"
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks  # every page back
        runs[mode] = final, streamed

    (sync_final, sync_streamed), (async_final, async_streamed) = runs[False], runs[True]
    assert sorted(async_final) == sorted(sync_final) == sorted(max_tokens)
    for request_id, expected in sync_final.items():
        got = async_final[request_id]
        assert len(got.outputs) == len(expected.outputs)
        for a, b in zip(got.outputs, expected.outputs):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.stop_reason,
            ), request_id
            _assert_logprobs_close(a.logprobs, b.logprobs)
            if b.cumulative_logprob is not None:
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)
        _assert_logprobs_close(got.prompt_logprobs, expected.prompt_logprobs)

    assert async_final["stop_tok"].outputs[0].finish_reason == "stop"
    assert async_final["stop_tok"].outputs[0].token_ids[-1] == stop_token
    assert async_final["abort"].outputs[0].finish_reason == "abort"
    assert len(async_final["abort"].outputs[0].token_ids) == 3  # the token in flight at the abort is dropped
    assert async_final["plp"].prompt_logprobs is not None and len(async_final["plp"].prompt_logprobs) == 5

    # No extra token: every stream only grows, within max_tokens, and ends where the final output does;
    # the usage (token counts) is the same in both modes.
    for streamed in (sync_streamed, async_streamed):
        for request_id, outputs in streamed.items():
            for index in range(len(outputs[0].outputs)):
                previous: list[int] = []
                for output in outputs:
                    tokens = output.outputs[index].token_ids
                    assert tokens[: len(previous)] == previous and len(tokens) <= max_tokens[request_id]
                    previous = tokens
    usage = {mode: sum(len(c.token_ids) for output in runs[mode][0].values() for c in output.outputs) for mode in runs}
    assert usage[True] == usage[False]


def test_step_count_one_more_step_call_and_one_dropped_token(llama_path):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    counts = {}
    for mode in (False, True):
        engine = _engine(llama_path, mode, num_kv_blocks=None, max_num_batched_tokens=None)
        events = _call_order(engine)
        final, streamed, num_steps = _run(engine, [("r", {"prompt_token_ids": PROMPT}, params)])
        assert len(final["r"].outputs[0].token_ids) == 12
        # one output per produced token: the stream delivers every step
        assert [len(o.outputs[0].token_ids) for o in streamed["r"]] == list(range(1, 13))
        counts[mode] = num_steps, sum(kind == "launch" for kind, _ in events)
    assert counts[False] == (12, 12)  # a prefill and 11 decodes
    assert counts[True] == (13, 13)  # plus the last call's speculative decode, whose token is dropped


def _call_order(engine) -> list[tuple[str, int]]:
    """Instrument the runner's launches and the scheduler's updates: (event, step number)."""
    events: list[tuple[str, int]] = []
    numbers: dict[int, int] = {}
    alive: list[object] = []  # keeps every output alive, so no id() is reused for a later step
    launch, update = engine.runner.launch, engine.scheduler.update_from_output

    def spy_launch(scheduler_output, *args, **kwargs):  # noqa: ANN202
        alive.append(scheduler_output)
        numbers[id(scheduler_output)] = len(numbers)
        events.append(("launch", numbers[id(scheduler_output)]))
        return launch(scheduler_output, *args, **kwargs)

    def spy_update(scheduler_output, runner_output):  # noqa: ANN202
        events.append(("update", numbers[id(scheduler_output)]))
        return update(scheduler_output, runner_output)

    engine.runner.launch = spy_launch
    engine.scheduler.update_from_output = spy_update
    return events


def _next_launched_before_processed(events: list[tuple[str, int]]) -> bool:
    """True when every step N with a step N+1 had N+1 launched before N's outputs were processed."""
    position = {event: i for i, event in enumerate(events)}
    pairs = [(n, n + 1) for kind, n in events if kind == "launch" and ("launch", n + 1) in position]
    assert pairs, "the run had fewer than two steps"
    return all(position[("launch", m)] < position[("update", n)] for n, m in pairs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_next_step_launched_before_previous_outputs_are_processed(llama_path, async_scheduling):
    engine = _engine(llama_path, async_scheduling, num_kv_blocks=None)
    events = _call_order(engine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    _run(engine, [("a", {"prompt_token_ids": PROMPT}, params), ("b", {"prompt_token_ids": PROMPT[:5]}, params)])
    assert _next_launched_before_processed(events) is async_scheduling


def test_penalties_stay_asynchronous_and_give_the_synchronous_tokens(llama_path):
    """Penalties (which Qwen's generation_config.json puts on every request) keep the async order:
    the in-flight token is counted from the device. The tokens equal the synchronous order's, and
    the penalties do change them (a run without them differs), so a token missed or counted twice
    would show."""
    params = SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.6,
        presence_penalty=0.4,
    )
    requests = [("p", {"prompt_token_ids": PROMPT}, params), ("q", {"prompt_token_ids": PROMPT[4:]}, params)]
    tokens = {}
    for mode in (False, True):
        engine = _engine(llama_path, mode, num_kv_blocks=None)
        events = _call_order(engine)
        final, _, _ = _run(engine, requests)
        assert _next_launched_before_processed(events) is mode
        tokens[mode] = {rid: out.outputs[0].token_ids for rid, out in final.items()}
    assert tokens[True] == tokens[False]
    plain = _run(
        _engine(llama_path, True, num_kv_blocks=None),
        [("p", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))],
    )[0]
    assert plain["p"].outputs[0].token_ids != tokens[True]["p"]


def test_switching_async_scheduling(llama_path):
    engine = _engine(llama_path, True, num_kv_blocks=None)
    assert engine.async_scheduling
    engine.add_request("x", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.set_async_scheduling(False)
    _run(engine, [])
    engine.set_async_scheduling(False)
    assert not engine.async_scheduling and not engine.scheduler.async_scheduling


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_async_scheduling_same_outputs(llama_path, enforce_eager):
    """On the GPU: pinned non-blocking copies, the sampled ids' event and the device-side fill of
    placeholder inputs (into the CUDA graphs' static buffer or the eager input ids) and of the
    penalties' in-flight output slot."""
    requests = [
        ("g", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)),
        ("s", {"prompt_token_ids": PROMPT[:6]}, SamplingParams(temperature=0.8, seed=7, max_tokens=16, min_tokens=4)),
        ("n", {"prompt_token_ids": PROMPT[2:]}, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12)),
        (
            "p",
            {"prompt_token_ids": PROMPT[1:]},
            SamplingParams(
                temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.3
            ),
        ),
    ]
    finals = []
    for mode in (False, True):
        # A fixed small pool: by default the first engine's pool would take the GPU memory the
        # second engine's planner needs (both live in this process).
        engine = LLM(
            llama_path,
            device="cuda",
            dtype="float32",
            enforce_eager=enforce_eager,
            async_scheduling=mode,
            num_kv_blocks=64,
        ).engine
        finals.append(_run(engine, requests)[0])
        del engine
    for request_id in finals[0]:
        for a, b in zip(finals[0][request_id].outputs, finals[1][request_id].outputs):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), request_id
            _assert_logprobs_close(a.logprobs, b.logprobs)
