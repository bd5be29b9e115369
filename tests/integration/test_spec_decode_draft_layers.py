"""speculative_config ``"draft_layers": "int4"``: an EAGLE head's linear layers (its decoder layers and fc)
become 4-bit round-to-nearest copies through the W4A16 kernels (qserve.spec_decode.draft_layers). A copied
layer computes ``x @ dequantize(RTN(W))``; greedy outputs stay token-identical to no speculation (the
target verifies with its own weights); an oracle head keeps its drafts accepted (a wrong copy collapses
that); the copies count in the memory plan, the adaptive draft cost and ``qserve plan``; values and methods
it does not apply to are refused (test_spec_decode_draft_lm_head's refusal test, which covers both options)."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM
from qserve.layers.held_bytes import held_weight_bytes
from qserve.layers.linear import DenseLinearMethod, Linear
from qserve.quantize.quantizer import quantize_rtn
from qserve.spec_decode import draft_layers
from qserve.spec_decode.eagle_head import eagle_head_bytes
from tests.helpers.eagle_heads import PERM_FIRST, walk_tokens
from tests.integration.test_spec_decode import (  # noqa: F401 - path, reference: fixtures
    ARGS,
    _assert_same,
    _greedy,
    _run,
    path,
    reference,
)
from tests.integration.test_spec_decode_draft_lm_head import planned_draft_bytes
from tests.integration.test_spec_decode_eagle import (  # noqa: F401 - heads, walk: fixtures
    _assert_cuda_heads_keep_the_outputs,
    _assert_oracle_heads_walk,
    _spec,
    heads,
    walk,
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_copied_layer_multiplies_by_the_round_to_nearest_weight(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(256, [192, 64, 64], bias=True, params_dtype=dtype, method=DenseLinearMethod(), prefix="qkv")
    layer.weight.data.copy_(torch.randn(320, 256, generator=gen))  # [N, K]: three fused shards
    layer.bias.data.copy_(torch.randn(320, generator=gen))
    dense = layer.weight.detach().clone()
    draft_layers.quantize_linear(layer)
    assert isinstance(layer.method, draft_layers.DraftInt4LinearMethod)
    assert "weight" not in dict(layer.named_parameters())  # the dense weight is gone
    x = torch.randn(5, 256, generator=gen).to(dtype)  # [T, K]
    got = layer(x)
    assert got.dtype == dtype
    # each shard quantized on its own (groups never straddle shards), the same as the whole when N splits evenly
    want = torch.cat(
        [quantize_rtn(part.float(), 4, 128, sym=False).dequantize() for part in dense.split([192, 64, 64])], dim=1
    )  # [K, N]
    expected = x.half().float() @ want + layer.bias.float()
    torch.testing.assert_close(got.float(), expected, atol=5e-2, rtol=1e-2)
    assert held_weight_bytes(layer) < dense.numel() * dense.element_size() / 2
    with pytest.raises(ValueError, match="qkv: draft_layers 'int4' quantizes dense layers only"):
        draft_layers.quantize_linear(layer)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_int4_layers_keep_the_outputs(path, heads, reference, method):  # noqa: F811
    requests, want, _ = reference
    engines = {
        layers: LLM(
            path, gpu_memory_budget="256MiB", speculative_config=_spec(heads, method, draft_layers=layers), **ARGS
        ).engine
        for layers in ("checkpoint", "int4")
    }
    engine = engines["int4"]
    head = engine._eagle_head
    linears = [m for m in head.modules() if isinstance(m, Linear) and m is not head.lm_head]
    assert linears and all(isinstance(m.method, draft_layers.DraftInt4LinearMethod) for m in linears)
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert engine.spec_stats.num_draft_tokens > 0
    # the copies are what the head reads: its bytes, the plan and the adaptive draft cost all shrink
    dense = engines["checkpoint"]
    saved = dense._eagle_head.weight_bytes() - head.weight_bytes()
    assert saved > 0
    assert dense.memory_plan.weights_bytes - engine.memory_plan.weights_bytes == saved
    assert engine._draft_cost() < dense._draft_cost()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_oracle_head_keeps_its_drafts_accepted_with_int4_layers(walk, method):  # noqa: F811
    target, oracle, perm = walk
    spec = _spec(oracle, method, draft_layers="int4", draft_lm_head="int4")
    llm = LLM(target, speculative_config=spec, **ARGS)
    prompts = [{"prompt_token_ids": [PERM_FIRST + s for s in (3, 9, 17, 40)]}]
    outputs = llm.generate(prompts, _greedy(max_tokens=30), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == walk_tokens(perm, 40, 30)
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95, stats.num_accepted_tokens / stats.num_draft_tokens


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_qserve_plan_counts_the_copies(path, heads, method, capsys):  # noqa: F811
    dense = planned_draft_bytes(path, _spec(heads, method), capsys)
    int4 = planned_draft_bytes(path, _spec(heads, method, draft_layers="int4"), capsys)
    assert dense == eagle_head_bytes(heads[method], method, torch.float16)
    assert int4 == eagle_head_bytes(heads[method], method, torch.float16, int4_layers=True) < dense


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_int4_draft_layers(path, heads, walk, async_scheduling):  # noqa: F811
    """On the GPU with the default graphs (decode, verify, the head's drafting and catch-up) and device
    drafts: random heads with 4-bit layers and lm_head keep the greedy outputs of no speculation (float32),
    oracle heads keep > 95% of their drafts, every page comes back."""
    gpu = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256, async_scheduling=async_scheduling)

    def make_llm(target: str, spec: dict | None) -> LLM:
        int4 = {"draft_layers": "int4", "draft_lm_head": "int4"}
        return LLM(target, speculative_config=spec and {**spec, **int4}, **gpu)

    def layers_are_copies(llm: LLM) -> None:
        head = llm.engine._eagle_head
        assert isinstance(head.layers[0].mlp.down_proj.method, draft_layers.DraftInt4LinearMethod)

    _assert_cuda_heads_keep_the_outputs(path, heads, make_llm, layers_are_copies)
    _assert_oracle_heads_walk(walk, make_llm)
