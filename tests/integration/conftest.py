"""Shared tiny checkpoints for the integration tests (built once per session)."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_models import ARCHITECTURES, make_tiny_model, save_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, tuple[object, str]]:
    """architecture -> (the transformers model in float32, checkpoint path)."""
    result = {}
    for i, arch in enumerate(ARCHITECTURES):
        overrides = {}
        if arch == "LlamaForCausalLM":
            overrides["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        if arch == "Qwen2ForCausalLM":
            overrides["tie_word_embeddings"] = True
        model = make_tiny_model(arch, seed=i, **overrides)
        path = save_tiny_checkpoint(model, tmp_path_factory.mktemp(arch), shard_size="60KB" if i == 0 else None)
        result[arch] = (model, str(path))
    return result


@pytest.fixture(scope="session")
def llama_llm(tiny_checkpoints):
    from qserve import LLM

    return LLM(tiny_checkpoints["LlamaForCausalLM"][1], device="cpu", dtype="float32")
