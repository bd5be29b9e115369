"""bench/e2e.py --model qwen3-30b-a3b: the bytes a decode step reads (its floor) agree with the
memory planner's count of the same weights, the expected experts per step match families.md /
benchmarks.md, and the script's --small mode runs end to end on CPU."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import loaders
from bench.e2e import (
    QWEN3_30B_A3B,
    SMALL_MOE,
    expected_experts_hit,
    main,
    moe_step_bytes,
    qwen3_moe_config,
    write_random_moe_gptq,
)
from qserve.memory.planner import weight_bytes
from qserve.model.registry import read_model_config
from tests.unit.test_planner_moe import QWEN3_30B_A3B as PUBLISHED


def test_expected_experts_hit() -> None:
    assert expected_experts_hit(128, 8, 1) == pytest.approx(8)
    assert expected_experts_hit(128, 8, 32) == pytest.approx(111.8, abs=0.05)  # benchmarks.md: ~112 of 128
    assert 127 < expected_experts_hit(128, 8, 128) < 128
    hits = [expected_experts_hit(128, 8, b) for b in (1, 8, 32, 128)]
    assert hits == sorted(hits)


def test_shape_is_the_published_config() -> None:
    ours = qwen3_moe_config(QWEN3_30B_A3B)
    keys = ("hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_experts", "num_experts_per_tok", "norm_topk_prob", "vocab_size", "rope_theta")  # fmt: skip
    assert {k: ours[k] for k in keys} == {k: PUBLISHED[k] for k in keys}


@pytest.mark.parametrize("lm_head_bits", [16, 4])
@pytest.mark.parametrize("shape", [SMALL_MOE, QWEN3_30B_A3B], ids=["small", "qwen3-30b-a3b"])
def test_step_bytes_with_every_expert_hit_are_the_planned_weights(tmp_path, shape, lm_head_bits) -> None:
    """All experts hit: the floor's bytes == the planner's weights less the embeddings (never read
    whole) and the float32 rotary tables (held, not weights of the checkpoint); with a 4-bit lm_head
    too (the planner reads quantization_config.lm_head)."""
    (tmp_path / "config.json").write_text(json.dumps(qwen3_moe_config(shape, lm_head_bits=lm_head_bits)))
    config = read_model_config(tmp_path)
    planned = weight_bytes(config, loaders.detect(tmp_path), torch.float16)
    unread = shape["vocab"] * shape["hidden"] * 2 + config.max_position_embeddings * config.head_dim * 4
    step = moe_step_bytes(shape, batch=10**6, lm_head_bits=lm_head_bits)
    assert step["hit"] == pytest.approx(shape["experts"])
    assert step["total"] == pytest.approx(planned - unread, rel=1e-12)
    one = moe_step_bytes(shape, batch=1, lm_head_bits=lm_head_bits)
    assert one["dense"] == step["dense"] and one["experts"] == pytest.approx(
        step["experts"] * shape["top_k"] / shape["experts"]
    )


def test_small_moe_checkpoint_loads_with_the_bytes_the_floor_counts(tmp_path) -> None:
    """The experts qserve holds after loading the random checkpoint are the bytes the floor counts
    for every expert hit (codes + fp16 scales, no zeros: symmetric)."""
    from qserve.model.loader import load_model

    write_random_moe_gptq(tmp_path, SMALL_MOE)
    config = read_model_config(tmp_path)
    assert (config.num_experts, config.num_experts_per_tok, len(config.moe_layers)) == (8, 2, 2)
    model, _ = load_model(str(tmp_path), torch.float16, torch.device("cpu"))
    held = sum(m.expert_nbytes() for m in model.modules() if hasattr(m, "expert_nbytes"))
    assert held == moe_step_bytes(SMALL_MOE, batch=10**6)["experts"]


def test_small_checkpoint_with_a_4bit_lm_head_loads_it_quantized(tmp_path) -> None:
    """--lm-head-bits 4: the lm_head is written as GPTQ tensors (config lm_head: true) and qserve holds
    it as a 4-bit linear whose bytes are what the floor counts for it; logits come out of it."""
    from qserve.model.loader import load_model

    write_random_moe_gptq(tmp_path, SMALL_MOE, lm_head_bits=4)
    assert loaders.detect(tmp_path).lm_head_quantized
    model, _ = load_model(str(tmp_path), torch.float16, torch.device("cpu"))
    head = model.lm_head
    assert not isinstance(getattr(head, "weight", None), torch.Tensor)  # not a dense [V, H] weight
    head_bytes = head.method.weight_nbytes(head)
    step16, step4 = (moe_step_bytes(SMALL_MOE, 1, lm_head_bits=b)["dense"] for b in (16, 4))
    assert step16 - step4 == 2 * SMALL_MOE["vocab"] * SMALL_MOE["hidden"] - head_bytes
    hidden = torch.randn(3, SMALL_MOE["hidden"], dtype=torch.float16) * 0.1
    assert head(hidden).shape == (3, SMALL_MOE["vocab"])


@pytest.mark.slow  # builds and serves a toy MoE checkpoint end to end (~10 s)
def test_small_mode_runs_on_cpu(tmp_path, monkeypatch) -> None:
    out = tmp_path / "moe.md"
    argv = ["e2e.py", "--model", "qwen3-30b-a3b", "--small", "--num-requests", "4", "--decode-batches", "1,4",
            "--skip", "small,fp8", "--tmp", str(tmp_path / "ckpt"), "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main()
    finally:
        torch.set_num_threads(threads)
    table = out.read_text()
    assert "| decode batch 1 |" in table and "2.0 of 8 experts/layer" in table
    assert "| decode batch 4 |" in table and "5.5 of 8 experts/layer" in table  # 8 (1 - (3/4)^4)
    assert "| capacity, KV auto | 8 sequences of 1,024 tokens" in table
    assert "| offline ShareGPT-like, model-dtype KV | 4 requests" in table
    assert "fp8" not in table  # --skip fp8: the fp8-KV engine is not built


def test_a_4bit_lm_head_is_refused_for_the_dense_model(monkeypatch, capsys) -> None:
    """--lm-head-bits 4 builds only the MoE checkpoint: asked of the dense 14B it stops, naming the option."""
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--small", "--lm-head-bits", "4"])
    with pytest.raises(SystemExit):
        main()
    assert "--lm-head-bits 4 is built for --model qwen3-30b-a3b only" in capsys.readouterr().err
