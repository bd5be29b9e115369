"""The memory planner and ``qserve plan`` on a config-only Qwen2.5-14B GPTQ directory."""

from __future__ import annotations

import json

import pytest

from qserve.cli import main
from qserve.memory.planner import make_plan, parse_memory_budget, weight_bytes
from qserve.model.registry import read_model_config

GIB = 2**30
MIB = 2**20

QWEN25_14B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 151645,
    "quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    },
}


@pytest.fixture()
def qwen14b_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_14B))
    return tmp_path


def test_budget_parsing():
    assert parse_memory_budget("24GiB") == 24 * GIB
    assert parse_memory_budget("512MB") == 512 * 10**6
    assert parse_memory_budget("0.5", device_total_bytes=80 * GIB) == 40 * GIB
    with pytest.raises(ValueError, match="gpu-memory-budget"):
        parse_memory_budget("lots")
    with pytest.raises(ValueError, match="fraction"):
        parse_memory_budget("0.9")


def test_qwen14b_gptq_weights_match_the_reference_numbers(qwen14b_dir):
    import loaders

    config = read_model_config(qwen14b_dir)
    import torch

    weights = weight_bytes(config, loaders.detect(qwen14b_dir), torch.float16)
    # benchmarks.md: ~6.9 GB of 4-bit g128 linears + 1.56 GB fp16 lm_head + 1.56 GB embeddings ≈ 9.3 GiB.
    assert 9.0 * GIB < weights < 9.6 * GIB
    assert config.kv_bytes_per_token(2) == 192 * 1024


def test_plan_fits_128_sequences_of_1k_with_fp8_kv_in_24gib(qwen14b_dir, capsys):
    assert main(["plan", str(qwen14b_dir), "--gpu-memory-budget", "24GiB", "--kv-cache-dtype", "fp8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("weights_bytes", "kv_cache_bytes", "kv_tokens", "max_concurrent_sequences"):
        assert key in plan
    assert plan["kv_cache_bytes"] >= 12 * GIB
    assert plan["concurrent_sequences_at"]["1024"] >= 128
    total = plan["weights_bytes"] + plan["activation_bytes"] + plan["overhead_bytes"] + plan["kv_cache_bytes"]
    assert total <= 24 * GIB


def test_plan_refuses_a_budget_too_small_and_names_the_largest_context(qwen14b_dir):
    import torch

    config = read_model_config(qwen14b_dir)
    with pytest.raises(ValueError, match="largest context that fits is [0-9]+ tokens"):
        make_plan(config, weights_bytes=9 * GIB, budget_bytes=11 * GIB, dtype=torch.float16, max_model_len=32768)


def test_plan_text_output(qwen14b_dir, capsys):
    assert main(["plan", str(qwen14b_dir), "--gpu-memory-budget", "24GiB", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "KV pages" in out and "max concurrent sequences at 1024 tokens" in out


def test_bad_kv_cache_dtype_is_named(qwen14b_dir, capsys):
    assert main(["plan", str(qwen14b_dir), "--gpu-memory-budget", "24GiB", "--kv-cache-dtype", "fp4"]) == 2
    assert "kv-cache-dtype" in capsys.readouterr().err


def test_plan_reports_only_contexts_the_model_can_run(qwen14b_dir):
    import torch

    config = read_model_config(qwen14b_dir)
    plan = make_plan(config, weights_bytes=9 * GIB, budget_bytes=24 * GIB, dtype=torch.float16, max_model_len=2048)
    assert list(plan.concurrent_sequences_at) == [1024]


def test_piecewise_graphs_are_counted_in_the_overheads_only_when_asked(qwen14b_dir):
    """Piecewise graphs reserve the pieces' static buffers and what their pool adds to the decode
    graphs' pool, which they share (14B, 2048 tokens: a few hundred MiB), out of the KV pages; without
    them the plan is unchanged."""
    import torch

    from qserve.memory.planner import decode_graph_pool_bytes, piecewise_graph_bytes_estimate

    config = read_model_config(qwen14b_dir)
    common = dict(weights_bytes=10 * GIB, budget_bytes=24 * GIB, dtype=torch.float16, max_num_batched_tokens=2048)
    plain = make_plan(config, **common, max_num_seqs=256)
    piecewise = make_plan(config, **common, max_num_seqs=256, piecewise_graph_tokens=2048)
    decode_pool = decode_graph_pool_bytes(config, 256, torch.float16)
    extra = piecewise_graph_bytes_estimate(config, 2048, torch.float16, decode_pool)
    assert piecewise.overhead_bytes == plain.overhead_bytes + extra
    assert piecewise.num_kv_blocks < plain.num_kv_blocks
    # static: 2048 x (3 int64 + fp16 q, k, v, attention output, residual, hidden) = 88 MiB; pool: one layer's
    # activations at 2048 tokens (270 MiB) plus gate_up's fp16 weight (5120 x 27648, 270 MiB), less the decode
    # pool it reuses (256 sequences: 34 MiB of activations + 223 MiB of LM-head output). Measured on the H100
    # (bench/RESULTS.md, 2026-12-06): static 88.0 MiB, pool growth 270.0 MiB, i.e. 358 MiB.
    assert 350 * MIB < extra < 0.4 * GIB
    alone = piecewise_graph_bytes_estimate(config, 2048, torch.float16)  # no decode pool to reuse
    assert alone - extra == decode_pool  # the pool outgrows the decode pool here: all of it is reused
    static = 2048 * (3 * 8 + 2 * ((2 * 40 + 2 * 8) * 128 + 2 * 5120))  # 88.05 MiB
    assert piecewise_graph_bytes_estimate(config, 2048, torch.float16, 10 * GIB) == static  # a pool large enough
    assert piecewise_graph_bytes_estimate(config, 4096, torch.float16, decode_pool) > extra


def test_an_eagle_heads_kv_makes_pages_larger_by_its_share(qwen14b_dir):
    """The head's KV indexed by the target's blocks (qserve.spec_decode.shadow_kv): each page grows by
    the head's layers' share (1 layer of a 48-layer target: 1/49 fewer pages), plus its scratch
    blocks, all inside kv_cache_bytes; not half the pages, as when the head owned pages of its own."""
    import dataclasses

    import torch

    from qserve.spec_decode.shadow_kv import num_scratch_blocks, shadow_kv_bytes_per_token

    config = read_model_config(qwen14b_dir)
    head = dataclasses.replace(config, num_layers=1)  # a one-layer head with the target's KV heads
    per_head = shadow_kv_bytes_per_token(head, torch.bfloat16)
    assert per_head == 2 * 1 * 8 * 128 * 2
    common = dict(weights_bytes=9 * GIB, budget_bytes=24 * GIB, dtype=torch.bfloat16, max_model_len=4096)
    common.update(activation_bytes=GIB, overhead_bytes=GIB // 2)
    plain = make_plan(config, **common)
    scratch = num_scratch_blocks(256, 3, 16)
    assert scratch == 256
    plan = make_plan(config, **common, shadow_kv_bytes_per_token=per_head, shadow_scratch_blocks=scratch)
    left = 24 * GIB - 9 * GIB - plan.activation_bytes - GIB // 2 - scratch * 16 * per_head
    assert plan.num_kv_blocks == left // ((plain.kv_bytes_per_token + per_head) * 16)
    assert plan.kv_bytes_per_token == plain.kv_bytes_per_token == 48 * per_head
    assert plan.kv_cache_bytes == plan.num_kv_blocks * 16 * 49 * per_head + scratch * 16 * per_head
    assert plan.kv_cache_bytes <= left + scratch * 16 * per_head
    # 1/49 fewer, less the scratch blocks (1/49 of a page each)
    assert plain.num_kv_blocks * 48 / 49 - scratch / 49 - 1 <= plan.num_kv_blocks < plain.num_kv_blocks
    assert plan.shadow_scratch_bytes == scratch * 16 * per_head
    assert "of the EAGLE head's KV" in plan.describe() and "EAGLE" not in plain.describe()
    assert make_plan(config, **common, shadow_kv_bytes_per_token=0, shadow_scratch_blocks=scratch) == plain


def test_decode_graph_pool_holds_no_prompt_logprobs(qwen14b_dir, monkeypatch):
    """The decode graphs' pool is one batch's layer activations and LM-head output: a decode step
    computes no prompt logprobs and samples outside the graph. Until 2026-12-05 the estimate added
    a prompt-logprob slice (0.58 GiB at 256 sequences of a 152k vocabulary), which bench/e2e.py saw
    as 0.8 GiB planned and never allocated; the estimate must not move with that slice's size."""
    import torch

    from qserve.memory import planner
    from qserve.runner import sampler

    config = read_model_config(qwen14b_dir)
    batch, vocab = 256, config.vocab_size
    before = planner.cuda_graph_bytes_estimate(config, batch, torch.float16)
    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_CHUNK_ROWS", sampler.PROMPT_LOGPROBS_CHUNK_ROWS // 4)
    assert planner.cuda_graph_bytes_estimate(config, batch, torch.float16) == before
    # what it is: the shared float32 logits, the LM head's fp16 output and float32 copy, one
    # layer's widest tensors (~35 MiB here) and 64 MiB of slack
    logits_and_head = batch * vocab * (4 + 2 + 4)
    assert logits_and_head + (64 << 20) < before < logits_and_head + (64 << 20) + 64 * 2**20


def test_several_models_on_one_card_plan_their_piecewise_graphs(qwen14b_dir, monkeypatch):
    """The shared pool of several models (``async_engine._kv_budget_bytes``) leaves room for each
    model's piecewise graphs, which every engine captures on CUDA by default; with
    QSERVE_PIECEWISE_GRAPHS=0 or enforce_eager it does not."""
    from types import SimpleNamespace

    import torch

    from qserve.engine.async_engine import HostConfig, _kv_budget_bytes
    from qserve.memory.planner import decode_graph_pool_bytes, piecewise_graph_bytes_estimate
    from qserve.runner.piecewise_graphs import PIECEWISE_GRAPHS_ENV

    config = read_model_config(qwen14b_dir)
    models = [SimpleNamespace(path=str(qwen14b_dir))] * 2
    specs = [SimpleNamespace(config=config)] * 2
    cuda = SimpleNamespace(type="cuda")  # planned as on a card; nothing touches a device
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    host = HostConfig(gpu_memory_budget="60GiB", max_num_batched_tokens=2048)
    monkeypatch.delenv(PIECEWISE_GRAPHS_ENV, raising=False)
    with_pieces = _kv_budget_bytes(models, specs, host, cuda)
    monkeypatch.setenv(PIECEWISE_GRAPHS_ENV, "0")
    without = _kv_budget_bytes(models, specs, host, cuda)
    pieces = piecewise_graph_bytes_estimate(
        config, 2048, torch.bfloat16, decode_graph_pool_bytes(config, host.max_num_seqs, torch.bfloat16)
    )
    assert without - with_pieces == 2 * pieces
    monkeypatch.delenv(PIECEWISE_GRAPHS_ENV)
    eager = HostConfig(gpu_memory_budget="60GiB", max_num_batched_tokens=2048, enforce_eager=True)
    assert _kv_budget_bytes(models, specs, eager, cuda) > without  # no graphs at all


def test_qserve_plan_reserves_the_pieces_the_engine_would_capture(qwen14b_dir, capsys, monkeypatch):
    """``qserve plan`` plans a CUDA engine: the piecewise graphs' room by default, none with
    QSERVE_PIECEWISE_GRAPHS=0, and none under tensor parallelism, whose steps stay eager."""
    import torch

    from qserve.commands.serve import SERVE_MAX_NUM_BATCHED_TOKENS
    from qserve.memory.planner import decode_graph_pool_bytes, piecewise_graph_bytes_estimate
    from qserve.runner.piecewise_graphs import PIECEWISE_GRAPHS_ENV

    def overhead(*flags: str) -> int:
        assert main(["plan", str(qwen14b_dir), "--gpu-memory-budget", "24GiB", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["overhead_bytes"]

    monkeypatch.delenv(PIECEWISE_GRAPHS_ENV, raising=False)
    with_pieces, tp_with = overhead(), overhead("--tensor-parallel-size", "2")
    monkeypatch.setenv(PIECEWISE_GRAPHS_ENV, "0")
    without, tp_without = overhead(), overhead("--tensor-parallel-size", "2")
    config = read_model_config(qwen14b_dir)
    pieces = piecewise_graph_bytes_estimate(  # up to the server's step budget, which qserve plan plans for
        config, SERVE_MAX_NUM_BATCHED_TOKENS, torch.bfloat16, decode_graph_pool_bytes(config, 256, torch.bfloat16)
    )
    assert with_pieces - without == pieces > 0
    assert tp_with == tp_without
