"""``loaders.iter_weights``: names, dtypes, sharding, unquantized checkpoints and peak memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import loaders
from quant_kernels.layout import PackedQuantWeight
from tests.helpers.quant_packers import gptq_config, tiny_llama_config

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_unquantized_checkpoint_streams_stored_dtype(make_ckpt, tiny_state, dtype, num_shards) -> None:
    state = {k: v.to(dtype) for k, v in tiny_state.items()}
    tiny_state.clear()
    tiny_state.update(state)
    path, _ = make_ckpt(None, None, num_shards=num_shards)
    spec = loaders.detect(path)
    assert spec.method == "none" and spec.pack_format == "dense"
    got = dict(loaders.iter_weights(path, spec))
    assert set(got) == set(state)
    for name, value in got.items():
        assert isinstance(value, torch.Tensor) and value.dtype == dtype
        assert torch.equal(value, state[name])


def test_yields_module_prefixes_and_plain_params(make_ckpt, tiny_state) -> None:
    bias = torch.arange(64, dtype=torch.float16)
    path, _ = make_ckpt(
        "gptq",
        gptq_config(4, 32, dynamic={r"-:.*layers\.1\.self_attn\.o_proj": {}}),
        skip=("layers.1.self_attn.o_proj",),
        edit=lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", bias),
    )
    items = list(loaders.iter_weights(path))
    names = [n for n, _ in items]
    assert len(names) == len(set(names))
    packed = {n for n, v in items if isinstance(v, PackedQuantWeight)}
    assert "model.layers.0.self_attn.q_proj" in packed
    assert "model.layers.1.self_attn.o_proj" not in packed and "model.layers.1.self_attn.o_proj.weight" in names
    assert len(packed) == 13
    values = dict(items)
    assert torch.equal(values["model.layers.0.self_attn.q_proj.bias"], bias)
    assert values["model.norm.weight"].dtype == torch.float16
    assert not any(n.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for n in names)


def test_quantized_lm_head(make_ckpt) -> None:
    path, qm = make_ckpt("gptq", gptq_config(4, 32, lm_head=True), quantize_lm_head=True)
    values = dict(loaders.iter_weights(path))
    assert isinstance(values["lm_head"], PackedQuantWeight) and "lm_head.weight" not in values


def test_plain_tensor_reads_match_safetensors(tmp_path) -> None:
    """Our positional reader returns exactly what safetensors wrote, for every dtype."""
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32),
        "d": torch.tensor([3, 4], dtype=torch.int64),
        "e": torch.zeros(0, 3, dtype=torch.float16),
        "f": torch.tensor(2.5),
        "g": torch.tensor([True, False]),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    from loaders.safetensors_io import CheckpointFiles

    files = CheckpointFiles(tmp_path)
    for name, want in tensors.items():
        got = files.get(name)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import psutil, torch
    import loaders

    def hwm():  # peak RSS of this process image (VmHWM resets at exec; ru_maxrss may carry the parent's)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    path = sys.argv[1]
    baseline = psutil.Process().memory_info().rss
    spec = loaders.detect(path)
    kept = list(loaders.iter_weights(path, spec))  # keep everything, as a model would
    held = sum(v.nbytes() if hasattr(v, "nbytes") and callable(v.nbytes) else v.numel() * v.element_size() for _, v in kept)
    peak = hwm()
    print(json.dumps({"baseline": baseline, "peak": peak, "held": held, "items": len(kept)}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for VmHWM")
def test_peak_memory_streaming(tmp_path) -> None:
    """A ~300 MB checkpoint loads with peak RSS growth <= 1.3x its size, keeping all weights."""
    hidden, inter, layers, vocab = 1024, 4096, 4, 56000
    cfg = tiny_llama_config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=vocab,
    )
    cfg["quantization_config"] = gptq_config(4, 128, sym=False, desc_act=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    total = 0

    def quant(k: int, n: int, prefix: str, out: dict, shuffle: bool) -> None:
        out[f"{prefix}.qweight"] = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen)
        out[f"{prefix}.qzeros"] = torch.randint(
            -(2**31), 2**31 - 1, (k // 128, n // 8), dtype=torch.int32, generator=gen
        )
        out[f"{prefix}.scales"] = torch.rand(k // 128, n, generator=gen).half()
        g_idx = torch.arange(k, dtype=torch.int32) // 128
        out[f"{prefix}.g_idx"] = g_idx[torch.randperm(k, generator=gen)] if shuffle else g_idx

    shard: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen).half()}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            quant(hidden, hidden, f"{p}.self_attn.{name}", shard, shuffle=(i == 0))
        quant(hidden, inter, f"{p}.mlp.gate_proj", shard, shuffle=False)
        quant(hidden, inter, f"{p}.mlp.up_proj", shard, shuffle=False)
        quant(inter, hidden, f"{p}.mlp.down_proj", shard, shuffle=(i == 0))
        shard[f"{p}.input_layernorm.weight"] = torch.ones(hidden).half()
        shard[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden).half()
    shard["model.norm.weight"] = torch.ones(hidden).half()
    total += sum(t.numel() * t.element_size() for t in shard.values())
    save_file(shard, str(tmp_path / "model-00001-of-00002.safetensors"))
    weight_map = dict.fromkeys(shard, "model-00001-of-00002.safetensors")
    del shard
    head = {"lm_head.weight": torch.randn(vocab, hidden, generator=gen).half()}
    total += head["lm_head.weight"].numel() * 2
    save_file(head, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    del head
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert 250e6 < total < 350e6

    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    growth = stats["peak"] - stats["baseline"]
    assert stats["held"] > 0.9 * total
    print(f"peak RSS growth {growth / total:.3f}x checkpoint size")
    assert growth <= 1.3 * total, f"peak RSS grew {growth / 1e6:.0f} MB for a {total / 1e6:.0f} MB checkpoint"
