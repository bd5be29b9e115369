"""The memory planner: one budget becomes weights + activation peak + overheads + KV pages.

Knows: the bytes each part of a served model takes — weights as qserve holds them (computed
from ``config.json`` and the checkpoint's quantization metadata, no tensors read), the
activation peak of the largest step (estimated here; the GPU runner replaces the estimate with
a measured one), KV bytes per token per KV dtype — and how a budget given as bytes or as a
fraction turns into KV pages. Must not know: the scheduler, weight values or kernels.
These numbers are what ``qserve plan`` prints and what the engine logs at start-up.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

from qserve.config import ModelConfig
from qserve.distributed.sharding import expert_shard, per_rank_config
from quant_kernels.reference_kv_int4 import INT4_KV_DTYPE, cache_head_size

KV_CACHE_DTYPES = ("auto", "fp8", "int8", "int4")
CPU_KV_BUDGET_BYTES = 1 << 30  # without a budget the CPU path (tests, demo) takes 1 GiB of KV
GPU_DEFAULT_FRACTION = 0.9  # without a budget a GPU run takes this share of the card
REPORT_CONTEXTS = (1024, 4096)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_memory_budget(text: str | int | float, device_total_bytes: int | None = None) -> int:
    """``"24GiB"``, ``"512MB"``, ``25769803776`` or a fraction of the device such as ``"0.9"``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"--gpu-memory-budget {text!r} is not understood; use bytes with a unit (24GiB, 22000MB) or a fraction (0.9)"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit and number <= 1.0:
        if device_total_bytes is None:
            raise ValueError(f"--gpu-memory-budget {text!r} is a fraction, but no device size is known; give bytes")
        return int(number * device_total_bytes)
    return int(number * _UNITS[unit])


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; supported: {', '.join(KV_CACHE_DTYPES)}"
        )
    if kv_cache_dtype == "int4":
        raise ValueError("int4 KV has no whole bytes per element; use kv_bytes_per_token")
    return torch.empty((), dtype=model_dtype).element_size() if kv_cache_dtype == "auto" else 1


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes across all layers; int4 rows carry their own fp16 scale
    and zero (``quant_kernels.reference_kv_int4``): ``head_dim // 2 + 4`` bytes per KV head."""
    if kv_cache_dtype == "int4":
        return 2 * config.num_layers * config.num_kv_heads * cache_head_size(config.head_dim, INT4_KV_DTYPE)
    return config.kv_bytes_per_token(kv_dtype_bytes(kv_cache_dtype, model_dtype))


def kv_block_bytes(config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    row = cache_head_size(config.head_dim, kv_dtype) * torch.empty((), dtype=kv_dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * row * block_size


def _linear_shapes(
    config: ModelConfig, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False
) -> list[tuple[str, int, int, bool]]:
    """(HF module name, K, N, row-parallel) of every linear layer, per rank (K of row-parallel
    layers and N of column-parallel ones divided by ``tensor_parallel_size``; a MoE layer's
    routed experts as ``_moe_linear_shapes`` says)."""
    rank = per_rank_config(config, tensor_parallel_size, enable_expert_parallel)
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = rank.num_heads * d, rank.num_kv_heads * d, rank.intermediate_size
    shapes = []
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes += [(f"{attn}.q_proj", h, q, False), (f"{attn}.k_proj", h, kv, False), (f"{attn}.v_proj", h, kv, False)]
        shapes.append((f"{attn}.o_proj", q, h, True))
        if config.is_moe_layer(i):
            shapes += _moe_linear_shapes(config, mlp, tensor_parallel_size, enable_expert_parallel)
            continue
        shapes += [(f"{mlp}.gate_proj", h, inter, False)]
        shapes += [(f"{mlp}.up_proj", h, inter, False), (f"{mlp}.down_proj", inter, h, True)]
    if not config.tie_word_embeddings:
        shapes.append(("lm_head", h, math.ceil(config.vocab_size / tensor_parallel_size), False))
    return shapes


def _moe_linear_shapes(
    config: ModelConfig, mlp: str, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False
) -> list[tuple[str, int, int, bool]]:
    """A sparse layer's expert linears (and its shared expert's), under their checkpoint names, as
    rank 0 holds them (``sharding.expert_shard``): with expert parallelism only its own experts,
    whole; otherwise every expert with its intermediate size split. The shared expert is split
    like a dense MLP."""
    tp = tensor_parallel_size
    h = config.hidden_size
    held = expert_shard(config.num_experts, config.moe_intermediate_size, 0, tp, enable_expert_parallel)
    inter, split_down = held.intermediate_size, tp > 1 and not enable_expert_parallel
    gate, up, down = config.moe_expert_names
    shapes = []
    for e in range(held.expert_start, held.expert_start + held.num_local_experts):
        expert = f"{mlp}.experts.{e}"
        shapes += [(f"{expert}.{gate}", h, inter, False), (f"{expert}.{up}", h, inter, False)]
        shapes.append((f"{expert}.{down}", inter, h, split_down))
    shared = config.shared_expert_intermediate_size // tp
    if shared:
        shapes += [
            (f"{mlp}.shared_expert.gate_proj", h, shared, False),
            (f"{mlp}.shared_expert.up_proj", h, shared, False),
        ]
        shapes.append((f"{mlp}.shared_expert.down_proj", shared, h, True))
    return shapes


def weight_bytes(
    config: ModelConfig,
    spec: object | None,
    dtype: torch.dtype,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> int:
    """Bytes of weights as qserve holds them (canonical packed layout for quantized linears),
    on one rank of ``tensor_parallel_size`` (qserve.distributed.sharding's partition; with
    ``enable_expert_parallel`` a rank counts only the routed experts it holds).

    ``spec`` is a ``loaders.CheckpointSpec`` (anything with ``module_quant(name)``) or None for
    an unquantized model. Row-parallel act-order layers keep the full scales / zeros on every
    rank; the few padding rows of their padded groups are not counted.
    """
    tp = tensor_parallel_size
    elem = torch.empty((), dtype=dtype).element_size()
    rank = per_rank_config(config, tp, enable_expert_parallel)
    total = math.ceil(config.vocab_size / tp) * config.hidden_size * elem  # embeddings (vocabulary-parallel)
    norms = config.num_layers * 2 + 1
    total += norms * config.hidden_size * elem
    total += config.max_position_embeddings * config.head_dim * 4  # rotary cos / sin tables, float32
    if config.qk_norm:
        total += config.num_layers * 2 * config.head_dim * elem
    if config.qkv_bias:
        total += config.num_layers * (rank.num_heads + 2 * rank.num_kv_heads) * config.head_dim * elem
    if config.o_bias:
        total += config.num_layers * config.hidden_size * elem
    num_moe = len(config.moe_layers)  # routers [E, H] and shared-expert gates [1, H] stay 16-bit
    total += (
        num_moe
        * (config.num_experts + (1 if config.shared_expert_intermediate_size else 0))
        * config.hidden_size
        * elem
    )
    for name, k, n, row_parallel in _linear_shapes(config, tp, enable_expert_parallel):
        quant = spec.module_quant(name) if spec is not None else None
        if quant is None:
            total += k * n * elem
            continue
        if quant.group_size in (-1, None):
            num_groups = 1  # per-channel: one scale row, replicated on every rank
        else:  # act-order row-parallel shards keep every group's scales (groups are global)
            num_groups = math.ceil(k * (tp if row_parallel and quant.desc_act else 1) / quant.group_size)
        total += k * n * quant.bits // 8  # packed codes
        total += num_groups * n * elem  # scales (held in the activation dtype)
        if not quant.sym:
            total += num_groups * n  # uint8 zero points
        if quant.desc_act:
            total += k * 8  # int64 act-order permutation
    return total


# Bytes one sampler pass allocates per float32 logit of its row chunk (``SAMPLER_CHUNK_ROWS``
# rows at a time), at its worst (penalties, min_tokens, temperature + top-k + top-p + min-p,
# logprobs): 37 measured with the runner's own code on CPU (tests/unit/test_step_memory.py: the
# same torch ops allocate the same tensors on the GPU), plus 16 for the CUDA sort's key / index
# double buffers, which are not torch tensors. One top-p request in a batch makes every row of
# its chunk take this path.
# Both add 4 for the masked copy of the logits of a model whose vocabulary is padded past its
# tokenizer's (``sampler.mask_padded_vocab``).
SAMPLER_BYTES_PER_LOGIT = 37 + 16 + 4
# Prompt logprobs per logit of one slice: log-softmax (4) + rank comparison (1), plus top-k
# workspace on the GPU; the slice's float32 logits and the model-dtype LM-head output are extra.
PROMPT_LOGPROBS_BYTES_PER_LOGIT = 5 + 3 + 4


def lora_slot_bytes(
    config: ModelConfig,
    max_loras: int,
    max_lora_rank: int,
    dtype: torch.dtype,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> int:
    """Device bytes of the LoRA adapter slots (``--enable-lora``) on one rank: per decoder layer and
    slot, each of qkv / o / gate_up / down holds ``A`` ``[slices * R, K]`` and ``B`` ``[N, R]``
    (qserve.lora.slots). Under tensor parallelism a column-parallel layer (qkv, gate_up) keeps A whole
    and its rank's rows of B; a row-parallel one (o, down) its rank's columns of A and B whole."""
    # heads (KV heads replicated if few) and width; the experts' split (which LoRA never reads) as the
    # model's own, so an expert width only expert parallelism can serve is not refused here
    rank_config = per_rank_config(config, tensor_parallel_size, enable_expert_parallel)
    h, d, r = config.hidden_size, config.head_dim, max_lora_rank
    inter = rank_config.intermediate_size
    q, kv = rank_config.num_heads * d, rank_config.num_kv_heads * d
    attention = (3 * r * h + (q + 2 * kv) * r) + (r * q + h * r)
    mlp = (2 * r * h + 2 * inter * r) + (r * inter + h * r)  # a dense MLP's (MoE experts take no LoRA)
    num_dense = sum(1 for i in range(config.num_layers) if not config.is_moe_layer(i))
    elements = config.num_layers * attention + num_dense * mlp
    return max_loras * elements * torch.empty((), dtype=dtype).element_size()


def sampling_bytes(config: ModelConfig, num_sample_rows: int, num_prompt_rows: int, dtype: torch.dtype) -> int:
    """Peak transient bytes of one step after the decoder layers: the sampled rows' float32
    logits (the LM head's model-dtype output and its float32 copy exist together for a moment),
    the sampler at its worst on those rows, and one slice of prompt logprobs (the runner computes
    them ``PROMPT_LOGPROBS_CHUNK_ROWS`` positions at a time) while the sampled logits still live."""
    from qserve.runner.sampler import PROMPT_LOGPROBS_CHUNK_ROWS, SAMPLER_CHUNK_ROWS  # the runner's slices

    elem = torch.empty((), dtype=dtype).element_size()
    vocab = config.vocab_size
    rows = num_sample_rows * vocab  # logits of the sampled rows
    sampler_rows = min(num_sample_rows, SAMPLER_CHUNK_ROWS) * vocab  # logits of one sampler chunk
    chunk = min(num_prompt_rows, PROMPT_LOGPROBS_CHUNK_ROWS) * vocab  # logits of one prompt slice
    return max(
        rows * (elem + 4),  # LM head output + its float32 copy
        rows * 4 + sampler_rows * SAMPLER_BYTES_PER_LOGIT,  # the sampler, one row chunk at a time
        rows * 4 + chunk * (elem + 4),  # a prompt slice's LM head output
        rows * 4 + chunk * (4 + PROMPT_LOGPROBS_BYTES_PER_LOGIT),  # its logprobs and ranks
    )


def activation_bytes_estimate(config: ModelConfig, num_batched_tokens: int, num_seqs: int, dtype: torch.dtype) -> int:
    """Upper estimate of the transient memory of the largest step (before measuring it).

    The widest tensors of one decoder layer live at once (hidden, qkv, attention output,
    gate_up and its activation), plus the logits and sampler of every sampled row and a slice of
    prompt logprobs (``sampling_bytes``: a step samples at most ``num_seqs`` rows and holds at
    most ``num_batched_tokens`` prompt positions).
    """
    layer_peak = layer_activation_bytes(config, num_batched_tokens, dtype)
    return layer_peak + sampling_bytes(config, min(num_seqs, num_batched_tokens), num_batched_tokens, dtype)


def layer_activation_bytes(config: ModelConfig, num_tokens: int, dtype: torch.dtype) -> int:
    """The widest tensors of one decoder layer over ``num_tokens`` tokens (hidden, qkv, attention
    output, gate_up and its activation; a MoE layer's per-pair rows), without logits or sampling."""
    elem = torch.empty((), dtype=dtype).element_size()
    d = config.head_dim
    per_token = (
        3 * config.hidden_size
        + (config.num_heads + 2 * config.num_kv_heads) * d
        + config.num_heads * d
        + 3 * config.intermediate_size
    )
    if config.moe_layers:  # per (token, expert) pair: gate_up, its activation and the weighted output
        k, moe_inter = config.num_experts_per_tok, config.moe_intermediate_size
        per_token += k * (3 * moe_inter + config.hidden_size) + 3 * config.shared_expert_intermediate_size
    return num_tokens * per_token * elem


def cuda_graph_bytes_estimate(config: ModelConfig, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Decode CUDA graphs: the shared float32 logits buffer of the largest batch, and the graph
    pool holding that batch's activations (one layer's widest tensors; the LM-head output in the
    model dtype and as float32), plus slack for the kernels' split-K workspaces and static inputs.
    The sampler runs after the replay, outside the pool (its peak is ``activation_bytes``), and a
    decode step has no prompt logprobs: the pool holds neither. (It counted a prompt-logprob slice
    until 2026-12-05: 0.58 GiB at 256 sequences of a 152k vocabulary, most of the 0.8 GiB that
    bench/e2e.py found planned but never allocated.)"""
    logits = max_num_seqs * config.vocab_size * 4
    return logits + decode_graph_pool_bytes(config, max_num_seqs, dtype) + (64 << 20)


def decode_graph_pool_bytes(config: ModelConfig, max_num_seqs: int, dtype: torch.dtype) -> int:
    """The decode graphs' memory pool: the largest batch's activations (one layer's widest tensors;
    the LM-head output in the model dtype and as float32)."""
    return layer_activation_bytes(config, max_num_seqs, dtype) + max_num_seqs * config.vocab_size * (2 + 4)


def piecewise_graph_bytes_estimate(
    config: ModelConfig, max_num_tokens: int, dtype: torch.dtype, decode_pool_bytes: int = 0
) -> int:
    """Piecewise CUDA graphs (qserve.runner.piecewise_graphs) for steps of up to ``max_num_tokens``
    tokens: their static buffers (ids, positions, query, key, value, residual, attention output,
    hidden output) and what their pool adds. A piece holds one decoder layer's widest tensors at that
    size (as ``activation_bytes_estimate`` counts them, without sampling) plus the widest linear's
    weight in the model dtype (past 128 rows the W4A16 dispatch dequantizes a weight whole for cuBLAS,
    and a captured piece keeps that buffer in its pool). The pieces capture into the decode graphs'
    pool, whose ``decode_pool_bytes`` (``decode_graph_pool_bytes``) are already reserved and reused
    first: only the growth beyond it counts. (Until 2026-12-06 it counted the whole pool on top of the
    decode graphs': on the H100 the 14B at 2,048 tokens grew the pool by 270 MiB where 540 were planned,
    bench/RESULTS.md.)"""
    elem = torch.empty((), dtype=dtype).element_size()
    d = config.head_dim
    static = max_num_tokens * (
        3 * 8 + elem * ((2 * config.num_heads + 2 * config.num_kv_heads) * d + 2 * config.hidden_size)
    )
    q_width = (config.num_heads + 2 * config.num_kv_heads) * d
    widest_weight = config.hidden_size * max(q_width, 2 * config.intermediate_size, config.num_heads * d) * elem
    pool = layer_activation_bytes(config, max_num_tokens, dtype) + widest_weight
    return static + max(0, pool - decode_pool_bytes)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    overhead_bytes: int  # CUDA-graph pools, sampler buffers, allocator slack
    kv_cache_bytes: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int
    kv_tokens: int
    max_model_len: int
    max_concurrent_sequences: int  # at max_model_len
    concurrent_sequences_at: dict[int, int] = field(default_factory=dict)
    lora_bytes: int = 0  # LoRA adapter slots on the device (--enable-lora: max_loras x every adapted layer)
    # an EAGLE head's KV indexed by the target's blocks: bytes per token of every page (in
    # kv_cache_bytes, not in kv_bytes_per_token), and its scratch blocks for drafted positions
    shadow_kv_bytes_per_token: int = 0
    shadow_scratch_bytes: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        gib = 2**30
        lines = [
            f"budget            {self.budget_bytes / gib:8.2f} GiB",
            f"weights           {self.weights_bytes / gib:8.2f} GiB",
            f"activation peak   {self.activation_bytes / gib:8.2f} GiB",
            f"overheads         {self.overhead_bytes / gib:8.2f} GiB",
            *([f"LoRA slots        {self.lora_bytes / gib:8.2f} GiB"] if self.lora_bytes else []),
            f"KV cache          {self.kv_cache_bytes / gib:8.2f} GiB  ({self.kv_cache_dtype}, "
            f"{self.kv_bytes_per_token / 1024:.1f} KiB/token"
            + (
                f" + {self.shadow_kv_bytes_per_token / 1024:.1f} KiB/token of the EAGLE head's KV, "
                f"{self.shadow_scratch_bytes / 2**20:.1f} MiB of its scratch blocks)"
                if self.shadow_kv_bytes_per_token
                else ")"
            ),
            f"KV pages          {self.num_kv_blocks} x {self.block_size} tokens = {self.kv_tokens} tokens",
            f"max concurrent sequences at max_model_len={self.max_model_len}: {self.max_concurrent_sequences}",
        ]
        lines += [f"max concurrent sequences at {ctx} tokens: {n}" for ctx, n in self.concurrent_sequences_at.items()]
        return "\n".join(lines)


def make_plan(
    config: ModelConfig,
    *,
    weights_bytes: int,
    budget_bytes: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    activation_bytes: int | None = None,
    overhead_bytes: int | None = None,
    tensor_parallel_size: int = 1,
    lora_bytes: int = 0,
    enable_expert_parallel: bool = False,
    piecewise_graph_tokens: int = 0,
    shadow_kv_bytes_per_token: int = 0,
    shadow_scratch_blocks: int = 0,
) -> MemoryPlan:
    """KV pages = budget - weights - activation peak - overheads (- LoRA slots). Refuses a budget that cannot
    hold one request at ``max_model_len`` and names the largest context that fits.

    With ``tensor_parallel_size > 1`` everything is per rank: the budget is one device's,
    ``weights_bytes`` one rank's shard (``weight_bytes(..., tensor_parallel_size)``), the KV pages
    hold this rank's KV heads, so a page is the same number of tokens on every rank.

    An EAGLE head's KV cache indexed by the target's block ids (``qserve.spec_decode.shadow_kv``)
    makes every page ``shadow_kv_bytes_per_token`` per token larger (the head's layers' share), plus
    ``shadow_scratch_blocks`` head-only blocks: the pool has that fraction fewer pages, and a
    speculating sequence holds no page more than without speculation."""
    max_model_len = max_model_len or config.max_position_embeddings
    config = per_rank_config(config, tensor_parallel_size, enable_expert_parallel)  # heads / widths per rank
    if activation_bytes is None:
        activation_bytes = activation_bytes_estimate(config, max_num_batched_tokens, max_num_seqs, dtype)
    else:
        # A measured peak (the profiler's forward and a plain softmax + sort) does not see the
        # sampler's worst case nor prompt logprobs, which come after the layers: take the larger.
        rows = min(max_num_seqs, max_num_batched_tokens)
        activation_bytes = max(activation_bytes, sampling_bytes(config, rows, max_num_batched_tokens, dtype))
    decode_pool = 0  # what the piecewise graphs find reserved in the pool they share with the decode graphs
    if overhead_bytes is None:
        overhead_bytes = cuda_graph_bytes_estimate(config, max_num_seqs, dtype)
        decode_pool = decode_graph_pool_bytes(config, max_num_seqs, dtype)
    if piecewise_graph_tokens:  # piecewise graphs (on CUDA unless QSERVE_PIECEWISE_GRAPHS=0) for steps up to this size
        overhead_bytes += piecewise_graph_bytes_estimate(config, piecewise_graph_tokens, dtype, decode_pool)
    target_per_token = kv_bytes_per_token(config, kv_cache_dtype, dtype)
    per_token = target_per_token + shadow_kv_bytes_per_token  # a page's bytes per token, the head's share too
    scratch_bytes = shadow_scratch_blocks * block_size * shadow_kv_bytes_per_token
    kv_budget = budget_bytes - weights_bytes - activation_bytes - overhead_bytes - lora_bytes - scratch_bytes
    num_blocks = max(kv_budget, 0) // (per_token * block_size)
    kv_tokens = num_blocks * block_size
    blocks_per_seq = math.ceil(max_model_len / block_size)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the budget of {budget_bytes / 2**30:.2f} GiB leaves {max(kv_budget, 0) / 2**30:.2f} GiB for KV after "
            f"weights ({weights_bytes / 2**30:.2f} GiB) and activations; one request of max_model_len={max_model_len} "
            f"needs {blocks_per_seq * block_size * per_token / 2**30:.2f} GiB. The largest context that fits is "
            f"{kv_tokens} tokens: lower --max-model-len or raise --gpu-memory-budget"
        )
    return MemoryPlan(
        budget_bytes=budget_bytes,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        overhead_bytes=overhead_bytes,
        kv_cache_bytes=num_blocks * block_size * per_token + scratch_bytes,
        kv_cache_dtype=kv_cache_dtype,
        kv_bytes_per_token=target_per_token,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        kv_tokens=kv_tokens,
        max_model_len=max_model_len,
        max_concurrent_sequences=num_blocks // blocks_per_seq,
        concurrent_sequences_at={
            ctx: num_blocks // math.ceil(ctx / block_size) for ctx in REPORT_CONTEXTS if ctx <= max_model_len
        },
        lora_bytes=lora_bytes,
        shadow_kv_bytes_per_token=shadow_kv_bytes_per_token,
        shadow_scratch_bytes=scratch_bytes,
    )


def plan_num_kv_blocks(
    config: ModelConfig,
    kv_dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    device: torch.device,
    shadow_kv_bytes_per_token: int = 0,
) -> int:
    """Blocks for the KV pool when no budget was given: what is free (GPU) or 1 GiB (CPU),
    never more than ``max_num_seqs`` full-length sequences need; an EAGLE head's KV indexed by the
    target's blocks makes each block ``shadow_kv_bytes_per_token`` per token larger."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_DEFAULT_FRACTION)
    else:
        budget = CPU_KV_BUDGET_BYTES
    block_bytes = kv_block_bytes(config, block_size, kv_dtype) + shadow_kv_bytes_per_token * block_size
    blocks_per_seq = math.ceil(max_model_len / block_size)
    num_blocks = min(budget // block_bytes, blocks_per_seq * max_num_seqs)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"one sequence of max_model_len={max_model_len} tokens needs {blocks_per_seq * block_bytes} bytes of KV "
            f"but only {budget} are available; the largest context that fits is {num_blocks * block_size} tokens "
            "(--max-model-len)"
        )
    return int(num_blocks)
