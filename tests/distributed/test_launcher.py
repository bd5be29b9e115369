"""The launcher behind ``LLM(..., tensor_parallel_size=N)`` and ``qserve generate
--tensor-parallel-size N``: this process becomes rank 0 and spawns the others; results equal
TP=1. Also: ``qserve serve`` refuses tensor parallelism over several models, bad sizes refuse."""

from __future__ import annotations

import pytest

from qserve import LLM
from qserve.cli import main
from tests.distributed.test_tp_equality import PARAMS, PROMPTS, assert_same, generate


def test_llm_tensor_parallel_matches_single_process(tp_checkpoints, capsys) -> None:
    path = tp_checkpoints["gptq-act-order"]
    want = generate(LLM(path, device="cpu", dtype="float32", max_num_seqs=4).engine)
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=4, tensor_parallel_size=2)
    try:
        got = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], PARAMS)
        assert_same(want, got)
        assert llm.engine.tp.size == 2 and llm.engine.tp.rank == 0
        down = llm.engine.model.model.layers[0].mlp.down_proj  # act-order, row-parallel: padded groups
        assert down.input_index is not None and down.weight_in_features % 16 == 0
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in llm._tensor_parallel.processes)
    llm.shutdown()  # idempotent


def test_generate_cli_uses_the_launcher(tp_checkpoints, capsys, monkeypatch) -> None:
    """``qserve generate --tensor-parallel-size 2`` streams from the launcher's rank-0 engine and
    shuts it down (the launcher is replaced by a single-process stand-in: no second spawn)."""
    from qserve.engine import tensor_parallel as launcher
    from qserve.engine.engine import Engine

    calls = []

    class StandIn:
        def __init__(self, config, size) -> None:  # noqa: ANN001
            calls.append((config, size))
            self.engine = Engine(config)

        def shutdown(self) -> None:
            calls.append("shutdown")

    monkeypatch.setattr(launcher, "launch_engine", StandIn)
    path = tp_checkpoints["dense"]
    common = ["generate", path, "--prompt", "The quick brown fox", "--max-tokens", "5", "--device", "cpu"]
    assert main(common) == 0
    single = capsys.readouterr().out
    assert main([*common, "--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == single
    assert calls[0][1] == 2 and calls[0][0].model == path and calls[-1] == "shutdown"


def test_serve_refuses_tensor_parallel_with_several_models(tp_checkpoints, capsys) -> None:
    path = tp_checkpoints["dense"]
    assert main(["serve", f"a={path}", f"b={path}", "--tensor-parallel-size", "2", "--device", "cpu"]) == 2
    assert "--tensor-parallel-size 2 serves one model; got 2 models" in capsys.readouterr().err


def test_bad_sizes_refused(tp_checkpoints) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(tp_checkpoints["dense"], device="cpu", tensor_parallel_size=0)
