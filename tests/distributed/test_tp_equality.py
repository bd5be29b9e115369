"""Tensor parallelism end to end on CPU: TP=2 (two gloo processes) gives the same prompt
logprobs (<= 1e-4, float32) and the same greedy tokens as TP=1, for a dense model, a GPTQ
act-order model, an AWQ model and a model with fewer KV heads than ranks (tied embeddings,
odd vocabulary).

One ``torch.multiprocessing.spawn`` of two ranks (rendezvous on a free port of 127.0.0.1)
serves every model in turn: each rank builds ``Engine(config, tp=group)``; rank 0 drives it
through ``BroadcastingRunner`` and rank 1 runs ``serve_steps`` — the same pieces the launcher
assembles (``test_launcher.py`` covers the launcher itself). TP=1 references run in-process.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from qserve import LLM, SamplingParams

PROMPTS = [
    [5, 17, 99, 3, 250, 7, 42],
    list(range(40, 75)),  # longer than a 16-token block
    [300, 12],
]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
MODELS = ["dense", "gptq-act-order", "awq", "kv1-tied-odd-vocab"]


def generate(engine, prompts: list[list[int]] = PROMPTS, params: SamplingParams = PARAMS) -> list:  # noqa: ANN001
    """What ``LLM.generate`` does, on a given engine: outputs in prompt order."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[f"r{i}"] for i in range(len(prompts))]


def _rank_main(rank: int, size: int, init_method: str, jobs: list[tuple], device: str, out: str) -> None:
    """``jobs``: ``(name, path)`` or ``(name, path, extra EngineConfig fields)``."""
    from qserve.distributed.parallel_state import destroy_tp_group, init_tp_group, rank_device
    from qserve.distributed.worker import BroadcastingRunner, serve_steps
    from qserve.engine.engine import Engine, EngineConfig

    rank_dev = rank_device(torch.device(device), rank)
    tp = init_tp_group(rank, size, init_method, rank_dev, timeout_s=120)
    results = {}
    try:
        for name, path, *extra in jobs:
            config = EngineConfig(
                path, device=str(rank_dev), dtype="float32", max_num_seqs=4, enforce_eager=True, **(extra or [{}])[0]
            )
            engine = Engine(config, tp=tp)
            if rank == 0:
                runner = BroadcastingRunner(engine.runner, tp)
                engine.runner = runner
                results[name] = generate(engine)
                runner.stop_workers()
            else:
                serve_steps(engine.runner, tp)
    finally:
        destroy_tp_group(tp)
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip seconds of interpreter finalization (torch, tokenizers)


def run_tp(checkpoints: dict[str, str], tmp_path: Path, device: str = "cpu", size: int = 2) -> dict[str, list]:
    from qserve.distributed.parallel_state import free_port

    out = tmp_path / "tp_results.pkl"
    jobs = [(name, checkpoints[name]) for name in MODELS]
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_rank_main, args=(size, init_method, jobs, device, str(out)), nprocs=size, join=True)
    return pickle.loads(out.read_bytes())


def reference(path: str, device: str = "cpu") -> list:
    llm = LLM(path, device=device, dtype="float32", max_num_seqs=4)
    return generate(llm.engine)


def assert_same(want_outputs: list, got_outputs: list) -> None:
    assert len(got_outputs) == len(want_outputs)
    for ref, out in zip(want_outputs, got_outputs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
        for position in range(1, len(ref.prompt_token_ids)):
            want, have = ref.prompt_logprobs[position], out.prompt_logprobs[position]
            token = ref.prompt_token_ids[position]
            assert abs(have[token].logprob - want[token].logprob) <= 1e-4, position
            for token_id, entry in want.items():  # the top-2 as well
                assert token_id in have and abs(have[token_id].logprob - entry.logprob) <= 1e-4, position


@pytest.fixture(scope="module")
def tp2_outputs(tp_checkpoints, tmp_path_factory) -> dict[str, list]:
    return run_tp(tp_checkpoints, tmp_path_factory.mktemp("tp2"))


@pytest.mark.parametrize("name", MODELS)
def test_tp2_matches_tp1(tp_checkpoints, tp2_outputs, name) -> None:
    assert_same(reference(tp_checkpoints[name]), tp2_outputs[name])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_nccl_matches_tp1(tp_checkpoints, tmp_path) -> None:
    """The same with NCCL, rank r on cuda:r (float32 activations, so the 1e-4 bound holds)."""
    got = run_tp(tp_checkpoints, tmp_path, device="cuda")
    for name in MODELS:
        assert_same(reference(tp_checkpoints[name], "cuda"), got[name])
