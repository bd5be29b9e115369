"""Pure-PyTorch reference ops: the CPU path of the engine and the oracle for every Triton kernel.

Knows: tensor math on the canonical layouts (``quant_kernels.layout``) and on the paged KV
cache. Must not know: engines, requests, checkpoint formats. Every op here is batch-vectorized
(no Python loop over requests) so the same call sites can swap in a Triton kernel unchanged.

Paged KV cache layout (per layer): ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot ``s`` lives at block
``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

import torch

from quant_kernels.layout import PackedQuantWeight, unpack_codes

# ----------------------------------------------------------------------------------------------
# Quantized weights
# ----------------------------------------------------------------------------------------------


def dequantize(weight: PackedQuantWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense ``[K, N]`` weight in *packed row order* (apply ``weight.perm`` to inputs, not here)."""
    codes = unpack_codes(weight.qweight, weight.bits)  # int32 [K, N]
    num_rows = codes.shape[0]
    group_of_row = torch.arange(num_rows, device=codes.device) // weight.group_size  # [K]
    if weight.zeros is None:
        zeros = torch.full((1, 1), 1 << (weight.bits - 1), dtype=torch.int32, device=codes.device)
    else:
        zeros = weight.zeros.to(torch.int32)[group_of_row]  # [K, N]
    scales = weight.scales[group_of_row]  # [K, N]
    out_dtype = dtype or weight.scales.dtype
    return ((codes - zeros).to(torch.float32) * scales.to(torch.float32)).to(out_dtype)


def dequantize_input_order(weight: PackedQuantWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense ``[K, N]`` weight with rows in the layer's original input order."""
    dense = dequantize(weight, dtype)
    if weight.perm is None:
        return dense
    restored = torch.empty_like(dense)
    restored[weight.perm] = dense
    return restored


def w4a16_matmul(x: torch.Tensor, weight: PackedQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W (+ bias)`` for ``x: [M, K]`` and a packed weight (4- or 8-bit); returns ``[M, N]``."""
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    out = x @ dequantize(weight, x.dtype)
    if bias is not None:
        out = out + bias
    return out


# ----------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
) -> None:
    """Write new keys and values into their cache slots; negative slots (pad rows) are skipped.

    Model-dtype caches only: fp8 / int8 caches need scales (``reference_kv_quant.store_kv``).
    """
    if key_cache.dtype in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"store_kv: a {key_cache.dtype} cache needs scales; use reference_kv_quant.store_kv")
    write_slots(key.to(key_cache.dtype), value.to(value_cache.dtype), key_cache, value_cache, slot_mapping)


def write_slots(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], already in the cache dtype
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], already in the cache dtype
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = skip
) -> None:
    """Copy values into cache slots as they are (the store step shared by every cache dtype)."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = key_cache.shape[1]
    # Index by (block, offset) rather than flattening, so caches that are strided views into a
    # shared page buffer work too.
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


# Most bytes one padded attention call may hold in fp32 scores and gathered K/V. A step whose
# padding would exceed it (e.g. 256 prompts sharing a 1,000-token cached prefix, one of them a
# whole prefill: every sequence padded to 1,000 queries x 1,000 keys, ~4.9 GB on the CPU) runs in
# groups of sequences, and a long prompt in slices of its query rows (a slice of rows [a, b) of a
# sequence is itself a sequence of ``b - a`` new tokens over ``seq_len - q_len + b`` of context).
REFERENCE_ATTENTION_BYTES = 256 << 20


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int [num_seqs]: tokens in context after this step (cached + new)
    query_start_loc: torch.Tensor,  # int [num_seqs + 1]: cumulative query lengths
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads]
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    Covers decode (one new token per sequence) and prefill or extend (several new tokens over a
    cached prefix) in one batched call. A new token at position ``p`` sees keys ``j <= p`` and,
    with a sliding window ``w``, only ``j > p - w`` (Mistral's convention). Returns
    ``[num_tokens, num_heads, head_dim]`` in the query dtype; the math runs in float32.
    With ``alibi_slopes`` each score of head ``h`` gets ``slope[h] * (j - p)`` added (ALiBi; the
    same softmax as HF Baichuan's ``slope * j``, which differs by a per-row constant).

    One vectorized call when its padded tensors fit ``REFERENCE_ATTENTION_BYTES``; otherwise the
    same math over bounded groups (identical results, row by row).
    """
    num_seqs, num_heads, head_dim = seq_lens.shape[0], query.shape[1], query.shape[2]
    block_size = key_cache.shape[1]

    def padded_bytes(num: int, rows: int, context: int) -> int:
        keys = -(-context // block_size) * block_size
        return 4 * num * num_heads * keys * (rows + 2 * head_dim)  # fp32 scores + K and V

    if padded_bytes(num_seqs, max_query_len, max_seq_len) <= REFERENCE_ATTENTION_BYTES:
        return _padded_paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
            scale, sliding_window, alibi_slopes=alibi_slopes,
        )  # fmt: skip
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    pieces: list[tuple[int, int, int, int]] = []  # (sequence, first query row, rows, context after them)
    for seq in range(num_seqs):
        q_len = starts[seq + 1] - starts[seq]
        per_row = padded_bytes(1, 1, lens[seq]) - padded_bytes(1, 0, lens[seq])
        rows_fit = max(1, (REFERENCE_ATTENTION_BYTES - padded_bytes(1, 0, lens[seq])) // max(per_row, 1))
        for first in range(0, q_len, rows_fit):
            rows = min(rows_fit, q_len - first)
            pieces.append((seq, first, rows, lens[seq] - q_len + first + rows))
    groups: list[list[tuple[int, int, int, int]]] = []
    for piece in pieces:  # consecutive pieces while their padded tensors fit
        trial = [*groups[-1], piece] if groups else [piece]
        if groups and padded_bytes(len(trial), max(p[2] for p in trial), max(p[3] for p in trial)) <= (
            REFERENCE_ATTENTION_BYTES
        ):
            groups[-1] = trial
        else:
            groups.append([piece])
    outputs = []
    for group in groups:
        seqs = torch.tensor([p[0] for p in group], device=block_tables.device)
        rows = torch.tensor([0] + [p[2] for p in group], device=query_start_loc.device)
        outputs.append(
            _padded_paged_attention(
                torch.cat([query[starts[s] + first : starts[s] + first + n] for s, first, n, _ in group]),
                key_cache,
                value_cache,
                block_tables[seqs],
                torch.tensor([p[3] for p in group], dtype=seq_lens.dtype, device=seq_lens.device),
                rows.cumsum(0).to(query_start_loc.dtype),
                max(p[2] for p in group),
                max(p[3] for p in group),
                scale,
                sliding_window,
                alibi_slopes=alibi_slopes,
            )
        )
    return torch.cat(outputs) if outputs else query.new_zeros(query.shape)


def _padded_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int [num_seqs]: tokens in context after this step (cached + new)
    query_start_loc: torch.Tensor,  # int [num_seqs + 1]: cumulative query lengths
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads]
) -> torch.Tensor:
    """``paged_attention`` in one vectorized call: every sequence padded to the longest query and context."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size = key_cache.shape[1]
    num_kv_heads = key_cache.shape[2]
    device = query.device

    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_seqs]
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)  # [num_tokens]
    index_in_seq = torch.arange(num_tokens, device=device) - query_start_loc[seq_of_token]  # [num_tokens]

    padded_query = query.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    padded_query[seq_of_token, index_in_seq] = query

    num_ctx_blocks = (max_seq_len + block_size - 1) // block_size
    ctx_len = num_ctx_blocks * block_size
    tables = block_tables[:, :num_ctx_blocks].long()  # [num_seqs, num_ctx_blocks]
    keys = key_cache[tables].reshape(num_seqs, ctx_len, num_kv_heads, head_dim)
    values = value_cache[tables].reshape(num_seqs, ctx_len, num_kv_heads, head_dim)
    if num_kv_heads != num_heads:  # GQA: each KV head serves a contiguous run of query heads
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=2)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=2)

    scores = torch.einsum("sqhd,slhd->shql", padded_query.float(), keys.float()) * scale  # [S, H, Q, L]

    query_pos = (seq_lens - query_lens).unsqueeze(1) + torch.arange(max_query_len, device=device)  # [S, Q]
    key_pos = torch.arange(ctx_len, device=device)  # [L]
    if alibi_slopes is not None:
        distance = (key_pos.view(1, 1, -1) - query_pos.unsqueeze(-1)).float()  # [S, Q, L]
        scores = scores + alibi_slopes.float().view(1, -1, 1, 1) * distance.unsqueeze(1)
    visible = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)  # [S, Q, L]
    if sliding_window is not None:
        visible &= key_pos.view(1, 1, -1) > (query_pos.unsqueeze(-1) - sliding_window)
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Padding query rows see nothing and softmax to NaN; they are dropped below.
    out = torch.einsum("shql,slhd->sqhd", probs, values.float())  # [S, Q, H, D]
    return out[seq_of_token, index_in_seq].to(query.dtype)
