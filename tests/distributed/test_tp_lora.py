"""Multi-LoRA under tensor parallelism on CPU (gloo, two ranks): TP=2 gives the same greedy tokens
and prompt logprobs (<= 1e-4, float32) as TP=1, for a batch mixing two adapters and base rows, with
adapters on q/k/v/o/gate/up/down, and again after an adapter is unloaded and its name loaded from
another directory while the workers serve steps (rank 0's registry changes reach every rank).

Models: the GPTQ act-order checkpoint (its row-parallel layers gather their input by a perm that
LoRA must not see) and the one-KV-head model (k / v heads replicated on both ranks, so both ranks
hold the whole k / v slices of B). Each rank's slots hold its shard only: column-parallel layers
A whole and their rows of B, row-parallel layers their columns of A and B whole, which the test
checks against the TP=1 engine's slots; the memory planner's per-rank bytes equal the slots'.
The launcher path (``LLM(..., tensor_parallel_size=2, enable_lora=True)``) runs once as well.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from qserve import LLM, LoRARequest, SamplingParams
from qserve.memory.planner import lora_slot_bytes
from tests.distributed.test_tp_equality import assert_same
from tests.helpers.lora_adapters import projection_shapes, write_peft_adapter

# two gloo processes per case: CI's newest job runs them, the lowest-versions job leaves them out
pytestmark = pytest.mark.slow

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODELS = {"gptq-act-order": 2, "kv1-tied-odd-vocab": 1}  # name -> KV heads (hidden 128, 4 heads of 32)
MAX_LORAS, MAX_RANK = 2, 8
PROMPTS = [
    [5, 17, 99, 3, 250, 7, 42],
    list(range(40, 75)),  # longer than a 16-token block
    [300, 12],
    [11, 12, 13, 14, 15],
]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
CONFIG = dict(
    device="cpu", dtype="float32", max_num_seqs=4, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK
)


def write_adapters(root: Path, kv_heads: int) -> dict[str, str]:
    """Three adapters on every projection of both layers: name -> directory."""
    shapes = projection_shapes(128, 256, 4, kv_heads, 32)
    paths = {}
    for seed, (name, rank) in enumerate((("a", 8), ("b", 4), ("c", 8))):
        paths[name] = str(root / name)
        write_peft_adapter(paths[name], shapes, 2, targets=ALL, rank=rank, alpha=2 * rank, seed=seed, std=0.1)
    return paths


def scenario(engine, adapters: dict[str, str]) -> list:  # noqa: ANN001
    """Round 1: adapters a, b and the base mixed in one batch (read at request time, after the
    workers started). Round 2: a unloaded, then the name a loaded from c's directory."""
    rounds = []
    first = [LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"]), None]
    second = [LoRARequest("a", 3, adapters["c"]), None, LoRARequest("b", 2, adapters["b"])]
    for index, loras in enumerate((first, second)):
        if index == 1:
            assert engine.remove_lora("a")
        for i, ids in enumerate(PROMPTS):
            lora = loras[i % len(loras)]
            engine.add_request(f"r{index}.{i}", {"prompt_token_ids": ids}, PARAMS, lora_request=lora)
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        rounds.append([finished[f"r{index}.{i}"] for i in range(len(PROMPTS))])
    return rounds


def slot_snapshot(engine) -> dict:  # noqa: ANN001
    """Every adapted layer's slot tensors, the adapters' slots and the slot bytes."""
    manager = engine.lora_manager
    return {
        "layers": {name: (w.a.clone(), w.b.clone(), w.slice_starts) for name, w in manager.layers.items()},
        "slots": {manager.name_of(i): slot for i, slot in manager._slot_of.items()},
        "nbytes": manager.nbytes,
    }


def _rank_main(rank: int, size: int, init_method: str, jobs: list[tuple], out: str, device: str) -> None:
    from qserve.distributed.parallel_state import destroy_tp_group, init_tp_group, rank_device
    from qserve.distributed.worker import BroadcastingRunner, serve_steps
    from qserve.engine.engine import Engine, EngineConfig

    rank_dev = rank_device(torch.device(device), rank)
    tp = init_tp_group(rank, size, init_method, rank_dev, timeout_s=120)
    results = {}
    try:
        for name, path, adapters in jobs:
            engine = Engine(EngineConfig(path, enforce_eager=True, **{**CONFIG, "device": str(rank_dev)}), tp=tp)
            outputs = None
            if rank == 0:
                runner = BroadcastingRunner(engine.runner, tp)
                engine.runner = runner
                outputs = scenario(engine, adapters)
                runner.stop_workers()
            else:
                serve_steps(engine.runner, tp)
            results[name] = (outputs, slot_snapshot(engine) if device == "cpu" else None)
    finally:
        destroy_tp_group(tp)
    Path(f"{out}.{rank}").write_bytes(pickle.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip seconds of interpreter finalization


@pytest.fixture(scope="module")
def lora_setup(tp_checkpoints, tmp_path_factory) -> tuple[dict, dict, list[dict]]:
    """(adapter dirs per model, TP=1 results per model, per-rank TP=2 results)."""
    root = tmp_path_factory.mktemp("tp_lora")
    adapters = {name: write_adapters(root / name, kv) for name, kv in MODELS.items()}
    want = {}
    for name in MODELS:
        llm = LLM(tp_checkpoints[name], **CONFIG)
        want[name] = (scenario(llm.engine, adapters[name]), slot_snapshot(llm.engine))
    return adapters, want, run_tp(tp_checkpoints, adapters, root / "results")


def run_tp(checkpoints: dict[str, str], adapters: dict, out: Path, device: str = "cpu") -> list[dict]:
    """Every model's scenario at TP=2 (one spawn of two ranks); per rank ``{model: (rounds, slots)}``."""
    from qserve.distributed.parallel_state import free_port

    jobs = [(name, checkpoints[name], adapters[name]) for name in MODELS]
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_rank_main, args=(2, init_method, jobs, str(out), device), nprocs=2, join=True)
    return [pickle.loads(Path(f"{out}.{rank}").read_bytes()) for rank in range(2)]


@pytest.mark.parametrize("name", MODELS)
def test_tp2_lora_matches_tp1(lora_setup, name) -> None:
    _, want, ranks = lora_setup
    want_rounds, got_rounds = want[name][0], ranks[0][name][0]
    for want_outputs, got_outputs in zip(want_rounds, got_rounds, strict=True):
        assert_same(want_outputs, got_outputs)
    # The adapters do change the outputs (else the comparison above would test the base only):
    # prompt 0 runs with a, then with the name a loaded from c; prompt 1 with b, then the base.
    for prompt in (0, 1):
        lp = [
            out.prompt_logprobs[3][PROMPTS[prompt][3]].logprob
            for out in (want_rounds[0][prompt], want_rounds[1][prompt])
        ]
        assert abs(lp[0] - lp[1]) > 1e-3, prompt


@pytest.mark.parametrize("name", MODELS)
def test_each_rank_holds_its_shard(lora_setup, name) -> None:
    """Slots of rank r == the TP=1 slots cut as the base weights are, for the same adapters."""
    _, want, ranks = lora_setup
    full = want[name][1]
    kv_heads, head_dim = MODELS[name], 32
    for rank, result in enumerate(ranks):
        got = result[name][1]
        assert got["slots"] == full["slots"]  # the same adapters in the same slots on every rank
        for layer, (a_full, b_full, _) in full["layers"].items():
            a, b, starts = got["layers"][layer]
            leaf = layer.rpartition(".")[2]
            if leaf == "qkv_proj":
                q = slice(rank * 64, rank * 64 + 64)  # 2 of 4 query heads
                kv_start = (rank * kv_heads // 2) * head_dim  # 1 KV head each; with 1 KV head, head 0 on both
                k = slice(128 + kv_start, 128 + kv_start + head_dim)
                v = slice(128 + kv_heads * head_dim + kv_start, 128 + kv_heads * head_dim + kv_start + head_dim)
                assert starts == (0, 64, 96, 128)
                torch.testing.assert_close(a, a_full, rtol=0, atol=0)  # A whole: [L, 3R, 128]
                torch.testing.assert_close(b, torch.cat([b_full[:, q], b_full[:, k], b_full[:, v]], 1), rtol=0, atol=0)
            elif leaf == "gate_up_proj":
                rows = torch.cat(
                    [torch.arange(rank * 128, rank * 128 + 128), torch.arange(256 + rank * 128, 384 + rank * 128)]
                )
                assert starts == (0, 128, 256)
                torch.testing.assert_close(a, a_full, rtol=0, atol=0)
                torch.testing.assert_close(b, b_full[:, rows], rtol=0, atol=0)  # [L, 256, R] of 512 rows
            else:  # o_proj (K 128), down_proj (K 256): A's columns of the rank, B whole
                k_local = a_full.shape[-1] // 2
                assert a.shape == (MAX_LORAS, MAX_RANK, k_local)
                torch.testing.assert_close(a, a_full[..., rank * k_local : (rank + 1) * k_local], rtol=0, atol=0)
                torch.testing.assert_close(b, b_full, rtol=0, atol=0)
        assert bool(full["layers"]["model.layers.0.self_attn.qkv_proj"][1].abs().sum() > 0)


@pytest.mark.parametrize("name", MODELS)
def test_planner_counts_slot_bytes_per_rank(tp_checkpoints, lora_setup, name) -> None:
    from qserve.model.registry import read_model_config

    _, want, ranks = lora_setup
    config = read_model_config(tp_checkpoints[name])
    assert want[name][1]["nbytes"] == lora_slot_bytes(config, MAX_LORAS, MAX_RANK, torch.float32)
    per_rank = lora_slot_bytes(config, MAX_LORAS, MAX_RANK, torch.float32, tensor_parallel_size=2)
    assert [r[name][1]["nbytes"] for r in ranks] == [per_rank, per_rank]
    assert per_rank < want[name][1]["nbytes"]


def test_llm_launcher_serves_adapters(tp_checkpoints, lora_setup) -> None:
    """``LLM(..., tensor_parallel_size=2, enable_lora=True)``: per-prompt adapters as TP=1."""
    adapters, want, _ = lora_setup
    name = "gptq-act-order"
    llm = LLM(tp_checkpoints[name], tensor_parallel_size=2, **CONFIG)
    try:
        loras = [LoRARequest("a", 1, adapters[name]["a"]), LoRARequest("b", 2, adapters[name]["b"]), None]
        got = llm.generate(
            [{"prompt_token_ids": ids} for ids in PROMPTS],
            PARAMS,
            use_tqdm=False,
            lora_request=[loras[i % 3] for i in range(len(PROMPTS))],
        )
        assert_same(want[name][0][0], got)
        assert sorted(llm.engine.list_loras()) == ["a", "b"]
    finally:
        llm.shutdown()


def test_serve_passes_lora_flags_to_the_launcher(tp_checkpoints, monkeypatch, capsys) -> None:
    """``qserve serve -tp 2 --enable-lora`` (refused before) reaches the launcher with the LoRA fields."""
    from qserve.cli import main
    from qserve.engine import tensor_parallel as launcher

    seen = []

    def no_launch(config, size):  # noqa: ANN001, ANN202
        seen.append((config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras, size))
        raise ValueError("stopped before spawning")

    monkeypatch.setattr(launcher, "launch_engine", no_launch)
    argv = ["serve", "--port", "0", tp_checkpoints["gptq-act-order"], "-tp", "2", "--device", "cpu"]
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8", "--max-cpu-loras", "5"]
    assert main([*argv, *lora]) == 2
    assert seen == [(True, 3, 8, 5, 2)]
    assert "stopped before spawning" in capsys.readouterr().err


def test_plan_sets_aside_one_ranks_slots(tp_checkpoints, capsys) -> None:
    """``qserve plan --tensor-parallel-size 2 --enable-lora``: the slot bytes of one rank."""
    import json

    from qserve.cli import main

    def lora_bytes(size: int) -> int:
        argv = ["plan", tp_checkpoints["gptq-act-order"], "--gpu-memory-budget", "1GiB", "--json"]
        lora = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8"]
        assert main([*argv, "--tensor-parallel-size", str(size), *lora]) == 0
        return json.loads(capsys.readouterr().out)["lora_bytes"]

    # Elements per layer and slot (R 8, hidden 128, q 128, k / v 64, intermediate 256): A + B of
    # qkv, o, gate_up, down; TP=2: B of qkv and gate_up and A of o and down halved.
    whole = (3 * 8 * 128 + 256 * 8) + (8 * 128 + 128 * 8) + (2 * 8 * 128 + 512 * 8) + (8 * 256 + 128 * 8)
    rank = (3 * 8 * 128 + 128 * 8) + (8 * 64 + 128 * 8) + (2 * 8 * 128 + 256 * 8) + (8 * 128 + 128 * 8)
    one, two = lora_bytes(1), lora_bytes(2)
    assert one > 0 and one * rank == two * whole


def test_replayed_journal_keeps_registry_and_slots_equal(tp_checkpoints, lora_setup) -> None:
    """The worker side of the protocol in one process: a manager replaying rank 0's journal assigns
    the same slots through a deferred removal (a request still runs with the adapter) and a name
    loaded again from another directory."""
    adapters = lora_setup[0]["gptq-act-order"]
    path = tp_checkpoints["gptq-act-order"]
    driver, worker = (LLM(path, **CONFIG).engine.lora_manager for _ in range(2))
    driver.journal = []

    def step(ids: list) -> list[int]:
        worker.replay(driver.journal)
        driver.journal.clear()
        slots = driver.assign_slots(ids).tolist()
        assert worker.assign_slots(ids).tolist() == slots
        return slots

    a = driver.add(LoRARequest("a", 1, adapters["a"]))
    b = driver.add(LoRARequest("b", 2, adapters["b"]))
    assert [op[:2] for op in driver.journal] == [("add", a), ("add", b)]
    step([a, None, b])
    driver.acquire(a)
    assert driver.remove("a") and not driver.journal  # deferred: still in use
    c = driver.add(LoRARequest("a", 3, adapters["c"]))  # the name a, another directory: a new id
    step([a, c])  # b leaves its slot
    driver.release(a)
    assert driver.journal[-1] == ("forget", a)
    step([b, c])
    assert sorted(worker.names()) == sorted(driver.names()) == ["a", "b"]
    assert worker.lookup("a") == driver.lookup("a") == c
    assert sorted(worker._by_id) == sorted(driver._by_id) == sorted([b, c])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_nccl_lora_matches_tp1(tp_checkpoints, lora_setup, tmp_path) -> None:
    """The same scenario with NCCL, rank r on cuda:r (float32 activations, so the 1e-4 bound holds)."""
    adapters, want, _ = lora_setup
    got = run_tp(tp_checkpoints, adapters, tmp_path / "results", device="cuda")
    for name in MODELS:
        for want_outputs, got_outputs in zip(want[name][0], got[0][name][0], strict=True):
            assert_same(want_outputs, got_outputs)
