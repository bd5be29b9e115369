"""Measure what the planner can only estimate: the activation peak of the largest step, and the
range of keys and values (to scale int8 / fp8 KV caches).

Knows: how to run one throw-away forward pass (and a sampler pass) through a loaded model with a
temporary KV cache. Must not know: scheduling, requests or the HTTP layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qserve.config import ModelConfig
from qserve.runner.attn_metadata import AttentionMetadata

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}  # int4: packed rows
KV_CODE_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
KV_SCALE_HEADROOM = 1.25  # live traffic may exceed what the profiling batch saw


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; supported: auto, fp8, int8, int4")
    return KV_DTYPES[kv_cache_dtype]


@dataclass(frozen=True, slots=True)
class Profile:
    activation_bytes: int  # peak transient bytes of the largest step (0 where not measurable)
    key_absmax: list[float]  # per layer
    value_absmax: list[float]  # per layer


@torch.inference_mode()
def profile_model(
    model: torch.nn.Module,
    config: ModelConfig,
    *,
    num_tokens: int,
    max_model_len: int,
    num_sample_rows: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Profile:
    """One forward over ``num_tokens`` prompt tokens (in sequences of at most ``max_model_len``)
    plus logits and softmax for ``num_sample_rows`` rows. On CUDA the allocator's peak, minus the
    temporary KV cache, is the activation peak."""
    seq_len = min(num_tokens, max_model_len)
    num_seqs = math.ceil(num_tokens / seq_len)
    lens = [seq_len] * (num_seqs - 1) + [num_tokens - seq_len * (num_seqs - 1)]
    blocks_per_seq = math.ceil(seq_len / block_size)
    shape = (num_seqs * blocks_per_seq, block_size, config.num_kv_heads, config.head_dim)
    is_cuda = device.type == "cuda"
    if is_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    kv_caches = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]
    kv_bytes = 2 * config.num_layers * math.prod(shape) * kv_caches[0][0].element_size()
    generator = torch.Generator(device="cpu").manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=generator).to(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    slots = torch.cat([torch.arange(n) + i * blocks_per_seq * block_size for i, n in enumerate(lens)]).to(device)
    tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, blocks_per_seq).to(device)
    starts = torch.tensor([0] + lens).cumsum(0).to(device)
    metadata = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.tensor(lens, device=device),
        query_start_loc=starts,
        max_query_len=seq_len,
        max_seq_len=seq_len,
    )
    hidden = model(input_ids, positions, kv_caches, metadata)  # [num_tokens, hidden]
    rows = torch.arange(num_sample_rows, device=device) % num_tokens
    logits = model.compute_logits(hidden[rows])  # [rows, vocab]
    torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)  # what top-p/top-k sampling needs
    activation = 0
    if is_cuda:
        torch.cuda.synchronize(device)
        activation = max(torch.cuda.max_memory_allocated(device) - base - kv_bytes, 0)
    key_absmax = [float(k.abs().max()) for k, _ in kv_caches]
    value_absmax = [float(v.abs().max()) for _, v in kv_caches]
    return Profile(activation, key_absmax, value_absmax)


def set_kv_scales(model: torch.nn.Module, profile: Profile, kv_dtype: torch.dtype) -> None:
    """Per-layer scales so the profiled K/V range (with headroom) fills the code range.

    fp8 keeps scale 1.0 unless values would overflow e4m3's +-448; int8 always needs a scale;
    int4 rows carry their own per-token scales, so there is nothing to set.
    """
    if kv_dtype not in KV_CODE_MAX:
        return
    code_max = KV_CODE_MAX[kv_dtype]
    for layer, k_max, v_max in zip(model.model.layers, profile.key_absmax, profile.value_absmax):
        attn = layer.self_attn.attn
        for buffer, absmax in ((attn.k_scale, k_max), (attn.v_scale, v_max)):
            scale = max(absmax, 1e-6) * KV_SCALE_HEADROOM / code_max
            if kv_dtype == torch.float8_e4m3fn:
                scale = max(scale, 1.0)
            buffer.fill_(scale)
