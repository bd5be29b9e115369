"""Rotary position embeddings (NeoX "rotate half" layout) with default, linear and llama3 scaling.

Knows: the inverse-frequency schedules and how to rotate query/key heads by position, plus the
declared variants of other families: partial rotary (only the first ``rotary_dim`` dims of each
head rotate), interleaved pairs (ChatGLM / GLM rotate (2i, 2i+1); q and k are permuted alike so
the NeoX op serves them, which leaves every q.k unchanged: the decoder permutes the q/k projection
rows once at load, or, for a caller that cannot, this module gathers them per step), Qwen v1's
dynamic NTK (one table per base scale alpha = 1, 3, 7, ...; each token picks its sequence's table
through an index tensor, so CUDA graphs replay mixed-alpha batches) and logn query scaling.
Must not know: attention, cache layouts or requests. The cos/sin table is built once for every position
the model may see; the per-step work (gather and rotation of query and key) is one fused op in
``quant_kernels.elementwise_ops``.

A caller may hand ``forward`` the per-head RMSNorm that precedes the rotation (Qwen3's q/k norms,
``qk_norm=(q_weight, k_weight, eps)``): where the rotation is the plain NeoX one over whole heads
(full rotary_dim, no per-step permutation, no logn), norms and rotation are one op
(``elementwise_ops.qk_norm_rotary_embedding``, one launch on CUDA instead of three: a launch-bound
decode step saves two a layer); otherwise the norms run first as separate ops, with the same
results. The decoder passes it unless ``QSERVE_FUSED_QK_NORM_ROPE=0`` (measured faster on the H100).

Where ``stores_kv`` (that same plain rotation), a caller may also hand it where the keys go
(``kv_store``, a ``quant_kernels.kv_store.KVStore``: values, model-dtype paged caches, slots): the op
then writes the rotated keys and the values there too, in the same launch on CUDA (the decoder does
unless ``QSERVE_FUSED_ROPE_KV_STORE=0``: one launch fewer a layer).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from qserve.config import RopeConfig
from qserve.runner.ntk_index import ntk_alpha_index
from quant_kernels import elementwise_ops
from quant_kernels.kv_store import KVStore


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def num_ntk_tables(max_positions: int, seq_length: int) -> int:
    return ntk_alpha_index(max_positions, seq_length) + 1


def interleaved_permutation(rotary_dim: int, head_dim: int) -> torch.Tensor:
    """int64 [head_dim]: the order that turns interleaved pairs (2i, 2i+1) into NeoX halves
    (i, i + rotary_dim / 2); dims past ``rotary_dim`` stay put. Applied alike to q and k it
    leaves every q.k unchanged, so the NeoX rotation serves interleaved families."""
    rot = rotary_dim
    cpu = {"device": "cpu"}  # a host constant whatever device context the model is built under
    return torch.cat(
        [torch.arange(0, rot, 2, **cpu), torch.arange(1, rot, 2, **cpu), torch.arange(rot, head_dim, **cpu)]
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        *,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        num_ntk_tables: int = 1,
        logn_seq_length: int | None = None,
        permute_inputs: bool = True,
    ) -> None:
        """``permute_inputs=False``: the caller has already laid query and key out in the NeoX
        order (the decoder permutes the q/k projection rows once at load, see
        ``interleaved_permutation``), so an interleaved rotary gathers nothing per step."""
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rot = rotary_dim or head_dim
        self.max_positions = max_positions
        self.num_ntk_tables = num_ntk_tables
        self.interleaved = interleaved
        positions = torch.arange(max_positions, dtype=torch.float32)
        tables = []
        for k in range(num_ntk_tables):  # alpha = 2^(k+1) - 1; base' = base * alpha^(d / (d - 2))
            alpha = 2 ** (k + 1) - 1
            scaled = rope if alpha == 1 else replace(rope, theta=rope.theta * alpha ** (rot / (rot - 2)))
            tables.append(torch.outer(positions, inverse_frequencies(scaled, rot)))  # [max_positions, rot / 2]
        freqs = torch.cat(tables)  # [num_ntk_tables * max_positions, rot / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        if interleaved and permute_inputs:
            self.register_buffer("perm", interleaved_permutation(rot, head_dim), persistent=False)  # [head_dim]
        else:
            self.perm = None
        if logn_seq_length is not None:  # max(1, log_S(p + 1)), applied to the query after rotation
            logn = (torch.log(positions + 1) / math.log(logn_seq_length)).clamp(min=1.0)
            self.register_buffer("logn", logn, persistent=False)  # [max_positions]
        else:
            self.logn = None

    @property
    def stores_kv(self) -> bool:
        """Whether ``forward`` takes a ``kv_store``: the rotation is one op over whole heads (no partial
        rotary, interleave permutation or log-n scaling after it)."""
        return self.rotary_dim == self.head_dim and self.perm is None and self.logn is None

    def forward(
        self,
        positions: torch.Tensor,  # int64 [T]
        query: torch.Tensor,  # [T, num_heads, head_dim] or [B, T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim] or [B, T, num_kv_heads, head_dim]
        ntk_tables: torch.Tensor | None = None,  # int64 [T]: each token's NTK table (None: table 0)
        *,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q_weight [head_dim], k_weight, eps)
        kv_store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Query and key rotated by position; with ``qk_norm``, each head of query and key is first
        RMS-normalised over its ``head_dim`` (in checkpoint order, before any interleave permutation).
        With ``kv_store`` (only where ``stores_kv``) the rotated keys and the store's values also go to
        its paged cache, in the rotary's launch on CUDA."""
        if kv_store is not None and (not self.stores_kv or query.dim() != 3):
            raise ValueError("kv_store: only a whole-head NeoX rotary without permutation or log-n scaling")
        if query.dim() == 4:  # a batch of windows sharing positions (the quantizer's calibration)
            batch = query.shape[0]
            q, k = self.forward(positions.repeat(batch), query.flatten(0, 1), key.flatten(0, 1), qk_norm=qk_norm)
            return q.view(query.shape), k.view(key.shape)
        rows = positions if ntk_tables is None else positions + ntk_tables * self.max_positions
        rot = self.rotary_dim
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            if self.stores_kv:  # one op: norms and rotation (whole heads, nothing after it)
                return elementwise_ops.qk_norm_rotary_embedding(
                    rows, query, key, q_weight, k_weight, eps, self.cos, self.sin, kv_store
                )
            query, key = elementwise_ops.rms_norm(query, q_weight, eps), elementwise_ops.rms_norm(key, k_weight, eps)
        if self.perm is not None:
            query, key = query.index_select(-1, self.perm), key.index_select(-1, self.perm)
        if rot == self.head_dim:  # with a kv_store (stores_kv) this is the last op
            query, key = elementwise_ops.rotary_embedding(rows, query, key, self.cos, self.sin, kv_store)
        else:
            q_rot, k_rot = elementwise_ops.rotary_embedding(
                rows, query[..., :rot].contiguous(), key[..., :rot].contiguous(), self.cos, self.sin
            )
            query = torch.cat([q_rot, query[..., rot:]], dim=-1)
            key = torch.cat([k_rot, key[..., rot:]], dim=-1)
        if self.logn is not None:
            query = query * self.logn[positions].to(query.dtype)[:, None, None]
        return query, key
