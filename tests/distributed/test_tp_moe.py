"""Mixture-of-experts models under tensor parallelism on CPU (gloo), both ways of splitting the
routed experts: expert parallel (``enable_expert_parallel``: whole experts, rank r holds
experts ``[r*E/2, (r+1)*E/2)``) and, without the flag, every expert split along its
intermediate size. TP=2 gives TP=1's greedy tokens and prompt logprobs (<= 1e-4, float32) for
Qwen3-MoE (GPTQ; a dense MLP layer too), Mixtral (AWQ) and Qwen2-MoE with its shared expert
(compressed-tensors; GPTQ act-order).

In-process checks (a ``TPGroup`` of size 2 without a process group: loading needs no
collective): a rank holds only its experts' weights, equal to the single-process model's, and
the loader never reads the other rank's experts; the planner counts what a rank holds; bad
combinations are refused before any process starts.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from loaders.safetensors_io import CheckpointFiles
from qserve import LLM
from qserve.distributed.parallel_state import TPGroup
from qserve.distributed.sharding import expert_shard
from qserve.layers.moe import SparseMoeBlock
from qserve.model.loader import load_model
from quant_kernels.moe_layout import StackedQuantWeight
from tests.distributed.test_tp_equality import _rank_main, assert_same, reference
from tests.helpers.moe_models import moe_oracle, save_moe

# two gloo processes per case: CI's newest job runs them, the lowest-versions job leaves them out
pytestmark = pytest.mark.slow

EP = {"enable_expert_parallel": True}


def build_moe_checkpoints(root) -> dict[str, str]:  # noqa: ANN001 - a pathlib.Path
    """Tiny checkpoints whose widths split over 2 ranks in groups of 32 (hidden 64, 4 heads)."""
    qwen3 = moe_oracle("Qwen3MoeForCausalLM", seed=21, intermediate_size=128)  # layer 0 is a dense MLP
    mixtral = moe_oracle("MixtralForCausalLM", seed=22, intermediate_size=64)
    qwen2 = moe_oracle("Qwen2MoeForCausalLM", seed=23, shared_expert_intermediate_size=64)
    qwen2_act = moe_oracle(
        "Qwen2MoeForCausalLM", seed=24, moe_intermediate_size=64, shared_expert_intermediate_size=64
    )  # the experts' down projections have two groups: a real act-order permutation each
    return {
        "qwen3-gptq": str(save_moe(qwen3, root / "qwen3", fmt="gptq", group_size=32)),
        "mixtral-awq": str(save_moe(mixtral, root / "mixtral", fmt="awq", group_size=32, sym=False)),
        "qwen2-ct": str(save_moe(qwen2, root / "qwen2", fmt="ct", group_size=32, sym=False)),
        "qwen2-gptq-act-order": str(
            save_moe(qwen2_act, root / "qwen2-act", fmt="gptq", group_size=32, sym=False, act_order=True)
        ),
    }


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    return build_moe_checkpoints(tmp_path_factory.mktemp("moe"))


JOBS = [  # (result name, checkpoint, extra EngineConfig fields)
    ("qwen3-gptq/ep", "qwen3-gptq", EP),
    ("qwen3-gptq/tp", "qwen3-gptq", {}),
    ("mixtral-awq/ep", "mixtral-awq", EP),
    ("mixtral-awq/tp", "mixtral-awq", {}),
    ("qwen2-ct/ep", "qwen2-ct", EP),
    ("qwen2-ct/tp", "qwen2-ct", {}),
    ("qwen2-gptq-act-order/ep", "qwen2-gptq-act-order", EP),
]


@pytest.fixture(scope="module")
def tp2_moe_outputs(moe_checkpoints, tmp_path_factory) -> dict[str, list]:
    """One spawn of two gloo ranks serves every job in turn (as ``test_tp_equality``)."""
    import pickle

    import torch.multiprocessing as mp

    from qserve.distributed.parallel_state import free_port

    out = tmp_path_factory.mktemp("tp2moe") / "results.pkl"
    jobs = [(name, moe_checkpoints[ckpt], extra) for name, ckpt, extra in JOBS]
    mp.spawn(_rank_main, args=(2, f"tcp://127.0.0.1:{free_port()}", jobs, "cpu", str(out)), nprocs=2, join=True)
    return pickle.loads(out.read_bytes())


@pytest.fixture(scope="module")
def tp1_moe_outputs(moe_checkpoints) -> dict[str, list]:
    return {name: reference(path) for name, path in moe_checkpoints.items()}


@pytest.mark.parametrize(("name", "checkpoint"), [(name, ckpt) for name, ckpt, _ in JOBS])
def test_tp2_moe_matches_tp1(tp1_moe_outputs, tp2_moe_outputs, name, checkpoint) -> None:
    assert_same(tp1_moe_outputs[checkpoint], tp2_moe_outputs[name])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("fused", [False, True])
def test_tp2_moe_nccl_matches_tp1(moe_checkpoints, tmp_path, monkeypatch, fused) -> None:
    """The same over NCCL, rank r on cuda:r (float32 activations): the default per-expert loop
    and, with QSERVE_FUSED_MOE=1, the fused kernel skipping the other rank's pairs."""
    import pickle

    import torch.multiprocessing as mp

    from qserve.distributed.parallel_state import free_port

    monkeypatch.setenv("QSERVE_FUSED_MOE", "1" if fused else "0")  # the spawned ranks inherit it
    out = tmp_path / "results.pkl"
    jobs = [(name, moe_checkpoints[ckpt], extra) for name, ckpt, extra in JOBS]
    mp.spawn(_rank_main, args=(2, f"tcp://127.0.0.1:{free_port()}", jobs, "cuda", str(out)), nprocs=2, join=True)
    got = pickle.loads(out.read_bytes())
    for name, ckpt, _ in JOBS:
        assert_same(reference(moe_checkpoints[ckpt], "cuda"), got[name])


# ----------------------------------------------------------------------------------------------
# One rank's shard, built in this process
# ----------------------------------------------------------------------------------------------


def rank_group(rank: int, size: int = 2) -> TPGroup:
    """A rank's view without a process group: enough to build and load its shard."""
    return TPGroup(rank=rank, size=size, backend="gloo", device=torch.device("cpu"))


def _blocks(model) -> list[SparseMoeBlock]:  # noqa: ANN001
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def _expert_bytes(model) -> int:  # noqa: ANN001
    return sum(block.expert_nbytes() for block in _blocks(model))


@pytest.mark.parametrize("name", ["qwen3-gptq", "mixtral-awq", "qwen2-gptq-act-order"])
def test_expert_parallel_rank_holds_and_reads_only_its_experts(moe_checkpoints, monkeypatch, name) -> None:
    path = moe_checkpoints[name]
    full, config = load_model(path, torch.float32, "cpu")
    reads: list[str] = []
    real_get = CheckpointFiles.get

    def recording_get(self, tensor_name: str) -> torch.Tensor:  # noqa: ANN001
        reads.append(tensor_name)
        return real_get(self, tensor_name)

    monkeypatch.setattr(CheckpointFiles, "get", recording_get)
    per_rank = config.num_experts // 2
    for rank in range(2):
        reads.clear()
        shard, _ = load_model(path, torch.float32, "cpu", tp=rank_group(rank), enable_expert_parallel=True)
        read_experts = {int(m.group(1)) for n in reads if (m := re.search(r"\.experts\.(\d+)\.", n))}
        assert read_experts == set(range(rank * per_rank, (rank + 1) * per_rank))  # never the other rank's
        for mine, whole in zip(_blocks(shard), _blocks(full), strict=True):
            assert (mine.expert_start, mine.num_local_experts, mine.num_experts) == (rank * per_rank, per_rank, 8)
            held = slice(rank * per_rank, (rank + 1) * per_rank)
            for got, want in ((mine.w_gate_up, whole.w_gate_up), (mine.w_down, whole.w_down)):
                assert isinstance(got, StackedQuantWeight) and got.num_experts == per_rank
                assert torch.equal(got.qweight, want.qweight[held]) and torch.equal(got.scales, want.scales[held])
                assert (got.perm is None) == (want.perm is None)
                if got.perm is not None:
                    assert torch.equal(got.perm, want.perm[held])
            assert torch.equal(mine.gate.weight, whole.gate.weight)  # the router is replicated
        assert 2 * _expert_bytes(shard) == _expert_bytes(full)


def test_tensor_parallel_experts_hold_a_slice_of_every_expert(moe_checkpoints) -> None:
    """Without the flag: all 8 experts on each rank, gate/up columns and down rows of its half."""
    path = moe_checkpoints["qwen3-gptq"]
    full, config = load_model(path, torch.float32, "cpu")
    inter = config.moe_intermediate_size // 2
    for rank in range(2):
        shard, _ = load_model(path, torch.float32, "cpu", tp=rank_group(rank))
        for mine, whole in zip(_blocks(shard), _blocks(full), strict=True):
            assert (mine.expert_start, mine.num_local_experts, mine.intermediate_size) == (0, 8, inter)
            cols = torch.cat([torch.arange(rank * inter, (rank + 1) * inter)] * 2) + torch.tensor(
                [0] * inter + [config.moe_intermediate_size] * inter
            )  # this rank's gate columns, then its up columns
            assert torch.equal(mine.w_gate_up.qweight, whole.w_gate_up.qweight[:, :, cols])
            rows = slice(rank * inter // 8, (rank + 1) * inter // 8)  # 8 codes per int32 word along K
            assert torch.equal(mine.w_down.qweight, whole.w_down.qweight[:, rows])
        # K = 32 is one group: each rank's 16 rows of a down projection keep its one scale row
        replicated = sum(b.w_down.scales.numel() * b.w_down.scales.element_size() for b in _blocks(shard))
        assert 2 * _expert_bytes(shard) - _expert_bytes(full) == replicated


def test_planner_counts_the_rank_s_experts(moe_checkpoints) -> None:
    """``weight_bytes`` per rank: what a loaded expert-parallel shard holds (<= 1.5x, as the
    single-process check), and in both modes everything but the replicated tensors (norms,
    rotary tables, routers, shared-expert gates, the vocabulary's padding row) splits exactly
    in two: a rank counts half of the experts' bytes."""
    import math

    import loaders
    from qserve.memory.planner import weight_bytes
    from qserve.model.registry import read_model_config

    path = moe_checkpoints["qwen2-ct"]
    config, spec = read_model_config(path), loaders.detect(path)
    shard, _ = load_model(path, torch.float32, "cpu", tp=rank_group(1), enable_expert_parallel=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in shard.parameters()}
    storages |= {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in shard.buffers()}
    held = sum(storages.values()) + _expert_bytes(shard)  # stacked experts are neither parameters nor buffers
    planned = weight_bytes(config, spec, torch.float32, 2, enable_expert_parallel=True)
    assert held <= planned < 1.5 * held

    h, elem = config.hidden_size, 4
    replicated = (2 * config.num_layers + 1) * h * elem  # norms
    replicated += config.max_position_embeddings * config.head_dim * 4  # rotary cos / sin
    replicated += len(config.moe_layers) * (config.num_experts + 1) * h * elem  # routers + shared-expert gates
    replicated += 2 * (2 * math.ceil(config.vocab_size / 2) - config.vocab_size) * h * elem  # embedding, lm_head pad
    one = weight_bytes(config, spec, torch.float32)
    assert 2 * weight_bytes(config, spec, torch.float32, 2, True) - one == replicated
    # Without expert parallelism each expert's down (K = 32, one group) keeps its scale and zero row on both ranks.
    down_groups = len(config.moe_layers) * config.num_experts * h * (elem + 1)
    assert 2 * weight_bytes(config, spec, torch.float32, 2, False) - one == replicated + down_groups


def test_planner_refuses_indivisible_experts_and_plan_cli_takes_the_flag(tmp_path, capsys) -> None:
    from qserve.cli import main
    from qserve.memory.planner import weight_bytes
    from qserve.model.registry import read_model_config
    from tests.unit.test_planner_moe import QWEN3_30B_A3B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    args = ["plan", str(tmp_path), "--gpu-memory-budget", "24GiB", "--json", "--tensor-parallel-size", "2"]
    assert main([*args, "--enable-expert-parallel"]) == 0
    plan = json.loads(capsys.readouterr().out)
    import loaders

    config = read_model_config(tmp_path)
    assert plan["weights_bytes"] == weight_bytes(config, loaders.detect(tmp_path), torch.bfloat16, 2, True)
    assert plan["weights_bytes"] < 0.55 * weight_bytes(config, loaders.detect(tmp_path), torch.bfloat16)
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_experts": 126}))  # 126 % 4 != 0
    assert main(["plan", str(tmp_path), "--gpu-memory-budget", "24GiB", "--tensor-parallel-size", "4",
                 "--enable-expert-parallel"]) == 2  # fmt: skip
    assert "num_experts=126 is not divisible by tensor_parallel_size=4" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------


def test_expert_shard_rules() -> None:
    assert [expert_shard(8, 32, r, 4, True).expert_start for r in range(4)] == [0, 2, 4, 6]
    assert expert_shard(8, 32, 3, 4, True).holds(7) and not expert_shard(8, 32, 3, 4, True).holds(5)
    split = expert_shard(8, 32, 1, 2, False)
    assert (split.num_local_experts, split.intermediate_start, split.intermediate_size) == (8, 16, 16)
    with pytest.raises(ValueError, match="num_experts=7 is not divisible by tensor_parallel_size=2"):
        expert_shard(7, 32, 0, 2, True)
    with pytest.raises(ValueError, match="moe_intermediate_size=30 is not divisible by tensor_parallel_size=4"):
        expert_shard(8, 30, 0, 4, False)


def _config_only(tmp_path, **overrides) -> str:  # noqa: ANN001
    """A MoE model directory holding only config.json: what the checks before any spawn read."""
    model = moe_oracle("Qwen3MoeForCausalLM", seed=0, intermediate_size=128, **overrides)
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    return str(tmp_path)


def test_indivisible_experts_refused_before_any_process_starts(tmp_path) -> None:
    path = _config_only(tmp_path, num_experts=7)
    with pytest.raises(ValueError, match="num_experts=7 is not divisible by tensor_parallel_size=2"):
        LLM(path, device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)


def test_speculation_refused_with_expert_parallel(tmp_path) -> None:
    path = _config_only(tmp_path)
    common = dict(device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match="speculative_config is not supported with tensor parallelism"):
        LLM(path, speculative_config=spec, **common)


def test_act_order_expert_down_split_refused_without_expert_parallel(moe_checkpoints) -> None:
    with pytest.raises(ValueError, match=r"act-order .* use --enable-expert-parallel"):
        load_model(moe_checkpoints["qwen2-gptq-act-order"], torch.float32, "cpu", tp=rank_group(0))


def test_serve_and_generate_pass_the_flag_to_the_launcher(moe_checkpoints, monkeypatch, capsys) -> None:
    from qserve.cli import main
    from qserve.engine import tensor_parallel as launcher

    seen = []

    def no_launch(config, size):  # noqa: ANN001, ANN202
        seen.append((config.enable_expert_parallel, size))
        raise ValueError("stopped before spawning")

    monkeypatch.setattr(launcher, "launch_engine", no_launch)
    argv = ["serve", "--port", "0", moe_checkpoints["qwen3-gptq"], "-tp", "2", "--device", "cpu"]
    assert main([*argv, "--enable-expert-parallel"]) == 2
    assert main(argv) == 2
    generate = ["generate", moe_checkpoints["qwen3-gptq"], "--prompt", "Hi", "--tensor-parallel-size", "2"]
    assert main([*generate, "--device", "cpu", "--enable-expert-parallel"]) == 2
    assert seen == [(True, 2), (False, 2), (True, 2)]
    assert "stopped before spawning" in capsys.readouterr().err
