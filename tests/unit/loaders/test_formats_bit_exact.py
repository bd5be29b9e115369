"""Loading each supported variant gives exactly the packer's float dequantization."""

from __future__ import annotations

import pytest
import torch

import loaders
from quant_kernels.layout import PackedQuantWeight
from quant_kernels.reference import dequantize_input_order
from tests.helpers.quant_packers import (
    awq_config,
    ct_config,
    gptq_config,
    pack_gptq,
    rtn_quantize,
    tiny_llama_config,
    write_checkpoint,
)

GPTQ_CASES = [
    # bits, group, sym, v2, desc_act, scale dtype
    (4, 32, True, False, False, torch.float16),
    (4, 64, False, False, False, torch.float16),
    (4, 128, False, True, False, torch.float16),
    (4, -1, True, True, False, torch.float16),
    (4, 32, False, False, True, torch.float16),
    (4, 32, True, False, True, torch.bfloat16),
    (8, 32, True, False, False, torch.float16),
    (8, 64, False, False, True, torch.float16),
    (8, -1, False, True, False, torch.bfloat16),
    (8, 128, True, True, True, torch.float16),
]


def _check_all(path, qm, expect_perm: bool | None = None) -> int:
    spec = loaders.detect(path)
    seen = 0
    for name, value in loaders.iter_weights(path, spec):
        if isinstance(value, PackedQuantWeight):
            got = dequantize_input_order(value, torch.float32)  # [K, N]
            want = qm.dequant[name].t()  # [K, N]
            assert torch.equal(got, want), name
            if expect_perm is not None:
                assert (value.perm is not None) == expect_perm, name
            seen += 1
    assert seen == len(qm.dequant)
    return seen


@pytest.mark.parametrize("bits,group,sym,v2,desc_act,scale_dtype", GPTQ_CASES)
def test_gptq_variants_bit_exact(make_ckpt, bits, group, sym, v2, desc_act, scale_dtype) -> None:
    cfg = gptq_config(bits, group, sym=sym, desc_act=desc_act, v2=v2)
    path, qm = make_ckpt(
        "gptq", cfg, bits=bits, group_size=group, sym=sym, v1=not v2, act_order=desc_act, scale_dtype=scale_dtype
    )
    spec = loaders.detect(path)
    assert (spec.bits, spec.group_size, spec.sym, spec.desc_act) == (bits, group, sym, desc_act)
    assert spec.zero_convention == ("v2" if v2 else "v1")
    assert spec.scale_dtype == str(scale_dtype).replace("torch.", "")
    _check_all(path, qm, expect_perm=desc_act if group in (-1, 32) else None)  # K >= 64 everywhere


def test_gptq_trivial_g_idx_is_dropped(make_ckpt) -> None:
    path, qm = make_ckpt("gptq", gptq_config(4, 32, desc_act=True), group_size=32)  # static groups: trivial g_idx
    _check_all(path, qm, expect_perm=False)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_asym_zero_zero_borrow(tmp_path, bits) -> None:
    """GPTQModel's v1 word subtraction borrows when a zero is 0; whole-word add restores it exactly."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=gen)  # [K, N]
    w[:, ::3] = w[:, ::3].abs() + 0.01  # all-positive columns -> zero point 0
    w[:, 1::5] = -w[:, 1::5].abs() - 0.01  # all-negative columns -> zero point maxq
    q = rtn_quantize(w, bits, 32, sym=False)
    assert (q.zeros == 0).any() and (q.zeros == (1 << bits) - 1).any()
    packed = pack_gptq(q, v1=True)
    cfg = tiny_llama_config(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4
    )
    tensors = {f"model.layers.0.self_attn.q_proj.{k}": v for k, v in packed.items()}
    write_checkpoint(tmp_path, {**cfg, "quantization_config": gptq_config(bits, 32, sym=False)}, tensors)
    spec = loaders.detect(tmp_path)
    from loaders.gptq import convert
    from loaders.safetensors_io import CheckpointFiles

    files = CheckpointFiles(tmp_path)
    weight = convert(
        files, "model.layers.0.self_attn.q_proj", spec.module_quant("model.layers.0.self_attn.q_proj"), spec, None
    )
    assert torch.equal(weight.zeros.to(torch.int64), q.zeros)
    assert torch.equal(dequantize_input_order(weight, torch.float32), q.dequant)


@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_gemm_bit_exact(make_ckpt, group, zero_point) -> None:
    path, qm = make_ckpt("awq", awq_config(group, zero_point=zero_point), group_size=group, sym=not zero_point)
    spec = loaders.detect(path)
    assert spec.method == "awq" and spec.pack_format == "awq-gemm" and spec.sym == (not zero_point)
    _check_all(path, qm, expect_perm=False)


def test_awq_interleave_order(tmp_path) -> None:
    """Column 8c + ORDER[i] sits in nibble i: a single non-zero code lands in the right column."""
    codes = torch.zeros(8, 8, dtype=torch.int64)
    codes[0, 2] = 5  # row 0, column 2 -> nibble 1 of word 0 (ORDER[1] == 2)
    from tests.helpers.quant_packers import pack_awq

    q = rtn_quantize(torch.zeros(8, 8), 4, -1, sym=False)
    q.codes = codes
    word = pack_awq(q)["qweight"][0, 0].item()
    assert (word >> 4) & 0xF == 5


@pytest.mark.parametrize(
    "bits,group,sym,actorder",
    [
        (4, 32, True, None),
        (4, 64, False, None),
        (4, None, True, None),
        (4, None, False, None),
        (4, 32, True, "group"),
        (4, 32, False, "group"),
        (4, 64, True, "weight"),
        (8, 32, True, None),
        (8, 32, False, "group"),
        (8, None, True, None),
    ],
)
def test_compressed_tensors_bit_exact(make_ckpt, bits, group, sym, actorder) -> None:
    cfg = ct_config(bits, group, sym=sym, actorder=actorder)
    path, qm = make_ckpt(
        "ct",
        cfg,
        bits=bits,
        group_size=-1 if group is None else group,
        sym=sym,
        actorder=actorder,
        scale_dtype=torch.bfloat16,
    )
    spec = loaders.detect(path)
    assert spec.method == "compressed-tensors" and spec.bits == bits and spec.sym == sym
    assert spec.desc_act == (actorder == "group")
    assert not spec.is_quantized("lm_head")
    _check_all(path, qm, expect_perm=actorder == "group")


def test_sharded_checkpoint(make_ckpt) -> None:
    path, qm = make_ckpt("gptq", gptq_config(4, 32, sym=False, desc_act=True), num_shards=3, sym=False, act_order=True)
    assert (path / "model.safetensors.index.json").is_file()
    _check_all(path, qm)


@pytest.mark.parametrize("stored_zero", [7, 8])
def test_gptq_sym_qzeros_are_ignored_and_mislabels_warned(tmp_path, caplog, stored_zero) -> None:
    """Symmetric GPTQ uses the implicit zero whatever qzeros say (v1 7s, v2 8s, or garbage);
    garbage — a mislabelled checkpoint (formats.md P1) — is logged."""
    gen = torch.Generator().manual_seed(5)
    q = rtn_quantize(torch.randn(64, 64, generator=gen), 4, 32, sym=True)
    cfg = tiny_llama_config(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4
    )
    from loaders.gptq import convert
    from loaders.safetensors_io import CheckpointFiles

    name = "model.layers.0.self_attn.q_proj"
    for qzeros_word, warned in ((sum(stored_zero << (4 * i) for i in range(8)), False), (0x12345678, True)):
        packed = pack_gptq(q, v1=True)
        packed["qzeros"] = torch.full_like(packed["qzeros"], qzeros_word - (2**32 if qzeros_word >= 2**31 else 0))
        path = tmp_path / f"w{qzeros_word}"
        write_checkpoint(
            path, {**cfg, "quantization_config": gptq_config(4, 32)}, {f"{name}.{k}": v for k, v in packed.items()}
        )
        spec = loaders.detect(path)
        caplog.clear()
        weight = convert(CheckpointFiles(path), name, spec.module_quant(name), spec, None)
        assert weight.zeros is None
        assert torch.equal(dequantize_input_order(weight, torch.float32), q.dequant)
        assert ("not the symmetric constant" in caplog.text) == warned
