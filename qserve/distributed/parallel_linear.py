"""Tensor-parallel layers: column- and row-parallel linears (dense or 4/8-bit, through the
layer's ``LinearMethod``), the vocabulary-parallel embedding and LM head.

Knows: which slice of each checkpoint tensor the rank keeps (``sharding``) and which collective
each layer needs — none after a column-parallel linear (its output stays split, e.g. by heads),
an all-reduce after a row-parallel one, an all-reduce after the masked embedding lookup and an
all-gather of the logits. Must not know: checkpoint formats, the engine, how kernels compute.

LoRA (vLLM's scheme): a column-parallel layer keeps an adapter's A whole and its rows of B, cut
per output slice like the base weight (``shard_lora``), so ``Linear.forward`` adds it with no
communication; a row-parallel layer keeps A's columns of its input slice and B whole, all-reduces
the small partial ``h = x_r A_r^T`` and adds the expand once (``RowParallelLinear._add_lora``).

The factories (``column_linear``, ``row_linear``, ``vocab_embedding``, ``lm_head_linear``) return
the plain single-process module when ``tp`` is None, so a model built without a group is
exactly what it was before tensor parallelism existed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from qserve.distributed.parallel_state import TPGroup
from qserve.distributed.sharding import column_shard, row_shard, split_evenly, vocab_shard
from qserve.layers.linear import Linear, LinearMethod
from quant_kernels import lora_ops
from quant_kernels.layout import PackedQuantWeight
from quant_kernels.lora_ops import LoRAIndices


class ColumnParallelLinear(Linear):
    """Output shards split along N: the rank holds ``shard_slices[i] = (start, size)`` of full
    output shard ``i`` and computes ``[num_tokens, sum(sizes)]`` with no communication."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],  # full (unsplit) size of each output shard
        *,
        shard_slices: list[tuple[int, int]],
        bias: bool,
        params_dtype: torch.dtype,
        method: LinearMethod,
        prefix: str,
        tp: TPGroup,
    ) -> None:
        if len(shard_slices) != len(output_sizes):
            raise ValueError(f"{prefix}: {len(shard_slices)} shard slices for {len(output_sizes)} output shards")
        super().__init__(
            in_features,
            [size for _, size in shard_slices],
            bias=bias,
            params_dtype=params_dtype,
            method=method,
            prefix=prefix,
        )
        self.full_output_sizes = list(output_sizes)
        self.shard_slices = list(shard_slices)
        self.tp = tp

    def load_weight(self, shard_id: int, weight: torch.Tensor | PackedQuantWeight) -> None:
        start, size = self.shard_slices[shard_id]
        full = self.full_output_sizes[shard_id]
        super().load_weight(shard_id, column_shard(weight, start, size, full, f"{self.prefix} shard {shard_id}"))

    def load_bias(self, shard_id: int, bias: torch.Tensor) -> None:
        start, size = self.shard_slices[shard_id]
        if tuple(bias.shape) != (self.full_output_sizes[shard_id],):
            raise ValueError(
                f"{self.prefix} shard {shard_id}: bias shape {tuple(bias.shape)}, "
                f"expected ({self.full_output_sizes[shard_id]},)"
            )
        super().load_bias(shard_id, bias[start : start + size])

    def lora_full_sizes(self) -> tuple[int, list[int]]:
        return self.in_features, list(self.full_output_sizes)

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A replicated (it reads the full input); B's rows cut per output slice exactly as the base
        weight's columns (q / k / v by heads, a replicated KV head included; gate / up by rows)."""
        rows, full_start = [], 0
        for (start, size), full in zip(self.shard_slices, self.full_output_sizes):
            rows.append(b[full_start + start : full_start + start + size])  # [N_s / tp, R]
            full_start += full
        if full_start != b.shape[0]:
            raise ValueError(f"{self.prefix}: LoRA B has {b.shape[0]} rows, the layer {full_start} outputs")
        return a, torch.cat(rows).contiguous()  # [S * R, K], [N / tp, R]


class RowParallelLinear(Linear):
    """Input split along K: the rank multiplies its ``[num_tokens, K/tp]`` slice of the input by
    its rows of W, the partial products are all-reduced, then the (full) bias is added once.

    An act-order shard (``sharding.row_shard_act_order``: padded groups, perm into the local
    input) is stored split in two: ``input_index`` (its perm, int64 ``[K_pad]``) gathers the
    input once per call, and the method holds the weight without perm — a plain grouped
    ``PackedQuantWeight`` of ``weight_in_features = K_pad`` rows, which the reference op and the
    Triton kernels serve as they are (the padding's repeated input index never reaches them).

    ``reduce_results=False`` (vLLM's name) returns the rank's partial product instead, for a
    caller that all-reduces a sum of such partials once (a MoE block's shared expert and routed
    experts); a bias is then added on rank 0 only, so the sum holds it once.
    """

    def __init__(
        self,
        in_features: int,  # full (unsplit) K
        output_sizes: list[int],
        *,
        bias: bool,
        params_dtype: torch.dtype,
        method: LinearMethod,
        prefix: str,
        tp: TPGroup,
        reduce_results: bool = True,
    ) -> None:
        k_local = split_evenly(in_features, tp.size, f"{prefix}: input size K")
        super().__init__(k_local, output_sizes, bias=bias, params_dtype=params_dtype, method=method, prefix=prefix)
        self.full_in_features = in_features
        self.tp = tp
        self.reduce_results = reduce_results
        self.weight_in_features = k_local  # rows the method's weight has (K_pad for act-order)
        self.register_buffer("input_index", None, persistent=False)  # int64 [K_pad] act-order only

    def load_weight(self, shard_id: int, weight: torch.Tensor | PackedQuantWeight) -> None:
        shard = row_shard(weight, self.tp.rank, self.tp.size, self.full_in_features, self.prefix)
        if isinstance(shard, PackedQuantWeight) and shard.perm is not None:
            self.input_index = shard.perm  # int64 [K_pad], values in [0, K/tp)
            self.weight_in_features = shard.in_features
            shard = dataclasses.replace(shard, perm=None)
        super().load_weight(shard_id, shard)

    def lora_full_sizes(self) -> tuple[int, list[int]]:
        return self.full_in_features, list(self.output_sizes)

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A's columns cut along K like the base weight's rows (the rank's input slice, in the
        input's own order: an act-order weight's perm applies to the base product only); B whole."""
        k_local = split_evenly(self.full_in_features, self.tp.size, f"{self.prefix}: LoRA A input size K")
        lo = self.tp.rank * k_local
        return a[:, lo : lo + k_local].contiguous(), b  # [S * R, K / tp], [N, R]

    def forward(
        self, x: torch.Tensor, lora: LoRAIndices | None = None
    ) -> torch.Tensor:  # [num_tokens, K/tp] -> [num_tokens, N]
        x_local = x  # [num_tokens, K/tp]: what LoRA's A (cut along K) multiplies
        if self.input_index is not None:
            x = x.index_select(-1, self.input_index)  # [num_tokens, K_pad]
        out = self.method.apply(self, x)  # [num_tokens, N]: this rank's partial product
        if lora is not None and self.lora is not None:
            out = self._add_lora(out, x_local, lora)
        if self.reduce_results:
            out = self.tp.all_reduce(out.contiguous())
        if self.bias is not None and (self.reduce_results or self.tp.is_driver):
            out = out + self.bias
        return out

    def _add_lora(self, out: torch.Tensor, x_local: torch.Tensor, lora: LoRAIndices) -> torch.Tensor:
        """Row-parallel LoRA: each rank shrinks its input slice by its columns of A (a partial
        ``h``), the partial ``h`` are all-reduced (``[T, S * R]``: a few KB, against the
        ``[T, N]`` output), then B expands the full ``h``.

        The delta is added on rank 0 only, into its partial product, BEFORE the output's
        all-reduce: the sum then holds it exactly once, and it costs one expand in the group
        instead of one per rank (adding it after the all-reduce would need every rank to expand,
        or the ranks' outputs would differ). It also stays right with ``reduce_results=False``,
        where the caller sums the partials later (as the bias, on rank 0 only).
        Every rank takes the same branch (the step's indices are the same everywhere), so the
        extra all-reduce lines up."""
        w = self.lora
        num_slices = len(w.slice_starts) - 1
        # Rows without a slot are left unwritten by the shrink and never read by the expand;
        # summing them is harmless.
        h = lora_ops.lora_shrink(x_local, w.a, num_slices, lora)  # [T, S * R]: this rank's partial
        h = self.tp.all_reduce(h.contiguous())
        if self.tp.is_driver:
            out = lora_ops.lora_expand(out, h, w.b, w.slice_starts, lora)
        return out


def gather_vocab(logits: torch.Tensor, tp: TPGroup, vocab_size: int, chunk: int) -> torch.Tensor:
    """Per-rank logits ``[R, rows held]`` -> full ``[R, vocab_size]`` (padded to ``chunk``, gathered, trimmed)."""
    if logits.shape[-1] < chunk:
        logits = F.pad(logits, (0, chunk - logits.shape[-1]))  # [R, chunk]
    return tp.all_gather(logits, dim=-1)[:, :vocab_size]  # [R, vocab]


class VocabParallelEmbedding(nn.Module):
    """The rank holds ids ``[start, start + rows)`` (table padded to ``chunk`` rows with zeros);
    a lookup zeroes ids it does not own and all-reduces, so every rank gets the full embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.start, self.rows, self.chunk = vocab_shard(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.zeros(self.chunk, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load_full_weight  # used by LlamaFamilyForCausalLM.load_weights

    def load_full_weight(self, weight: torch.Tensor) -> None:  # [vocab, hidden]
        if tuple(weight.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(
                f"embedding: checkpoint shape {tuple(weight.shape)}, expected ({self.vocab_size}, {self.weight.shape[1]})"
            )
        self.weight.data[: self.rows].copy_(weight[self.start : self.start + self.rows])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # int64 [num_tokens] -> [num_tokens, hidden]
        local = input_ids - self.start
        owned = (local >= 0) & (local < self.rows)  # [num_tokens]
        hidden = F.embedding(torch.where(owned, local, 0), self.weight)  # [num_tokens, hidden]
        hidden = torch.where(owned.unsqueeze(-1), hidden, 0).contiguous()
        return self.tp.all_reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] (tied LM head)
        return gather_vocab(F.linear(hidden, self.weight[: self.rows]), self.tp, self.vocab_size, self.chunk)


class ParallelLMHead(ColumnParallelLinear):
    """Column-parallel over the vocabulary, all-gathering the logits: every rank gets ``[R, vocab]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab]
        vocab = self.full_output_sizes[0]
        _, _, chunk = vocab_shard(vocab, self.tp.rank, self.tp.size)
        return gather_vocab(super().forward(x), self.tp, vocab, chunk)


# ----------------------------------------------------------------------------------------------
# Factories: plain modules without a group
# ----------------------------------------------------------------------------------------------


def column_linear(
    in_features: int,
    output_sizes: list[int],
    *,
    tp: TPGroup | None,
    shard_slices: list[tuple[int, int]] | None = None,
    **kwargs,
) -> Linear:
    """A ``Linear`` (``tp`` None) or a ``ColumnParallelLinear``; ``shard_slices`` default to even splits."""
    if tp is None:
        return Linear(in_features, output_sizes, **kwargs)
    if shard_slices is None:
        prefix = kwargs.get("prefix", "linear")
        sizes = [split_evenly(n, tp.size, f"{prefix}: output size N") for n in output_sizes]
        shard_slices = [(tp.rank * size, size) for size in sizes]
    return ColumnParallelLinear(in_features, output_sizes, shard_slices=shard_slices, tp=tp, **kwargs)


def row_linear(
    in_features: int, output_sizes: list[int], *, tp: TPGroup | None, reduce_results: bool = True, **kwargs
) -> Linear:
    """A ``Linear`` (``tp`` None) or a ``RowParallelLinear`` (``reduce_results``: see there)."""
    if tp is None:
        return Linear(in_features, output_sizes, **kwargs)
    return RowParallelLinear(in_features, output_sizes, tp=tp, reduce_results=reduce_results, **kwargs)


def vocab_embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TPGroup | None) -> nn.Module:
    if tp is None:
        embedding = nn.Embedding(vocab_size, hidden_size, dtype=dtype)
        embedding.weight.requires_grad_(False)
        return embedding
    return VocabParallelEmbedding(vocab_size, hidden_size, dtype, tp)


def lm_head_linear(hidden_size: int, vocab_size: int, *, tp: TPGroup | None, **kwargs) -> Linear:
    if tp is None:
        return Linear(hidden_size, [vocab_size], **kwargs)
    start, rows, _ = vocab_shard(vocab_size, tp.rank, tp.size)
    return ParallelLMHead(hidden_size, [vocab_size], shard_slices=[(start, rows)], tp=tp, **kwargs)
