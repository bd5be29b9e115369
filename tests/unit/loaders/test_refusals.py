"""Every unsupported or broken checkpoint is refused with a ValueError naming file, field and value."""

from __future__ import annotations

import json
import re

import pytest
import torch

import loaders
from tests.helpers.quant_packers import awq_config, ct_config, gptq_config, tiny_llama_config


def _detect_with(tmp_path, quant_config, file="config.json"):
    cfg = tiny_llama_config()
    if file == "config.json":
        cfg["quantization_config"] = quant_config
    else:
        (tmp_path / file).write_text(json.dumps(quant_config))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return loaders.detect(tmp_path)


def _raises(fn, *needles: str) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


@pytest.mark.parametrize("version", ["gemv", "gemv_fast", "marlin", "GEMV"])
def test_awq_non_gemm_versions(tmp_path, version) -> None:
    qc = {**awq_config(128), "version": version}
    _raises(lambda: _detect_with(tmp_path, qc), "config.json", "version", repr(version), "gemm")


def test_awq_llm_awq_backend(tmp_path) -> None:
    _raises(
        lambda: _detect_with(tmp_path, {**awq_config(128), "backend": "llm-awq"}), "config.json", "backend", "llm-awq"
    )


@pytest.mark.parametrize(
    "override,field",
    [
        ({"checkpoint_format": "marlin", "format": None}, "checkpoint_format"),
        ({"format": "marlin"}, "format"),
        ({"is_marlin_format": True}, "is_marlin_format"),
        ({"quant_method": "marlin"}, "quant_method"),
    ],
)
def test_marlin_serialized_gptq(tmp_path, override, field) -> None:
    qc = {**gptq_config(4, 128), **override}
    _raises(
        lambda: _detect_with(tmp_path, qc), "config.json", field, "marlin" if field != "is_marlin_format" else "True"
    )


@pytest.mark.parametrize("bits", [2, 3])
def test_gptq_low_bits(tmp_path, bits) -> None:
    _raises(lambda: _detect_with(tmp_path, gptq_config(bits, 128)), "config.json", "bits", str(bits), "4 or 8")


def test_gptq_low_bits_in_quantize_config_json(tmp_path) -> None:
    _raises(
        lambda: _detect_with(tmp_path, {"bits": 3, "group_size": 128}, "quantize_config.json"),
        "quantize_config.json",
        "bits=3",
    )


def test_ct_low_bits(tmp_path) -> None:
    _raises(lambda: _detect_with(tmp_path, ct_config(2, 128)), "config.json", "num_bits", "2")


def test_dynamic_low_bits(tmp_path) -> None:
    qc = gptq_config(4, 128, dynamic={r"+:.*down_proj": {"bits": 2}})
    _raises(lambda: _detect_with(tmp_path, qc), "config.json", "dynamic", "bits", "2")


@pytest.mark.parametrize("pack_dtype", ["int16", "int8", "int64"])
def test_pack_dtype(tmp_path, pack_dtype) -> None:
    _raises(
        lambda: _detect_with(tmp_path, {**gptq_config(4, 128), "pack_dtype": pack_dtype}),
        "config.json",
        "pack_dtype",
        pack_dtype,
        "int32",
    )


def test_ct_transform_config(tmp_path) -> None:
    qc = {**ct_config(4, 128), "transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}
    _raises(lambda: _detect_with(tmp_path, qc), "config.json", "transform_config", "hadamard")


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda c: c.update(format="float-quantized"), "format"),
        (lambda c: c.update(quantization_status="frozen"), "quantization_status"),
        (lambda c: c["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "input_activations"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "strategy"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update(type="float"), "type"),
    ],
)
def test_ct_other_schemes(tmp_path, edit, field) -> None:
    qc = ct_config(4, 128)
    qc["config_groups"]["group_0"].pop("format")
    edit(qc)
    _raises(lambda: _detect_with(tmp_path, qc), "config.json", field)


def test_unknown_method(tmp_path) -> None:
    _raises(
        lambda: _detect_with(tmp_path, {"quant_method": "bitsandbytes"}),
        "config.json",
        "quant_method",
        "bitsandbytes",
        "gptq",
    )


@pytest.mark.parametrize("suffix", [".bin", ".pt"])
def test_pickled_weights_never_unpickled(tmp_path, suffix) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama_config()))
    (tmp_path / f"pytorch_model{suffix}").write_bytes(b"\x80\x04not really a pickle")
    spec = loaders.detect(tmp_path)
    _raises(
        lambda: list(loaders.iter_weights(tmp_path, spec)), f"pytorch_model{suffix}", "never unpickles", "safetensors"
    )


def test_missing_tensor(make_ckpt) -> None:
    path, _ = make_ckpt("gptq", gptq_config(4, 32), edit=lambda t: t.pop("model.layers.1.mlp.up_proj.scales"))
    _raises(lambda: list(loaders.iter_weights(path)), str(path), "model.layers.1.mlp.up_proj.scales", "missing")


def test_missing_whole_module(make_ckpt) -> None:
    def drop(tensors):
        for key in [k for k in tensors if k.startswith("model.layers.1.self_attn.k_proj.")]:
            tensors.pop(key)

    path, _ = make_ckpt("gptq", gptq_config(4, 32), edit=drop)
    _raises(lambda: list(loaders.iter_weights(path)), "model.layers.1.self_attn.k_proj.qweight", "missing")


def test_missing_dense_tensor(make_ckpt) -> None:
    path, _ = make_ckpt(None, None, edit=lambda t: t.pop("lm_head.weight"))
    _raises(lambda: list(loaders.iter_weights(path)), "lm_head.weight", "missing")


def test_shape_disagrees_with_config(make_ckpt) -> None:
    path, _ = make_ckpt("gptq", gptq_config(4, 32), config_overrides={"intermediate_size": 256})
    msg = _raises(lambda: list(loaders.iter_weights(path)), "model.safetensors", "qweight", "config.json")
    assert re.search(r"(K|N)=128.*(K|N)=256", msg)


def test_bits_disagree_with_tensors(make_ckpt) -> None:
    path, _ = make_ckpt("gptq", gptq_config(8, 32), bits=4, group_size=32)  # config says 8-bit, data is 4-bit
    _raises(lambda: list(loaders.iter_weights(path)), "qweight", "8-bit", "config.json implies")


def test_scales_shape_disagrees_with_group_size(make_ckpt) -> None:
    path, _ = make_ckpt("awq", awq_config(64), group_size=32, sym=False)
    _raises(lambda: list(loaders.iter_weights(path)), "model.safetensors", "scales", "group_size=64")


def test_ct_weight_shape_disagrees(make_ckpt) -> None:
    def edit(tensors):
        tensors["model.layers.0.mlp.up_proj.weight_shape"] = torch.tensor([128, 32])

    path, _ = make_ckpt("ct", ct_config(4, 32), group_size=32, edit=edit)
    _raises(lambda: list(loaders.iter_weights(path)), "weight_shape", "K=32", "K=64")


def test_dense_weight_where_config_says_quantized(make_ckpt) -> None:
    path, _ = make_ckpt("gptq", gptq_config(4, 32), skip=("layers.0.mlp.down_proj",))
    _raises(lambda: list(loaders.iter_weights(path)), "model.layers.0.mlp.down_proj", "unquantized", "quantized")


def test_non_int32_qweight(make_ckpt) -> None:
    def edit(tensors):
        name = "model.layers.0.self_attn.q_proj.qweight"
        tensors[name] = tensors[name].to(torch.int64)

    path, _ = make_ckpt("gptq", gptq_config(4, 32), edit=edit)
    _raises(lambda: list(loaders.iter_weights(path)), "q_proj.qweight", "int64", "int32")


def test_truncated_safetensors(make_ckpt) -> None:
    path, _ = make_ckpt("gptq", gptq_config(4, 32))
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    _raises(lambda: list(loaders.iter_weights(path)), "model.safetensors", "truncated")


def test_corrupt_safetensors_header(make_ckpt) -> None:
    path, _ = make_ckpt("gptq", gptq_config(4, 32))
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"garbage!!!!!"
    file.write_bytes(bytes(data))
    _raises(lambda: list(loaders.iter_weights(path)), "model.safetensors", "corrupt")


def test_corrupt_header_length(make_ckpt) -> None:
    path, _ = make_ckpt(None, None)
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[0:8] = (10**12).to_bytes(8, "little")
    file.write_bytes(bytes(data))
    _raises(lambda: list(loaders.iter_weights(path)), "model.safetensors", "header length")


def test_index_names_missing_shard(make_ckpt) -> None:
    path, _ = make_ckpt(None, None, num_shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    _raises(lambda: list(loaders.iter_weights(path)), "model-00002-of-00002.safetensors", "missing")


def test_invalid_g_idx(make_ckpt) -> None:
    def edit(tensors):
        tensors["model.layers.0.self_attn.q_proj.g_idx"] = torch.zeros(64, dtype=torch.int32).index_fill_(
            0, torch.tensor([0]), 1
        )

    path, _ = make_ckpt("gptq", gptq_config(4, 32, desc_act=True), edit=edit)
    _raises(lambda: list(loaders.iter_weights(path)), "q_proj.g_idx", "group")
