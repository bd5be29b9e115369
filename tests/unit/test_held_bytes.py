"""qserve.layers.held_bytes: a 4-bit model's held bytes include its packed weights (which are not
parameters), so the adaptive policy's draft cost of an EAGLE head over a 4-bit target is the head's
bytes over the target's whole weights. Counted from parameters alone (the bug this guards against),
a 14B GPTQ target looked 3.1 GB large and every EAGLE head cost more than a target step: adaptive k
chose 0 drafts and never speculated (bench/RESULTS.md, twelfth session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from bench.e2e import SMALL, write_random_gptq
from bench.spec_decode import write_eagle_head
from qserve import LLM
from qserve.layers.held_bytes import held_weight_bytes
from qserve.spec_decode import draft_layers

ARGS = dict(max_model_len=128, num_kv_blocks=32, block_size=16)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("held") / "target"
    write_random_gptq(path, SMALL)
    return path


def _packed_bytes(path: Path) -> int:
    """Bytes of the checkpoint's 4-bit codes (qweight) alone: a floor for what the loaded layers hold."""
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.endswith(".qweight"):
                    tensor = f.get_tensor(name)
                    total += tensor.numel() * tensor.element_size()
    return total


def _parameter_bytes(module) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def test_a_4bit_models_held_bytes_include_its_packed_weights(target: Path) -> None:
    model = LLM(str(target), **ARGS).engine.model
    packed = _packed_bytes(target)
    assert packed > 0
    assert held_weight_bytes(model) >= _parameter_bytes(model) + packed


def test_an_eagle_heads_draft_cost_is_over_the_targets_whole_weights(target: Path, tmp_path: Path) -> None:
    head = tmp_path / "head"
    write_eagle_head(target, head, "layers1")
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3, "enable_adaptive_verification": True}
    engine = LLM(str(target), speculative_config=spec, **ARGS).engine
    want = engine._eagle_head.weight_bytes() / held_weight_bytes(engine.model)
    assert engine._draft_cost() == pytest.approx(want)
    assert engine.adaptive_speculation.draft_cost == pytest.approx(want)
    # the head is dense: its parameters are what it holds
    assert held_weight_bytes(engine._eagle_head) == _parameter_bytes(engine._eagle_head)
    # the packed weights are in the denominator: a parameter-only count would make the head costlier
    assert engine._draft_cost() < engine._eagle_head.weight_bytes() / _parameter_bytes(engine.model)
    # a 4-bit target lm_head (EAGLE drafts through it): its packed weights count in the head's bytes too
    dense_lm_head = engine._eagle_head.weight_bytes()
    draft_layers.quantize_linear(engine.model.lm_head)
    assert engine._eagle_head.weight_bytes() == held_weight_bytes(engine._eagle_head) + held_weight_bytes(
        engine.model.lm_head
    )
    assert held_weight_bytes(engine._eagle_head) < engine._eagle_head.weight_bytes() < dense_lm_head
