"""On a GPU: quantize a model with Qwen2.5-14B's layer shapes (2 layers) and check that one layer at a
time fits a 24 GB card, and that the result reloads bit-exactly. Run with ``pytest -m gpu``."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import save_file

import loaders
from qserve.quantize import QuantizeOptions, quantize_checkpoint
from qserve.quantize.demo import DEMO_CALIB, DEMO_MODEL
from quant_kernels.reference import dequantize_input_order

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = dict(hidden=5120, inter=13824, heads=40, kv_heads=8, head_dim=128, layers=2, vocab=2048)


def make_14b_shaped_checkpoint(path) -> None:
    s = SHAPES
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device="cuda") * std).half().cpu()

    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    tensors = {
        "model.embed_tokens.weight": rnd(s["vocab"], s["hidden"], std=1.0),
        "lm_head.weight": rnd(s["vocab"], s["hidden"]),
    }
    tensors["model.norm.weight"] = torch.ones(s["hidden"], dtype=torch.float16)
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(s["hidden"], dtype=torch.float16),
            p + "post_attention_layernorm.weight": torch.ones(s["hidden"], dtype=torch.float16),
            p + "self_attn.q_proj.weight": rnd(q, s["hidden"]), p + "self_attn.q_proj.bias": rnd(q),
            p + "self_attn.k_proj.weight": rnd(kv, s["hidden"]), p + "self_attn.k_proj.bias": rnd(kv),
            p + "self_attn.v_proj.weight": rnd(kv, s["hidden"]), p + "self_attn.v_proj.bias": rnd(kv),
            p + "self_attn.o_proj.weight": rnd(s["hidden"], q),
            p + "mlp.gate_proj.weight": rnd(s["inter"], s["hidden"]),
            p + "mlp.up_proj.weight": rnd(s["inter"], s["hidden"]),
            p + "mlp.down_proj.weight": rnd(s["hidden"], s["inter"]),
        }  # fmt: skip
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": s["hidden"],
        "intermediate_size": s["inter"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "num_hidden_layers": s["layers"], "vocab_size": s["vocab"], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
        "eos_token_id": 0,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEMO_MODEL / name, path / name)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_14b_layers_quantize_within_a_24gb_card(tmp_path, method) -> None:
    src = tmp_path / "src"
    make_14b_shaped_checkpoint(src)
    torch.cuda.reset_peak_memory_stats()
    meant = {}
    start = time.perf_counter()
    options = QuantizeOptions(
        method=method, calib=str(DEMO_CALIB), num_samples=128, seq_len=512, device="cuda", desc_act=method == "gptq"
    )
    report = quantize_checkpoint(
        src, tmp_path / "out", options, observer=lambda n, q: meant.__setitem__(n, q.dequantize().cpu())
    )
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"\n{method}: 2 layers of Qwen2.5-14B shape, 128x512 calibration: {seconds:.1f} s ({report.seconds / 2:.1f} s/layer incl. setup), peak {peak:.2f} GiB"
    )
    assert peak < 20, peak
    for name, value in loaders.iter_weights(tmp_path / "out"):
        if name in meant:
            assert torch.equal(dequantize_input_order(value, torch.float32), meant[name]), name
