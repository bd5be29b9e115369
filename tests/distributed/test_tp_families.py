"""Tensor parallelism for the non-Llama families: TP=2 on CPU/gloo gives TP=1's prompt logprobs
(<= 1e-4) and greedy tokens for Baichuan2-13B (ALiBi slopes split by head), ChatGLM3 (two
multi-query groups, one per rank; interleaved partial rotary) and Qwen v1 (dynamic NTK + logn
past a 16-token seq_length). Same machinery as ``test_tp_equality``."""

from __future__ import annotations

import pickle

import pytest
import torch.multiprocessing as mp

from tests.distributed.test_tp_equality import _rank_main, assert_same, reference
from tests.helpers.family_models import glm_oracle, qwen2_oracle, save_baichuan, save_chatglm, save_qwen_v1
from tests.helpers.tiny_models import make_tiny_model


@pytest.mark.slow
def test_tp2_matches_tp1_for_families(tmp_path) -> None:
    from qserve.distributed.parallel_state import free_port

    llama = make_tiny_model("LlamaForCausalLM", seed=11, num_attention_heads=4, num_key_value_heads=4)
    checkpoints = {
        "baichuan-alibi": str(save_baichuan(llama, tmp_path / "baichuan", "alibi")),
        "chatglm3": str(save_chatglm(glm_oracle(seed=12, rope_theta=20000.0), tmp_path / "chatglm", rope_ratio=2)),
        "qwen-v1-ntk": str(save_qwen_v1(qwen2_oracle(seed=13), tmp_path / "qwen", seq_length=16)),
    }
    out = tmp_path / "tp_results.pkl"
    jobs = list(checkpoints.items())
    mp.spawn(_rank_main, args=(2, f"tcp://127.0.0.1:{free_port()}", jobs, "cpu", str(out)), nprocs=2, join=True)
    results = pickle.loads(out.read_bytes())
    for name, path in checkpoints.items():
        assert_same(reference(path), results[name])
