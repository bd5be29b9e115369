"""``loaders.detect``: metadata locations, defaults, per-module decisions and dynamic overrides."""

from __future__ import annotations

import json

import pytest

import loaders
from tests.helpers.quant_packers import awq_config, ct_config, gptq_config, tiny_llama_config

Q = "model.layers.0.self_attn.q_proj"
DOWN1 = "model.layers.1.mlp.down_proj"


def _write(tmp_path, config=None, **files):
    (tmp_path / "config.json").write_text(json.dumps(config if config is not None else tiny_llama_config()))
    for name, content in files.items():
        (tmp_path / name.replace("__", ".")).write_text(json.dumps(content))
    return tmp_path


def test_unquantized(tmp_path) -> None:
    spec = loaders.detect(_write(tmp_path, tiny_llama_config(torch_dtype="bfloat16")))
    assert spec.method == "none" and spec.model_dtype == "bfloat16" and not spec.is_quantized(Q)


def test_config_json_wins_and_text_config(tmp_path) -> None:
    cfg = tiny_llama_config()
    cfg["text_config"] = {"quantization_config": gptq_config(8, 64)}
    spec = loaders.detect(_write(tmp_path, cfg, quantize_config__json=gptq_config(4, 32)))
    assert (spec.method, spec.bits, spec.group_size) == ("gptq", 8, 64)
    assert "text_config.quantization_config" in spec.source


def test_legacy_compression_config(tmp_path) -> None:
    cfg = tiny_llama_config()
    cfg["compression_config"] = ct_config(4, 128)
    spec = loaders.detect(_write(tmp_path, cfg))
    assert spec.method == "compressed-tensors"


def test_quantize_config_json_autogptq_defaults(tmp_path) -> None:
    qc = {"bits": 4, "group_size": 128, "desc_act": True, "damp_percent": 0.01}  # AutoGPTQ: no quant_method, no sym
    spec = loaders.detect(_write(tmp_path, quantize_config__json=qc))
    assert (spec.method, spec.sym, spec.desc_act, spec.zero_convention) == ("gptq", True, True, "v1")
    assert spec.source.endswith("quantize_config.json")


def test_quant_config_json_autoawq_keys(tmp_path) -> None:
    qc = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
    spec = loaders.detect(_write(tmp_path, quant_config__json=qc))
    assert (spec.method, spec.bits, spec.group_size, spec.sym, spec.pack_format) == ("awq", 4, 64, False, "awq-gemm")


def test_ignores_file_and_folder_names(tmp_path) -> None:
    path = tmp_path / "Llama-GPTQ-AWQ-4bit-128g"
    path.mkdir()
    spec = loaders.detect(_write(path))
    assert spec.method == "none"


def test_gptq_dynamic_overrides(tmp_path) -> None:
    dynamic = {r"-:.*layers\.1\.mlp\..*": {}, r"+:.*self_attn\.(q|k|v)_proj": {"bits": 8, "group_size": 64}}
    spec = loaders.detect(
        _write(tmp_path, config={**tiny_llama_config(), "quantization_config": gptq_config(4, 32, dynamic=dynamic)})
    )
    assert not spec.is_quantized(DOWN1)
    assert spec.bits_for(Q) == 8 and spec.group_size_for(Q) == 64
    assert spec.bits_for("model.layers.0.self_attn.o_proj") == 4
    assert spec.bits_for("model.layers.0.mlp.down_proj") == 4
    assert [r.skip for r in spec.dynamic] == [True, False]


def test_quantizable_modules_only(tmp_path) -> None:
    spec = loaders.detect(_write(tmp_path, config={**tiny_llama_config(), "quantization_config": gptq_config(4, 32)}))
    assert spec.is_quantized(Q)
    assert not spec.is_quantized("model.embed_tokens")
    assert not spec.is_quantized("model.layers.0.input_layernorm")
    assert not spec.is_quantized("lm_head")


def test_gptq_lm_head_flag(tmp_path) -> None:
    spec = loaders.detect(
        _write(tmp_path, config={**tiny_llama_config(), "quantization_config": gptq_config(4, 32, lm_head=True)})
    )
    assert spec.lm_head_quantized and spec.is_quantized("lm_head")


def test_awq_modules_to_not_convert(tmp_path) -> None:
    qc = awq_config(32, modules_to_not_convert=["mlp.down_proj"])
    spec = loaders.detect(_write(tmp_path, config={**tiny_llama_config(), "quantization_config": qc}))
    assert not spec.is_quantized(DOWN1) and spec.is_quantized(Q)


def test_ct_ignore_names_and_regex(tmp_path) -> None:
    qc = ct_config(4, 32, ignore=["lm_head", r"re:.*layers\.1\.mlp\.down_proj$", "model.layers.0.self_attn.o_proj"])
    spec = loaders.detect(_write(tmp_path, config={**tiny_llama_config(), "quantization_config": qc}))
    assert not spec.is_quantized(DOWN1)
    assert not spec.is_quantized("model.layers.0.self_attn.o_proj")
    assert not spec.is_quantized("lm_head")
    assert spec.is_quantized(Q) and spec.is_quantized("model.layers.0.mlp.down_proj")


def test_ct_lm_head_quantized_when_not_ignored(tmp_path) -> None:
    qc = ct_config(4, 32, ignore=[])
    spec = loaders.detect(_write(tmp_path, config={**tiny_llama_config(), "quantization_config": qc}))
    assert spec.lm_head_quantized and spec.is_quantized("lm_head")


def test_spec_is_frozen(tmp_path) -> None:
    spec = loaders.detect(_write(tmp_path))
    with pytest.raises(AttributeError):
        spec.method = "gptq"  # type: ignore[misc]
