"""Drive every production Triton launch of qserve through its real code path, on a simulated GPU.

Knows: the model shapes qserve is built for (Qwen2.5-14B, Qwen-14B v1, Llama-3-8B, plus the
families that add launch variants: Baichuan2-13B's ALiBi, Qwen3's q/k norms), the weight formats
(GPTQ sym / act-order, AWQ asym, compressed-tensors bf16 scales, group 32 / 64 / 128, 8-bit), the
KV cache dtypes, and the steps an engine runs (start-up warm-up, the decode CUDA-graph buckets,
eager decodes at short and long contexts, the W4A16 tuning sweep, and with ``QSERVE_LORA_TRITON=1``
the multi-LoRA steps: a prefill of sequences on two adapters and the base, mixed decodes, the
decode graphs' forward with adapter slots as inputs, and ``add_lora`` alone at 14B shapes with and
without split-K: ``drive_lora_kernels``; with ``QSERVE_FUSED_QK_NORM_ROPE=1`` a Qwen3-30B-A3B attention's
q/k norms and rotary as one launch, and with ``QSERVE_FUSED_ROPE_KV_STORE=1`` that launch storing the keys
and values too: ``drive_qk_norm_rope``). Must not know: what any kernel computes
(``tests/helpers/kernel_launches.py`` captures and compiles).

Each model is built with one decoder layer at its real dimensions (every layer of a model launches
the same kernels) and a small vocabulary (the LM head is a dense torch product, no Triton launch),
from random weights, on the CPU. Under ``simulated_gpu`` the model runner, the decode-graph forward
and the layers take their CUDA branches; every launch is captured and compiled for that GPU.

``python -m tests.helpers.engine_launches --gpu sm90 --tier full --out report.json`` writes the
distinct launches and failures as JSON (``tests/kernels/test_launch_compile.py`` runs it per GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from loaders.spec import CheckpointSpec
from qserve.config import ModelConfig
from qserve.layers.linear import Linear
from qserve.layers.quant_methods import make_linear_method
from qserve.model.llama import LlamaFamilyForCausalLM
from qserve.model.registry import model_config
from qserve.runner.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs
from qserve.runner.model_runner import ModelRunner, allocate_kv_caches
from qserve.runner.warmup import warmup_steps
from qserve.sampling_params import SamplingParams
from qserve.scheduler.output import ScheduledSequence, SchedulerOutput
from quant_kernels import ops
from quant_kernels.layout import PackedQuantWeight
from quant_kernels.reference_kv_int4 import INT4_KV_DTYPE
from quant_kernels.repack import MmaQuantWeight, mma_storage_shape, mma_zeros
from tests.helpers.kernel_launches import GPUS, Capture, SimulatedGpu, simulated_gpu, where

VOCAB = 1024
BLOCK_SIZE = 16
MAX_MODEL_LEN = 32768
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048  # the engine's default (SchedulerConfig)
KV_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": INT4_KV_DTYPE}


@dataclass(frozen=True)
class ModelCase:
    """One model shape and checkpoint format."""

    name: str
    config: dict  # config.json of the real model, one layer
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    scale_dtype: torch.dtype = torch.float16


def _llama_like(architecture: str, hidden: int, heads: int, kv_heads: int, inter: int, **extra) -> dict:
    model_type = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[architecture]
    config = dict(
        architectures=[architecture],
        model_type=model_type,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_MODEL_LEN,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
    )
    config.update(extra)
    return config


MODELS = [
    # GPTQ Int4 release layout (sym, group 128) with the q/k/v biases
    ModelCase("qwen2.5-14b", _llama_like("Qwen2ForCausalLM", 5120, 40, 8, 13824, rope_theta=1e6)),
    # Qwen v1 (remote-code config): multi-head attention, dynamic NTK + logn past seq_length
    ModelCase(
        "qwen-14b-v1",
        dict(
            architectures=["QWenLMHeadModel"],
            model_type="qwen",
            hidden_size=5120,
            num_attention_heads=40,
            num_hidden_layers=1,
            kv_channels=128,
            intermediate_size=27392,
            rotary_pct=1.0,
            rotary_emb_base=10000,
            seq_length=2048,
            max_position_embeddings=8192,
            layer_norm_epsilon=1e-6,
            vocab_size=VOCAB,
            use_dynamic_ntk=True,
            use_logn_attn=True,
            no_bias=True,
            bf16=True,
        ),
    ),
    # AWQ (GEMM): asymmetric zeros, group 128
    ModelCase(
        "llama-3-8b",
        _llama_like("LlamaForCausalLM", 4096, 32, 8, 14336, rope_theta=500000.0),
        sym=False,
    ),
    # ALiBi (13B): attention with position biases instead of rotary
    ModelCase(
        "baichuan2-13b",
        dict(
            architectures=["BaichuanForCausalLM"],
            model_type="baichuan",
            hidden_size=5120,
            num_attention_heads=40,
            num_hidden_layers=1,
            intermediate_size=13696,
            model_max_length=4096,
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
            torch_dtype="bfloat16",
        ),
    ),
    # q/k RMSNorm on [tokens, heads, head_dim] views; compressed-tensors with bf16 scales, group 64,
    # act-order: q's permutation differs from k's and v's, so q/k/v stay unfused (the concatenated path)
    ModelCase(
        "qwen3-8b",
        _llama_like("Qwen3ForCausalLM", 4096, 32, 8, 12288, head_dim=128, rope_theta=1e6),
        group_size=64,
        act_order=True,
        scale_dtype=torch.bfloat16,
    ),
]

# What each tier drives. "ci" (tests/kernels/test_launch_compile.py): on sm90 (the H200 the engine
# and bench/kernels.py are measured on) the engine's launches for the models qserve is measured on
# and for ALiBi, both dtypes, every KV cache dtype, the sweep candidates (fp16, as the bench runs
# them) and the PDL launches in both dtypes (CI's sm90 unit compiles fp16 only: with PDL in bf16 alone no
# CI job compiled a PDL launch; fp16's 54 more launches cost ~7 s of a 3-minute cold drive); on
# sm86 / sm89 the same engine launches for the GQA shapes with and without zero points (Qwen2.5-14B
# GPTQ, Llama-3-8B AWQ: every block config the dispatch picks, at 99 KB of shared memory). "full"
# (``--tier full``, before changing a kernel or its dispatch): every model on every GPU, Qwen3's q/k
# norms, the extra weight formats. A distinct compile costs ~0.4 s of CPU; "ci" is
# sized to CI's budget.
SHARD_GROUPS_FORMAT = "g80 (a padded act-order shard's groups: runs of 16 rows a K-tile)"
CI_MODELS = ("qwen2.5-14b", "qwen-14b-v1", "llama-3-8b", "baichuan2-13b")
TIERS = {
    "ci": dict(
        models=CI_MODELS,
        consumer_models=("qwen2.5-14b", "llama-3-8b"),
        formats=(SHARD_GROUPS_FORMAT,),
        pdl_dtypes=("fp16", "bf16"),
    ),
    "full": dict(models=tuple(c.name for c in MODELS), consumer_models=None, formats=None, pdl_dtypes=("fp16", "bf16")),
}

# Weight formats beyond the models' own, through the W4A16 dispatch at every M bucket (Qwen2.5-14B's
# qkv and down shapes): (label, bits, group_size, sym, act_order)
FORMATS = [
    ("g32-asym", 4, 32, False, False),
    ("g64-act-order", 4, 64, True, True),
    ("8bit-g128", 8, 128, True, False),
    ("channelwise", 4, -1, True, False),
    (SHARD_GROUPS_FORMAT, 4, 80, True, False),  # as the shard reaches the kernel: its perm applied before
    ("g48-asym-act-order", 4, 48, False, True),
]
FORMAT_SHAPES = [(5120, 7168), (13824, 5120)]  # (K, N): qkv and down of Qwen2.5-14B
M_BUCKETS = [1, 9, 32, 64, 128, 256, 2048]  # one M of each dispatch bucket
SWEEP_MS = [1, 16, 64, 128, 256, 512]  # bench/kernels.py --sweep's M values


@functools.lru_cache(maxsize=64)
def random_weight(
    k: int, n: int, bits: int, group_size: int, sym: bool, act_order: bool, scale_dtype
) -> PackedQuantWeight:
    group = k if group_size == -1 else group_size
    groups = -(-k // group)
    return PackedQuantWeight(
        bits=bits,
        group_size=group,
        qweight=torch.empty((k * bits // 32, n), dtype=torch.int32),  # [K / pf, N]: no kernel reads it here
        scales=(torch.rand(groups, n) * 0.01 + 0.001).to(scale_dtype),  # [groups, N]
        zeros=None if sym else torch.randint(0, 2**bits, (groups, n), dtype=torch.uint8),  # [groups, N]
        perm=torch.randperm(k) if act_order else None,  # [K]
    )


@contextlib.contextmanager
def layout_without_shuffling() -> Iterator[None]:
    """``mma_shuffle`` returns a weight of the shuffled layout's shapes and dtypes with its words left
    unwritten. A launch depends on those alone (no kernel runs here), and shuffling a 14B-sized layer
    takes seconds of CPU: most of this drive's time otherwise. The shuffle itself is checked by
    tests/kernels/test_w4a16_mma.py; scales, zeros and permutation stay each weight's own, converted
    as ``mma_shuffle`` converts them."""
    from quant_kernels import w4a16_mma_triton

    def shuffle(weight: PackedQuantWeight, kwidth: int = 2) -> MmaQuantWeight:
        k, n = weight.in_features, weight.out_features
        words = torch.empty(mma_storage_shape(k, n, weight.bits), dtype=torch.int32, device=weight.qweight.device)
        return MmaQuantWeight(
            weight.bits, weight.group_size, k, n, kwidth, words, weight.scales, mma_zeros(weight), weight.perm
        )

    with mock.patch.object(w4a16_mma_triton, "mma_shuffle", shuffle):
        yield


def build_model(case: ModelCase, dtype: torch.dtype) -> tuple[LlamaFamilyForCausalLM, ModelConfig]:
    """The model with random weights, prepared for the (simulated) device the way loading does."""
    config = model_config(case.config, source=case.name)
    spec = CheckpointSpec(
        method="gptq", bits=case.bits, group_size=case.group_size, sym=case.sym, desc_act=case.act_order
    )
    with torch.device("cpu"):
        model = LlamaFamilyForCausalLM(config, dtype, lambda names: make_linear_method(spec, names))
    for module in model.modules():
        if isinstance(module, Linear) and hasattr(module, "quant_shards"):
            for shard_id, n in enumerate(module.output_sizes):
                weight = random_weight(
                    module.in_features, n, case.bits, case.group_size, case.sym, case.act_order, case.scale_dtype
                )
                module.load_weight(shard_id, weight)
            module.process_after_loading()
    model.eval()
    return model, config


def _sequence(name: str, start: int, count: int, blocks: int, prompt_len: int, params: SamplingParams):
    prompt = [(7 * i + 3) % VOCAB for i in range(prompt_len)]
    output = [1] * max(0, start + count - prompt_len)
    return ScheduledSequence(name, start, count, list(range(blocks)), prompt, output, params, True)


def decode_step(batch: int, context: int) -> SchedulerOutput:
    """``batch`` sequences with ``context`` tokens each, one new token each (greedy)."""
    blocks = -(-context // BLOCK_SIZE)
    greedy = SamplingParams(temperature=0.0)
    rows = [_sequence(f"d{i}", context - 1, 1, blocks, context - 1, greedy) for i in range(batch)]
    return SchedulerOutput(rows, batch)


def _kv_pool(config: ModelConfig, kv_dtype: torch.dtype) -> tuple[int, int, list]:
    """``(max_model_len, num_blocks, kv_caches)``: a pool that holds one sequence of the longest length."""
    max_len = min(MAX_MODEL_LEN, config.max_position_embeddings)
    num_blocks = -(-max_len // BLOCK_SIZE) + 8
    return max_len, num_blocks, allocate_kv_caches(config, num_blocks, BLOCK_SIZE, kv_dtype, torch.device("cpu"))


def _graph_forwards(capture: Capture, model, kv_caches: list, max_len: int, buckets, label: str) -> None:
    """The decode CUDA graphs' forward (what capture records) for each batch bucket, at the graphs'
    fixed length."""
    graphs = DecodeGraphs(model, kv_caches, MAX_NUM_SEQS, max_len, BLOCK_SIZE, torch.device("cpu"))
    for batch in buckets:
        with where(capture, f"{label} decode graph batch {batch}"), torch.inference_mode():
            graphs._run(batch)


def drive_model(capture: Capture, case: ModelCase, model, config: ModelConfig, dtype_name: str, kv: str) -> None:
    """The launches of an engine serving ``model`` with a ``kv`` cache: warm-up, graphs, eager decodes."""
    max_len, num_blocks, kv_caches = _kv_pool(config, KV_DTYPES[kv] or model.dtype)
    runner = ModelRunner(model, config, kv_caches, BLOCK_SIZE, torch.device("cpu"))
    label = f"{case.name} {dtype_name} kv={kv}"
    steps = warmup_steps(
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=max_len,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        vocab_size=VOCAB,
    )
    # Prefill chunks past 256 tokens all take the dequantize path and the same attention launches
    # (only grids differ): the largest stands for them.
    steps = [s for s in steps if s.num_batched_tokens <= 256 or s.num_batched_tokens == MAX_NUM_BATCHED_TOKENS
             or len(s.sequences) > 1]  # fmt: skip
    if kv != "auto":  # the KV dtype changes attention only: its prefill, mixed and decode steps
        steps = [s for s in steps if s.num_batched_tokens in (16, MAX_NUM_BATCHED_TOKENS) or len(s.sequences) > 1]
    for step in steps:
        with where(capture, f"{label} warm-up step of {step.num_batched_tokens} tokens"):
            runner.execute(step)
    # Eager decodes (batches past the last graph bucket, or enforce_eager): the split count follows
    # the batch's real longest context.
    for batch, context in ((1, 16), (1, max_len), (3, 700), (64, 4096), (300, 100)):
        with where(capture, f"{label} eager decode batch {batch} context {context}"):
            runner.execute(decode_step(batch, min(context, max_len)))
    _graph_forwards(capture, model, kv_caches, max_len, DEFAULT_BUCKETS if kv == "auto" else (1, 8, 64, 256), label)


def mma_layers(model) -> Iterator[tuple[str, ops.W4A16Prepared]]:  # noqa: ANN001 - a LlamaFamilyForCausalLM
    """``(name, prepared)`` of every linear of ``model`` whose weight is in the MMA-operand layout."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and hasattr(module, "quant_prepared"):
            for prepared in module.quant_prepared:
                if isinstance(prepared, ops.W4A16Prepared) and isinstance(prepared.weight, MmaQuantWeight):
                    yield name, prepared


def drive_sweep(capture: Capture, case: ModelCase, model) -> None:
    """Every candidate ``bench/kernels.py --sweep`` times (and may pin with ``set_config``) on this
    model's layers, launched as that bench launches them: fp16, no bias."""
    from quant_kernels import w4a16_mma_triton as mma

    for name, prepared in mma_layers(model):
        w = prepared.weight
        for m in SWEEP_MS:
            x = torch.zeros((m, w.in_features), dtype=model.dtype)  # [M, K]
            for cfg in mma.candidate_configs(m, w.in_features, w.out_features, w.group_size):
                with where(capture, f"{case.name} sweep {name} M={m} {cfg.short()}"), torch.inference_mode():
                    mma.w4a16_gemm(x, w, None, config=cfg, counters=prepared.counters)


GLUON_MS = [65, 128, 256, 2048]  # QSERVE_W4A16_GLUON=1 serves 65 rows and more; 2048 is a prefill chunk


def drive_gluon(capture: Capture, case: ModelCase, model, dtype_name: str) -> None:
    """``QSERVE_W4A16_GLUON=1`` (sm90: the Gluon kernel from 65 rows; unset it serves 65-512 rows by
    ``w4a16_mma_triton.gluon_by_default``, which the engine's own warm-up steps reach): every 4-bit layer of ``model`` through the real dispatch
    (``ops.w4a16_linear``) at each row count the switch sends there, then ``bench/w4a16_gluon.py``'s
    candidates on the first layer (fp16, as that bench runs them)."""
    from quant_kernels import w4a16_mma_triton as mma
    from quant_kernels import w4a16_wgmma_gluon as glk

    first = None
    with mock.patch.dict(os.environ, {mma.GLUON_ENV: "1"}), torch.inference_mode():
        for name, prepared in mma_layers(model):
            first = first or prepared.weight
            for m in GLUON_MS:
                x = torch.zeros((m, prepared.weight.in_features), dtype=model.dtype)  # [M, K]
                with where(capture, f"{case.name} {dtype_name} Gluon W4A16 {name} M={m}"):
                    ops.w4a16_linear(x, prepared)
    # the built-in rows: the narrow launch at 33-64 rows where its tiles split, the split launch at 128
    switches = {mma.GLUON_ENV: "", mma.GLUON_NARROW_ENV: ""}
    with mock.patch.dict(os.environ, switches), torch.inference_mode():
        for name, prepared in mma_layers(model):
            for m in (48, 64, 128):
                x = torch.zeros((m, prepared.weight.in_features), dtype=model.dtype)  # [M, K]
                with where(capture, f"{case.name} {dtype_name} Gluon W4A16 built-in {name} M={m}"):
                    ops.w4a16_linear(x, prepared)
    if first is None or model.dtype != torch.float16:
        return
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from w4a16_gluon import configs

    for m in (128, 256, 1024):
        x = torch.zeros((m, first.in_features), dtype=torch.float16)  # [M, K]
        for cfg in configs(m):
            with where(capture, f"{case.name} Gluon W4A16 bench candidate M={m} {cfg.short()}"), torch.inference_mode():
                glk.w4a16_wgmma(x, first, config=cfg)


def drive_formats(capture: Capture, dtype: torch.dtype, dtype_name: str, labels: tuple[str, ...] | None) -> None:
    """The W4A16 dispatch (``ops``) for each extra weight format (``labels``; None: all) at every M bucket."""
    for label, bits, group, sym, act_order in FORMATS:
        if labels is not None and label not in labels:
            continue
        for k, n in FORMAT_SHAPES:
            weight = random_weight(k, n, bits, group, sym, act_order, torch.float16)
            prepared = ops.prepare_w4a16(weight)
            for m in M_BUCKETS:
                x = torch.zeros((m, k), dtype=dtype)  # [M, K]
                with where(capture, f"format {label} {dtype_name} K={k} N={n} M={m}"), torch.inference_mode():
                    ops.w4a16_linear(x, prepared)


# Qwen3-30B-A3B's experts (hidden 2048, 128 experts top-8, expert MLP 768, GPTQ g128); token
# counts that reach both of moe_triton.default_config's tiles (decode and prefill) and, at 512
# tokens (4096 pairs), the token sort's loops over several chunks.
MOE_SHAPE = (2048, 128, 8, 768)
MOE_TOKENS = [1, 32, 512]
MOE_EP_RANKS = 4  # expert parallelism: one rank's 32 experts, other ranks' pairs as the sentinel id


def _zero_experts(k: int, n: int, experts: int, sym: bool = True):  # noqa: ANN202 - a StackedQuantWeight
    """``experts`` stacked 4-bit g128 weights of K x N, all codes zero (compiling needs no values);
    ``sym=False`` adds AWQ-style zeros."""
    from quant_kernels.moe_layout import StackedQuantWeight

    qweight = torch.zeros((experts, k // 8, n), dtype=torch.int32)  # [E, K/8, N]
    scales = torch.ones((experts, k // 128, n), dtype=torch.float16)  # [E, ng, N]
    zeros = None if sym else torch.full((experts, k // 128, n), 8, dtype=torch.uint8)
    return StackedQuantWeight(4, 128, qweight, scales, zeros)


def _run_mma_experts(capture: Capture, prepared, m: int, ep: bool, dtype: torch.dtype, label: str) -> None:  # noqa: ANN001
    """One MoE layer's experts at ``m`` tokens through ``moe_ops.moe_experts`` (ids spread over every
    expert; with ``ep``, one expert-parallel rank's share, the others' pairs as the sentinel)."""
    from quant_kernels import moe_ops, moe_reference

    hidden, num_experts, top_k, _ = MOE_SHAPE
    local_experts = num_experts // MOE_EP_RANKS
    x = torch.zeros((m, hidden), dtype=dtype)  # [T, H]
    ids = (torch.arange(m * top_k, dtype=torch.int32) % num_experts).view(m, top_k)  # [T, k]
    if ep:
        ids = moe_reference.local_expert_ids(ids, local_experts, local_experts)
    weights = torch.full((m, top_k), 1.0 / top_k)  # [T, k]
    with where(capture, label), torch.inference_mode():
        moe_ops.moe_experts(x, prepared, weights, ids)


def drive_moe(capture: Capture, dtype: torch.dtype, dtype_name: str, pdl: bool = False) -> None:
    """The fused MoE kernels (``QSERVE_MOE_KERNEL=fused``: the token sort, gate_up, down) through
    ``moe_ops``' dispatch, with the ids the MoE block passes (int32 from ``select_experts``), for all
    the experts and for one expert-parallel rank's share (``skip_foreign``: one more sort group)."""
    from quant_kernels import moe_ops, moe_reference
    from quant_kernels.moe_layout import StackedQuantWeight

    hidden, num_experts, top_k, inter = MOE_SHAPE

    def stacked(experts: int, k: int, n: int) -> StackedQuantWeight:
        qweight = torch.zeros((experts, k // 8, n), dtype=torch.int32)  # [E, K/8, N]
        return StackedQuantWeight(4, 128, qweight, torch.ones((experts, k // 128, n), dtype=torch.float16))

    local_experts = num_experts // MOE_EP_RANKS
    with mock.patch.dict(os.environ, {moe_ops.FUSED_MOE_ENV: "1", moe_ops.MOE_KERNEL_ENV: "fused"}):
        layouts = {
            "": moe_ops.prepare_experts(stacked(num_experts, hidden, 2 * inter), stacked(num_experts, inter, hidden)),
            f" EP rank 1 of {MOE_EP_RANKS}": moe_ops.prepare_experts(
                stacked(local_experts, hidden, 2 * inter), stacked(local_experts, inter, hidden), skip_foreign=True
            ),
        }
    for label, prepared in layouts.items():
        assert prepared.kind == "stacked" and prepared.fused, "the fused MoE kernel was not selected"
        for m in MOE_TOKENS:
            x = torch.zeros((m, hidden), dtype=dtype)  # [T, H]
            ids = (torch.arange(m * top_k, dtype=torch.int32) % num_experts).view(m, top_k)  # [T, k]
            if prepared.skip_foreign:
                ids = moe_reference.local_expert_ids(ids, local_experts, local_experts)
            weights = torch.full((m, top_k), 1.0 / top_k)  # [T, k]
            with where(capture, f"fused MoE{label} {dtype_name} T={m}"), torch.inference_mode():
                moe_ops.moe_experts(x, prepared, weights, ids)
    for m in MOE_TOKENS:  # the router as the MoE block calls it (QSERVE_FUSED_ROUTER=1): [T, E] logits
        with mock.patch.dict(os.environ, {moe_ops.FUSED_ROUTER_ENV: "1"}):
            with where(capture, f"MoE router {dtype_name} T={m}"), torch.inference_mode():
                moe_ops.select_experts(torch.zeros((m, num_experts), dtype=dtype), top_k, True)
    drive_moe_mma(capture, dtype, dtype_name, pdl)


# (tokens, one expert-parallel rank's share): QSERVE_MOE_DIRECT_BLOCKS=32 (the default) at Qwen3-30B-A3B's top-8 serves 1-4
# tokens; the router's one program at its smallest and largest tile, for all experts and one rank's share.
MOE_DIRECT_CASES = [(1, False), (4, True)]


def drive_moe_direct_blocks(capture: Capture, dtype: torch.dtype, dtype_name: str, pdl: bool = False) -> None:
    """The router's one-pair-per-block layout (``QSERVE_MOE_DIRECT_BLOCKS=32`` with
    ``QSERVE_FUSED_ROUTER=1``) as the MoE block runs it: ``moe_ops.route_hidden`` (F.linear, then the
    router kernel that also writes the blocks, ids made local for a rank's share; and again with the
    default ``QSERVE_FUSED_ROUTER_GEMM``: the one launch that also computes the logits) and
    ``moe_experts`` with that layout (the default MMA-operand kernel over T*k blocks, no sort launch).
    The grouped GEMMs' own specializations are those without the layout (``drive_moe_mma``): the new
    launches are the routers'."""
    from quant_kernels import moe_ops

    hidden, num_experts, top_k, inter = MOE_SHAPE
    local_experts = num_experts // MOE_EP_RANKS

    env = {moe_ops.MOE_KERNEL_ENV: "", moe_ops.FUSED_ROUTER_ENV: "1", moe_ops.DIRECT_BLOCKS_ENV: "32"}
    with mock.patch.dict(os.environ, env), layout_without_shuffling():
        for m, ep in MOE_DIRECT_CASES:
            experts = local_experts if ep else num_experts
            prepared = moe_ops.prepare_experts(
                _zero_experts(hidden, 2 * inter, experts), _zero_experts(inter, hidden, experts), skip_foreign=ep
            )
            assert prepared.kind == "mma", "the MMA-operand MoE kernel was not selected"
            x = torch.zeros((m, hidden), dtype=dtype)  # [T, H]
            router = torch.zeros((num_experts, hidden), dtype=dtype)  # [E, H]: scores every rank's experts
            rank = f" EP rank 1 of {MOE_EP_RANKS}" if ep else ""
            # QSERVE_FUSED_ROUTER_GEMM=0's two launches; the default one; with ``pdl`` the default one again
            # under QSERVE_ENABLE_PDL=1 (the router rows prefetched into L2 before the wait)
            # and the default one with QSERVE_MOE_PACKED_TOPK=1's one-reduction top-k rounds
            variants = (("0", "0", "0"), ("1", "0", "0"), ("1", "0", "1"), *((("1", "1", "0"),) if pdl else ()))
            for fused, pdl_env, packed in variants:
                label = f"MoE direct blocks{rank} {dtype_name} T={m}" + (" fused router GEMM" if fused == "1" else "")
                label += (" PDL" if pdl_env == "1" else "") + (" packed top-k" if packed == "1" else "")
                env = {
                    moe_ops.FUSED_ROUTER_GEMM_ENV: fused,
                    "QSERVE_ENABLE_PDL": pdl_env,
                    "QSERVE_MOE_PACKED_TOPK": packed,
                }
                with mock.patch.dict(os.environ, env), where(capture, label):
                    with torch.inference_mode():
                        routing = moe_ops.route_hidden(x, router, top_k, True, prepared, local_experts if ep else 0)
                        assert routing.layout is not None, "the router's block layout was not taken"
                        moe_ops.moe_experts(x, prepared, routing.weights, routing.ids, routing.layout)


def drive_moe_mma(capture: Capture, dtype: torch.dtype, dtype_name: str, pdl: bool = False) -> None:
    """The MMA-operand MoE kernel (the default; ``QSERVE_MOE_KERNEL`` unset) through ``moe_ops``'
    dispatch, at the same shapes and token counts, symmetric and with AWQ-style zeros, and one
    expert-parallel rank's share (the experts shuffled to the simulated GPU's k-width at load, as a
    device would; the words themselves are left unwritten, see ``layout_without_shuffling``)."""
    from quant_kernels import moe_ops

    hidden, num_experts, top_k, inter = MOE_SHAPE

    local_experts = num_experts // MOE_EP_RANKS
    for sym, ep in ((True, False), (False, False), (True, True)):
        with mock.patch.dict(os.environ, {moe_ops.MOE_KERNEL_ENV: ""}):
            experts = local_experts if ep else num_experts
            prepared = moe_ops.prepare_experts(
                _zero_experts(hidden, 2 * inter, experts, sym),
                _zero_experts(inter, hidden, experts, sym),
                skip_foreign=ep,
            )
        assert prepared.kind == "mma" and prepared.fused, "the MMA-operand MoE kernel was not selected"
        for m in MOE_TOKENS:
            rank = f" EP rank 1 of {MOE_EP_RANKS}" if ep else ""
            label = f"MoE MMA kernel{rank} {dtype_name} {'sym' if sym else 'asym'} T={m}"
            _run_mma_experts(capture, prepared, m, ep, dtype, label)
    drive_moe_mma_split(capture, dtype, dtype_name, pdl)


# (QSERVE_MOE_SPLIT_K, symmetric, one expert-parallel rank's share, tokens): "auto" at one token is
# split 4 at these shapes (128 SMs and more); kept to two launches of each GEMM per dtype.
MOE_SPLIT_CASES = [("auto", True, False, 1), ("2", False, True, 32)]


def drive_moe_mma_split(capture: Capture, dtype: torch.dtype, dtype_name: str, pdl: bool = False) -> None:
    """The MMA-operand MoE kernel's split-K launches (``QSERVE_MOE_SPLIT_K``, "auto" by default) through
    ``moe_ops``' dispatch: gate_up with its workspace, arrival counters and the zeroing of the down
    launch's float32 accumulator; down adding into that accumulator; the first case again with the
    opt-in ``QSERVE_MOE_FUSED_CAST=1`` (down writing the layer's output itself) and, with ``pdl``, also
    under ``QSERVE_ENABLE_PDL=1`` (both launches wait; down prefetches its expert tiles first)."""
    from quant_kernels import moe_mma_triton, moe_ops

    hidden, num_experts, top_k, inter = MOE_SHAPE
    local_experts = num_experts // MOE_EP_RANKS
    first = MOE_SPLIT_CASES[0]
    variants = (
        [(case, "0", "0") for case in MOE_SPLIT_CASES] + [(first, "1", "0")] + ([(first, "1", "1")] if pdl else [])
    )
    for (split, sym, ep, m), cast, pdl_env in variants:
        experts = local_experts if ep else num_experts
        env = {
            moe_ops.MOE_KERNEL_ENV: "", moe_mma_triton.SPLIT_K_ENV: split, moe_mma_triton.FUSED_CAST_ENV: cast,
            "QSERVE_ENABLE_PDL": pdl_env,
        }  # fmt: skip
        with mock.patch.dict(os.environ, env):
            prepared = moe_ops.prepare_experts(
                _zero_experts(hidden, 2 * inter, experts, sym),
                _zero_experts(inter, hidden, experts, sym),
                skip_foreign=ep,
            )
            assert prepared.kind == "mma", "the MMA-operand MoE kernel was not selected"
            rank = f" EP rank 1 of {MOE_EP_RANKS}" if ep else ""
            label = f"MoE MMA kernel split-K {split}{rank} {dtype_name} {'sym' if sym else 'asym'} T={m}"
            label += (" fused cast" if cast == "1" else "") + (" PDL" if pdl_env == "1" else "")
            _run_mma_experts(capture, prepared, m, ep, dtype, label)


def drive_pdl(capture: Capture, model, config: ModelConfig, label: str) -> None:
    """QSERVE_ENABLE_PDL=1 (opt-in, sm90): the decode graphs' forward with PDL launches."""
    max_len, _, kv_caches = _kv_pool(config, model.dtype)
    with mock.patch.dict(os.environ, {"QSERVE_ENABLE_PDL": "1"}):
        _graph_forwards(capture, model, kv_caches, max_len, DEFAULT_BUCKETS, f"{label} PDL")


def drive_lora(capture: Capture, case: ModelCase, model, config: ModelConfig, dtype_name: str) -> None:
    """``--enable-lora`` with the opt-in Triton kernels (QSERVE_LORA_TRITON=1): two rank-16 adapters on
    every projection of the layer, a mixed prefill (two adapters and the base) and mixed decodes."""
    from qserve.lora.request import LoRAConfig, LoRARequest
    from qserve.lora.slots import LoRAManager
    from tests.helpers.lora_adapters import projection_shapes, write_peft_adapter

    max_len, _, kv_caches = _kv_pool(config, model.dtype)
    manager = LoRAManager(model, LoRAConfig(max_loras=4, max_lora_rank=16), model.dtype, torch.device("cpu"))
    shapes = projection_shapes(
        config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim
    )
    all_projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with tempfile.TemporaryDirectory(prefix="qserve-lora-") as folder:
        ids = []
        for i, rank in enumerate((16, 8)):
            path = Path(folder) / f"a{i}"
            write_peft_adapter(path, shapes, config.num_layers, targets=all_projections, rank=rank, alpha=16, seed=i)
            ids.append(manager.add(LoRARequest(f"a{i}", i + 1, str(path))))
    runner = ModelRunner(model, config, kv_caches, BLOCK_SIZE, torch.device("cpu"))
    runner.lora_manager = manager
    greedy = SamplingParams(temperature=0.0)
    label = f"{case.name} {dtype_name} LoRA"
    prefill = [_sequence(f"p{i}", 0, n, -(-n // BLOCK_SIZE), n, greedy) for i, n in enumerate((37, 300, 5))]
    decode = decode_step(32, 200).sequences
    with mock.patch.dict(os.environ, {"QSERVE_LORA_TRITON": "1"}):
        for step_label, sequences, loras in (
            ("prefill", prefill, [ids[0], ids[1], None]),
            ("decode batch 32", decode, [ids[i % 2] if i % 3 else None for i in range(32)]),
            ("decode batch 1", decode[:1], [ids[1]]),
        ):
            step = SchedulerOutput(
                [dataclasses.replace(seq, lora_id=lora) for seq, lora in zip(sequences, loras)],
                sum(seq.num_new_tokens for seq in sequences),
            )
            with where(capture, f"{label} {step_label}"):
                runner.execute(step)
        # LoRA decode graphs (the default): the decode graphs' forward with every row's slot as a static input
        graphs = DecodeGraphs(model, kv_caches, MAX_NUM_SEQS, max_len, BLOCK_SIZE, torch.device("cpu"), max_loras=4)
        for batch in (1, 64, 256):
            graphs._stage_lora(batch, np.arange(batch, dtype=np.int32) % 5 - 1, pinned=False)
            with where(capture, f"{label} decode graph batch {batch}"), torch.inference_mode():
                graphs._run(batch)
    for module in model.modules():  # the model goes on without LoRA
        if isinstance(module, Linear):
            module.lora = None


# Qwen2.5-14B's LoRA-adapted layers with the widest K and the most slices: (K, output slices)
LORA_KERNEL_SHAPES = [(5120, (5120, 1024, 1024)), (13824, (5120,))]


def drive_lora_kernels(capture: Capture, dtype: torch.dtype, dtype_name: str, pdl: bool = False) -> None:
    """``lora_ops.add_lora``'s launches (QSERVE_LORA_TRITON=1) at Qwen2.5-14B's qkv and down shapes,
    rank 16, through the real dispatch: decode at batch 1, a batch-32 decode graph's padded tiles
    (32 slots), a 2048-row prefill over 4 adapters (the split-K heuristic's 20-27, then 2-5 splits),
    and one split forced (``split_k=1``: the branch without the workspace and atomics, which the
    heuristic leaves to longer prefills and small K)."""
    from quant_kernels import lora_ops

    rank = 16
    with mock.patch.dict(os.environ, {lora_ops.TRITON_ENV: "1"}), torch.inference_mode():
        for k, sizes in LORA_KERNEL_SHAPES:
            starts = [0, *np.cumsum(sizes).tolist()]
            lora_a = torch.zeros(4, len(sizes) * rank, k, dtype=dtype)  # [L, S * R, K]
            lora_b = torch.zeros(4, starts[-1], rank, dtype=dtype)  # [L, N, R]
            graph_tiles = lora_ops.max_lora_tiles(32, 32)
            graph_buffer = torch.zeros(lora_ops.index_layout(32, graph_tiles)[0], dtype=torch.int32)
            lora_ops.fill_index_buffer(graph_buffer.numpy(), np.arange(32, dtype=np.int32) % 4, 32, graph_tiles)
            cases = (
                ("decode batch 1", lora_ops.build_lora_indices(np.zeros(1, dtype=np.int32), torch.device("cpu")), None),
                ("decode graph batch 32", lora_ops.indices_from_buffer(graph_buffer, 32, graph_tiles), None),
                ("prefill 2048", lora_ops.build_lora_indices(np.arange(2048, dtype=np.int32) // 512, torch.device("cpu")), None),
                ("decode batch 32, one split", lora_ops.build_lora_indices(np.arange(32, dtype=np.int32) % 4, torch.device("cpu")), 1),
            )  # fmt: skip
            for label, indices, split_k in cases:
                rows = indices.token_slots.shape[0]
                x = torch.zeros(rows, k, dtype=dtype)  # [T, K]
                y = torch.zeros(rows, starts[-1], dtype=dtype)  # [T, N]
                with where(capture, f"LoRA kernels {dtype_name} K={k} {label}"):
                    lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices, split_k=split_k)
                if pdl and label == "decode batch 1":  # QSERVE_ENABLE_PDL=1: the expand waits for the GEMM
                    with (
                        mock.patch.dict(os.environ, {"QSERVE_ENABLE_PDL": "1"}),
                        where(capture, f"LoRA kernels {dtype_name} K={k} {label} PDL"),
                    ):
                        lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices, split_k=split_k)
            # QSERVE_LORA_EXPAND_BLOCK_N's wider expand blocks ("auto" takes 256 for the widest grids)
            for block_n in ("128", "256"):
                x, y = torch.zeros(32, k, dtype=dtype), torch.zeros(32, starts[-1], dtype=dtype)
                graph = lora_ops.indices_from_buffer(graph_buffer, 32, graph_tiles)
                with (
                    mock.patch.dict(os.environ, {lora_ops.EXPAND_BLOCK_N_ENV: block_n}),
                    where(capture, f"LoRA kernels {dtype_name} K={k} expand block {block_n}, decode graph batch 32"),
                ):
                    lora_ops.add_lora(y, x, lora_a, lora_b, starts, graph)
            # QSERVE_LORA_OVERLAP=pair in a decode graph: the expand into the fp32 delta (a launch of its own
            # dtypes), through begin_lora / finish_lora; the streams stand in (no CUDA here), the launches are real
            pair = lora_ops.indices_from_buffer(
                graph_buffer, 32, graph_tiles, overlap=lora_ops.LoRAOverlap(_NoStream(), pair=True)
            )
            x, y = torch.zeros(32, k, dtype=dtype), torch.zeros(32, starts[-1], dtype=dtype)
            with (
                mock.patch.object(torch.cuda, "current_stream", lambda device=None: _NoStream()),
                mock.patch.object(torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
                where(capture, f"LoRA kernels {dtype_name} K={k} overlap pair, decode graph batch 32"),
            ):
                pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, pair)
                assert pending.delta is not None and pending.delta.dtype == torch.float32
                lora_ops.finish_lora(y, pending, lora_b, starts, pair)
        # QSERVE_LORA_FUSED_SILU: gate_up's expand inside the SiLU-and-mul, as the MLP launches it (in order,
        # finish_lora_silu_and_mul) at Qwen2.5-14B's gate_up: decode at batch 1 (also with PDL), a batch-32 graph
        lora_a = torch.zeros(4, 2 * rank, 5120, dtype=dtype)  # [L, 2R, K]
        lora_b = torch.zeros(4, 2 * 13824, rank, dtype=dtype)  # [L, 2I, R]
        starts = [0, 13824, 2 * 13824]
        fused = (
            ("decode batch 1", lora_ops.build_lora_indices(np.zeros(1, dtype=np.int32), torch.device("cpu")), False),
            ("decode batch 1 PDL", lora_ops.build_lora_indices(np.zeros(1, dtype=np.int32), torch.device("cpu")), True),
            ("decode graph batch 32", lora_ops.indices_from_buffer(graph_buffer, 32, graph_tiles), False),
        )  # fmt: skip
        for label, indices, with_pdl in fused:
            if with_pdl and not pdl:
                continue
            rows = indices.token_slots.shape[0]
            x, y = torch.zeros(rows, 5120, dtype=dtype), torch.zeros(rows, 2 * 13824, dtype=dtype)
            with (
                mock.patch.dict(os.environ, {"QSERVE_ENABLE_PDL": "1" if with_pdl else "0"}),
                where(capture, f"LoRA fused SiLU {dtype_name} gate_up {label}"),
            ):
                pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
                out = lora_ops.finish_lora_silu_and_mul(y, pending, lora_b, starts, indices)
                assert out.shape == (rows, 13824)


class _NoStream:
    """A CUDA stream's stand-in for the simulated GPU's drives: ordering calls do nothing."""

    def wait_stream(self, other: object) -> None:
        return None


# EAGLE heads' 4-bit copies at a Qwen2.5-14B target's shapes (speculative_config "draft_lm_head" / "draft_layers":
# "int4"): the lm_head [V, H] (K = H, N = V), fc and EAGLE-3's first qkv (K = 2H), a decoder layer's down (K = I).
DRAFT_LM_HEAD_SHAPE = (5120, 152064)
DRAFT_LAYER_SHAPES = (("fc", 10240, 5120), ("EAGLE-3 qkv", 10240, 7168), ("down", 13824, 5120))
# rows a drafting forward and a catch-up (4 sequences x k + 1) give the copies; past MAX_ROWS_PER_CALL the
# lm_head copy goes in slices
DRAFT_ROWS = (1, 4, 20)


def drive_draft_int4(capture: Capture, dtype: torch.dtype, dtype_name: str) -> None:
    """The EAGLE head's 4-bit copies through their real wrappers: ``draft_lm_head.logits`` (its slices
    past ``MAX_ROWS_PER_CALL`` included) and ``DraftInt4LinearMethod.apply``, asymmetric round-to-nearest
    weights (zeros), group 128, as ``pack_int4_rtn`` makes them, prepared for the simulated GPU."""
    from qserve.spec_decode import draft_layers, draft_lm_head

    def prepared(k: int, n: int):  # noqa: ANN202 - ops.W4A16Prepared
        groups = k // 128
        packed = PackedQuantWeight(
            4,
            128,
            torch.zeros((k // 8, n), dtype=torch.int32),  # [K/8, N]
            torch.ones((groups, n), dtype=dtype),  # [K/G, N]
            torch.full((groups, n), 8, dtype=torch.uint8),  # [K/G, N]
        )
        return ops.prepare_w4a16(packed)

    with torch.inference_mode():
        hidden, vocab = DRAFT_LM_HEAD_SHAPE
        lm_head = prepared(hidden, vocab)
        for rows in (*DRAFT_ROWS, draft_lm_head.MAX_ROWS_PER_CALL + 2):
            with where(capture, f"draft lm_head int4 {dtype_name} rows={rows}"):
                draft_lm_head.logits(torch.zeros((rows, hidden), dtype=dtype), lm_head)
        for name, k, n in DRAFT_LAYER_SHAPES:
            layer = Linear(
                k, [n], bias=False, params_dtype=dtype, method=draft_layers.DraftInt4LinearMethod([name]), prefix=name
            )
            layer.quant_prepared = [prepared(k, n)]
            for rows in DRAFT_ROWS:
                with where(capture, f"draft layer int4 {name} {dtype_name} rows={rows}"):
                    layer(torch.zeros((rows, k), dtype=dtype))


# Qwen3-30B-A3B's attention (hidden 2048, 32 q heads and 4 kv heads of 128, q/k norms): its MoE MLP launches
# nothing in project_qkv, so a dense Qwen3 config of these shapes builds the same Attention.
QWEN3_30B_A3B_ATTENTION = _llama_like(
    "Qwen3ForCausalLM", 2048, 32, 4, 768, head_dim=128, rope_theta=1e6, max_position_embeddings=40960
)
QK_NORM_ROPE_TOKENS = (1, 37)  # a batch-1 decode (the launch-bound step) and a short prefill


def drive_qk_norm_rope(capture: Capture, dtype: torch.dtype, dtype_name: str, pdl: bool) -> None:
    """``QSERVE_FUSED_QK_NORM_ROPE`` (the default): ``Attention.project_qkv`` of a Qwen3-30B-A3B layer, its
    q_norm, k_norm and rotary as ``rotary_kernel``'s one ``QK_NORM`` launch on q/k views into the qkv
    output; with ``pdl`` also under ``QSERVE_ENABLE_PDL=1``. The qkv projection is dense here (a torch
    product, no launch) and no whole model is driven: the fused launch is the switch's only new one, and
    the ci tier has no q/k-norm model (a second model's drive would cost minutes of CI). Then
    ``QSERVE_FUSED_ROPE_KV_STORE`` (the default): the same launch also storing the keys and values into a
    model-dtype paged cache (``STORE_KV``), with the q/k norms in it and, under
    ``QSERVE_FUSED_QK_NORM_ROPE=0``, without them (the plain rotary every other model runs)."""
    from qserve.layers.linear import DenseLinearMethod
    from qserve.layers.rotary import RotaryEmbedding
    from qserve.model.llama import FUSED_QK_NORM_ROPE_ENV, FUSED_ROPE_KV_STORE_ENV, Attention
    from qserve.runner.attn_metadata import AttentionMetadata

    config = model_config(QWEN3_30B_A3B_ATTENTION, source="qwen3-30b-a3b attention")
    with mock.patch.dict(os.environ, {FUSED_QK_NORM_ROPE_ENV: "1"}), torch.device("cpu"):
        attention = Attention(config, "model.layers.0.self_attn", dtype, lambda names: DenseLinearMethod())
        rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
    assert attention.fused_qk_norm_rope, "QSERVE_FUSED_QK_NORM_ROPE=1 did not take the fused path"
    for pdl_env in ("0", "1") if pdl else ("0",):
        for m in QK_NORM_ROPE_TOKENS:
            label = f"qwen3-30b-a3b fused q/k norm + rotary {dtype_name} T={m}" + (" PDL" if pdl_env == "1" else "")
            hidden = torch.zeros((m, config.hidden_size), dtype=dtype)  # [T, hidden]
            positions = torch.arange(m, dtype=torch.int64)  # [T]
            with mock.patch.dict(os.environ, {"QSERVE_ENABLE_PDL": pdl_env}), where(capture, label):
                with torch.inference_mode():
                    attention.project_qkv(positions, hidden, rotary, None)
    assert any(x.kernel == "rotary_kernel" and dict(x.constexprs).get("QK_NORM") for x in capture.launches.values())
    blocks = 8
    kv_cache = tuple(torch.zeros((blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim), dtype=dtype) for _ in "kv")
    for qk_norm_env in ("1", "0"):
        switches = {FUSED_QK_NORM_ROPE_ENV: qk_norm_env, FUSED_ROPE_KV_STORE_ENV: "1"}
        with mock.patch.dict(os.environ, switches), torch.device("cpu"):
            attention = Attention(config, "model.layers.0.self_attn", dtype, lambda names: DenseLinearMethod())
        for m in QK_NORM_ROPE_TOKENS:
            label = f"qwen3-30b-a3b rotary + kv store (q/k norm fused={qk_norm_env}) {dtype_name} T={m}"
            hidden = torch.zeros((m, config.hidden_size), dtype=dtype)  # [T, hidden]
            positions = torch.arange(m, dtype=torch.int64)  # [T]
            metadata = mock.Mock(spec=AttentionMetadata, slot_mapping=torch.arange(m, dtype=torch.int64))
            store = attention.rotary_store(rotary, kv_cache, metadata, dtype)
            assert store is not None, "QSERVE_FUSED_ROPE_KV_STORE=1 did not hand the rotary a store"
            with where(capture, label), torch.inference_mode():
                attention.project_qkv(positions, hidden, rotary, None, None, store)
    stores = [dict(x.constexprs) for x in capture.launches.values() if x.kernel == "rotary_kernel"]
    assert {bool(c.get("QK_NORM")) for c in stores if c.get("STORE_KV")} == {False, True}


def run(gpu: SimulatedGpu, tier: str = "ci", dtypes: tuple[str, ...] = ("fp16", "bf16"), log=print) -> Capture:
    """All the launches of ``tier`` (``TIERS``) for ``gpu``; ``log`` gets one line per stage."""
    plan = TIERS[tier]
    names = plan["models"] if gpu.arch >= 90 or plan["consumer_models"] is None else plan["consumer_models"]
    models = [c for c in MODELS if c.name in names]
    with simulated_gpu(gpu) as capture, layout_without_shuffling():
        for dtype_name in dtypes:
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
            for case in models:
                t0 = time.perf_counter()
                with where(capture, f"{case.name} {dtype_name} load"):
                    model, config = build_model(case, dtype)
                for kv in KV_DTYPES:
                    drive_model(capture, case, model, config, dtype_name, kv)
                if gpu.arch >= 90 and case is models[0]:  # bench/kernels.py runs on the H200, in fp16
                    if dtype == torch.float16:
                        drive_sweep(capture, case, model)
                    if dtype_name in plan["pdl_dtypes"]:
                        drive_pdl(capture, model, config, f"{case.name} {dtype_name}")
                    drive_gluon(capture, case, model, dtype_name)
                if case is models[0] and dtype == torch.float16:  # the LoRA kernels (sm90 and the lowest
                    drive_lora(capture, case, model, config, dtype_name)  # job's sm86 check fp16)
                    drive_lora_kernels(capture, dtype, dtype_name, gpu.arch >= 90 and dtype_name in plan["pdl_dtypes"])
                del model
                log(f"{gpu.name}: {case.name} {dtype_name} in {time.perf_counter() - t0:.1f} s, "
                    f"{len(capture.launches)} distinct launches so far, {capture.compile_seconds:.0f} s compiling")  # fmt: skip
            if gpu.arch >= 90 or plan["consumer_models"] is None:
                drive_formats(capture, dtype, dtype_name, plan["formats"])
            pdl = gpu.arch >= 90 and dtype_name in plan["pdl_dtypes"]
            drive_moe(capture, dtype, dtype_name, pdl)
            drive_moe_direct_blocks(capture, dtype, dtype_name, pdl)
            drive_qk_norm_rope(capture, dtype, dtype_name, pdl=pdl)
    return capture


KERNEL_MODULES = (
    "w4a16_mma_triton",
    "attention_triton",
    "attention_int4_triton",
    "elementwise_triton",
    "moe_triton",
)


def use_kernels_from(rev: str, folder: Path) -> None:
    """Replace the kernel modules (``quant_kernels/*_triton.py``: kernels and their wrappers) by
    their text at git revision ``rev``, to check an older tree's launches with today's drive (the
    dispatch modules that route to them stay today's). Files go to ``folder``: Triton reads a
    kernel's source from its file."""
    import importlib.util
    import subprocess

    import quant_kernels

    for name in KERNEL_MODULES:
        shown = subprocess.run(["git", "show", f"{rev}:quant_kernels/{name}.py"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parents[2])  # fmt: skip
        if shown.returncode != 0:
            raise SystemExit(f"--kernels-from {rev}: no quant_kernels/{name}.py there ({shown.stderr.strip()})")
        text = shown.stdout
        path = folder / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"quant_kernels.{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(quant_kernels, name, module)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", choices=sorted(GPUS), required=True)
    parser.add_argument("--out", required=True, help="JSON report")
    parser.add_argument("--tier", choices=sorted(TIERS), default="ci")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--kernels-from", metavar="REV", help="check the kernel modules of this git revision")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="qserve-kernels-") as folder:
        if args.kernels_from:
            use_kernels_from(args.kernels_from, Path(folder))
        t0 = time.perf_counter()
        capture = run(GPUS[args.gpu], args.tier, tuple(args.dtypes.split(",")),
                      log=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
    report = {
        "gpu": asdict(capture.gpu),
        "seconds": round(time.perf_counter() - t0, 1),
        "launches": [asdict(launch) for launch in capture.launches.values()],
    }
    with open(args.out, "w") as f:
        json.dump(report, f, default=str)
    failures = capture.failures
    print(f"{capture.gpu.name}: {len(capture.launches)} distinct launches of {len(capture.kernels())} kernels, "
          f"{len(failures)} failing, {report['seconds']} s")  # fmt: skip
    for launch in failures[:50]:
        print(f"FAIL {launch.error}\n     {launch.describe()}")
    return 1 if failures else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
