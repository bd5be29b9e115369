"""Quantized checkpoints through qserve's model give the logits of the float model that runs the
dequantized weights (float32, <= 1e-4), for each format, via ``load_model`` and the ``LLM`` API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.quant_packers import awq_config, ct_config, gptq_config, quantize_state_dict, write_checkpoint

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)

# id -> (architecture, format, quantization_config, quantize kwargs)
VARIANTS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "gptq-v1-asym-actorder": (
        "llama",
        "gptq",
        gptq_config(4, 32, sym=False, desc_act=True),
        dict(sym=False, act_order=True),
    ),
    "gptq-v1-asym-actorder-unshared": (
        "llama",
        "gptq",
        gptq_config(4, 32, sym=False, desc_act=True),
        dict(sym=False, act_order=True, share_fused_g_idx=False),
    ),
    "gptq-v2-sym-8bit-bf16": (
        "llama",
        "gptq",
        gptq_config(8, 64, sym=True, v2=True),
        dict(bits=8, group_size=64, v1=False, scale_dtype=torch.bfloat16, dense_dtype=torch.bfloat16),
    ),
    "gptq-dynamic-lmhead": (
        "llama",
        "gptq",
        gptq_config(4, -1, sym=False, lm_head=True, dynamic={r"-:.*layers\.1\.mlp\..*": {}}),
        dict(group_size=-1, sym=False, quantize_lm_head=True, skip=("layers.1.mlp.",)),
    ),
    "qwen2-gptq-actorder": ("qwen2", "gptq", gptq_config(4, 32, sym=True, desc_act=True), dict(act_order=True)),
    "awq-gemm": (
        "llama",
        "awq",
        awq_config(32, modules_to_not_convert=["down_proj"]),
        dict(sym=False, skip=("down_proj",)),
    ),
    "ct-asym-actorder-group": (
        "llama",
        "ct",
        ct_config(4, 32, sym=False, actorder="group"),
        dict(sym=False, actorder="group"),
    ),
    "ct-channel-8bit": (
        "qwen2",
        "ct",
        ct_config(8, None, sym=True),
        dict(bits=8, group_size=-1, scale_dtype=torch.bfloat16),
    ),
}


def _hf_model(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(**SMALL)
        model = transformers.LlamaForCausalLM(config)
        config.architectures = ["LlamaForCausalLM"]
    else:
        config = transformers.Qwen2Config(**SMALL)
        model = transformers.Qwen2ForCausalLM(config)
        config.architectures = ["Qwen2ForCausalLM"]
    return config, model.float().eval()


def build(tmp_path: Path, variant: str) -> tuple[Path, Any]:
    """Write the quantized checkpoint; return it and the float reference model."""
    arch, fmt, quant_config, kwargs = VARIANTS[variant]
    config, model = _hf_model(arch)
    state = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    qm = quantize_state_dict(state, fmt, **({"group_size": 32} | kwargs))
    config_dict = config.to_dict()
    config_dict["quantization_config"] = quant_config
    config_dict["torch_dtype"] = "float32"
    config_dict.pop("dtype", None)
    write_checkpoint(tmp_path, config_dict, qm.tensors)
    reference = {name: t for name, t in qm.tensors.items() if name in state}  # dense tensors as stored
    reference.update({f"{module}.weight": w for module, w in qm.dequant.items()})
    model.load_state_dict({k: v.to(torch.float32) for k, v in reference.items()}, strict=False)
    missing = set(state) - set(reference)
    assert not missing, missing
    return tmp_path, model


def _prompt() -> torch.Tensor:
    return torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_load_model_logits_match_float_reference(tmp_path, variant) -> None:
    load_model = pytest.importorskip("qserve.model.loader").load_model
    from qserve.runner.attn_metadata import AttentionMetadata
    from qserve.runner.model_runner import allocate_kv_caches

    path, reference = build(tmp_path, variant)
    ids = _prompt()
    with torch.no_grad():
        want = reference(ids[None]).logits[0].float()  # [T, vocab]
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    num_tokens = ids.shape[0]
    kv_caches = allocate_kv_caches(config, 2, 16, torch.float32, torch.device("cpu"))
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens]),
        query_start_loc=torch.tensor([0, num_tokens]),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    with torch.no_grad():
        got = model.compute_logits(model(ids, torch.arange(num_tokens), kv_caches, metadata))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["gptq-v1-asym-actorder", "awq-gemm", "ct-asym-actorder-group"])
def test_llm_prompt_logprobs_match_float_reference(tmp_path, variant) -> None:
    try:
        from qserve import LLM, SamplingParams
    except (ImportError, AttributeError) as err:  # the offline API may land after the loaders
        pytest.skip(f"qserve.LLM not available: {err}")
    from tests.helpers.tokenizer import make_tokenizer

    path, reference = build(tmp_path, variant)
    make_tokenizer(str(path))
    ids = _prompt()
    with torch.no_grad():
        want = torch.log_softmax(reference(ids[None]).logits[0].float(), dim=-1)  # [T, vocab]
    llm = LLM(str(path), device="cpu", dtype="float32")
    out = llm.generate([{"prompt_token_ids": ids.tolist()}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None
    for pos in range(1, ids.shape[0]):
        token = int(ids[pos])
        got = out.prompt_logprobs[pos][token].logprob
        assert abs(got - float(want[pos - 1, token])) <= 1e-4, pos
