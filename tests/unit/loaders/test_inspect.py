"""``qserve inspect MODEL [--json]`` on each checkpoint variant."""

from __future__ import annotations

import json

import pytest
import torch

from qserve.cli import main
from tests.helpers.quant_packers import awq_config, ct_config, gptq_config


def _inspect(capsys, path, *extra: str) -> str:
    # These checkpoints hold weights only (no tokenizer files): what inspect then describes.
    assert main(["inspect", str(path), "--skip-tokenizer-init", *extra]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "fmt,qc,kwargs,expect",
    [
        (
            "gptq",
            gptq_config(4, 32, sym=False, desc_act=True),
            dict(sym=False, act_order=True),
            ("gptq", 4, 32, False, True, "v1"),
        ),
        (
            "gptq",
            gptq_config(8, -1, v2=True),
            dict(bits=8, group_size=-1, v1=False),
            ("gptq", 8, -1, True, False, "v2"),
        ),
        ("awq", awq_config(32), dict(sym=False), ("awq", 4, 32, False, False, "v2")),
        (
            "ct",
            ct_config(4, 32, actorder="group"),
            dict(actorder="group"),
            ("compressed-tensors", 4, 32, True, True, "v2"),
        ),
    ],
)
def test_inspect_json(make_ckpt, capsys, fmt, qc, kwargs, expect) -> None:
    path, _ = make_ckpt(fmt, qc, **kwargs)
    info = json.loads(_inspect(capsys, path, "--json"))
    assert (
        info["format"],
        info["bits"],
        info["group_size"],
        info["sym"],
        info["act_order"],
        info["zero_convention"],
    ) == expect
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["quantized_modules"] == {
        p: 2 for p in ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    }
    assert info["lm_head_quantized"] is False
    # 2 layers, 2 KV heads, head_dim 16
    assert info["kv_bytes_per_token"] == {"float16": 256, "bfloat16": 256, "fp8": 128, "int8": 128, "int4": 96}
    # bytes as qserve holds them: recompute from the loaded weights
    import loaders

    held = 0
    for _, value in loaders.iter_weights(path):
        held += value.nbytes() if hasattr(value, "qweight") else value.numel() * 2  # dense in model dtype fp16
    assert info["weight_bytes"] == held


def test_inspect_text_unquantized_and_dynamic(make_ckpt, capsys) -> None:
    path, _ = make_ckpt(None, None)
    out = _inspect(capsys, path)
    assert "format:" in out and "none" in out and "KV per token" in out
    path, _ = make_ckpt(
        "gptq",
        gptq_config(4, 32, lm_head=True, dynamic={r"-:.*layers\.1\.mlp\..*": {}}),
        quantize_lm_head=True,
        skip=("layers.1.mlp.",),
    )
    info = json.loads(_inspect(capsys, path, "--json"))
    assert info["lm_head_quantized"] is True and info["quantized_modules"]["gate_proj"] == 1
    assert info["unquantized_linear_modules"] == {"down_proj": 1, "gate_proj": 1, "up_proj": 1}
    assert info["dynamic_overrides"] == [r"-:.*layers\.1\.mlp\..*"]


def test_inspect_refusal_exit_code(make_ckpt, capsys) -> None:
    path, _ = make_ckpt("awq", {**awq_config(32), "version": "gemv"}, sym=False)
    assert main(["inspect", str(path)]) == 2
    assert "version" in capsys.readouterr().err


def test_dense_bf16_bytes(make_ckpt, capsys, tiny_state) -> None:
    for k in list(tiny_state):
        tiny_state[k] = tiny_state[k].to(torch.float32)
    path, _ = make_ckpt(None, None, config_overrides={"torch_dtype": "bfloat16"})
    info = json.loads(_inspect(capsys, path, "--json"))
    assert info["weight_bytes"] == info["checkpoint_bytes"] // 2  # fp32 on disk, bf16 in qserve
