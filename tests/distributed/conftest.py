"""Tiny checkpoints for the tensor-parallel tests (built once per session, a few hundred KB each).

Dims divide for TP=2 with group 32: hidden 128 (o_proj K/2 = 64), intermediate 256 (down_proj
K/2 = 128), 4 heads of 32, 2 KV heads. Weights are random (``quant_packers.random_llama_state``),
the tokenizer is the test tokenizer; prompts are given as token ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.quant_packers import (
    awq_config,
    gptq_config,
    quantize_state_dict,
    random_llama_state,
    tiny_llama_config,
    write_checkpoint,
)
from tests.helpers.tokenizer import make_tokenizer

GROUP = 32
BASE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 400, "torch_dtype": "float32"}  # fmt: skip


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    write_checkpoint(path, config, tensors)
    make_tokenizer(str(path))
    return str(path)


def build_checkpoints(root: Path) -> dict[str, str]:
    """name -> checkpoint directory."""
    paths = {}
    cfg = tiny_llama_config(**BASE)
    state = random_llama_state(cfg, seed=1, dtype=torch.float32)
    paths["dense"] = _write(root / "dense", cfg, state)

    gptq = quantize_state_dict(state, "gptq", group_size=GROUP, sym=False, act_order=True)
    gcfg = {**cfg, "quantization_config": gptq_config(4, GROUP, sym=False, desc_act=True)}
    paths["gptq-act-order"] = _write(root / "gptq", gcfg, gptq.tensors)

    awq = quantize_state_dict(state, "awq", group_size=GROUP, sym=False)
    paths["awq"] = _write(root / "awq", {**cfg, "quantization_config": awq_config(GROUP)}, awq.tensors)

    # One KV head (replicated on both ranks), tied embeddings and a vocabulary that does not
    # divide by 2 (rank 1's table is padded).
    kcfg = tiny_llama_config(**{**BASE, "num_key_value_heads": 1, "vocab_size": 401, "tie_word_embeddings": True})
    paths["kv1-tied-odd-vocab"] = _write(root / "kv1", kcfg, random_llama_state(kcfg, seed=2, dtype=torch.float32))
    return paths


@pytest.fixture(scope="session")
def tp_checkpoints(tmp_path_factory) -> dict[str, str]:
    return build_checkpoints(tmp_path_factory.mktemp("tp"))
