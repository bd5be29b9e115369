"""GPTQ: second-order (Hessian-aware) post-training quantization of Linear weights.

Knows: the GPTQ algorithm (Frantar et al. 2022, as in AutoGPTQ ``fasterquant``): the layer
Hessian ``H = 2 X Xᵀ / n`` of the calibration inputs, dampening by ``damp_percent`` of its mean
diagonal, the upper Cholesky factor of ``H⁻¹``, column-by-column rounding with error feedback in
lazy blocks of ``block_size`` columns, group-wise scales/zeros chosen as columns are reached,
act-order (``desc_act``: columns by descending ``diag(H)``, ``g_idx`` = group of each original
row, formats.md §2.5), and the true-sequential order inside one decoder layer (q/k/v, then o, then
gate/up, then down, each on inputs produced by the already-quantized sub-layers). Must not know:
checkpoint files or formats, tokenizers, the serving engine.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from qserve.quantize.layer import DenseDecoderLayer
from qserve.quantize.quantizer import QuantizedLinear, effective_group_size, gptq_qparams, quantize_codes

logger = logging.getLogger(__name__)

# Sub-layers quantized together (they share one input), in true-sequential order.
SEQUENTIAL_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)


@dataclass(frozen=True, slots=True)
class GPTQSettings:
    bits: int = 4
    group_size: int = 128  # -1 = per-channel
    sym: bool = True
    desc_act: bool = False
    damp_percent: float = 0.01
    block_size: int = 128
    min_zero: int = 1  # asym zeros >= 1: GPTQ v1 stores zero - 1 (formats.md §2.4)


class HessianAccumulator:
    """Running ``H = 2/n · Σ x xᵀ`` over the n calibration tokens seen so far."""

    def __init__(self, size: int, device: torch.device | str) -> None:
        self.hessian = torch.zeros(size, size, dtype=torch.float32, device=device)  # [K, K]
        self.num_tokens = 0

    def add(self, inputs: torch.Tensor) -> None:
        x = inputs.reshape(-1, inputs.shape[-1]).float()  # [n, K]
        n = x.shape[0]
        if n == 0:
            return
        self.hessian *= self.num_tokens / (self.num_tokens + n)
        self.num_tokens += n
        x = x * math.sqrt(2.0 / self.num_tokens)
        self.hessian.addmm_(x.t(), x)


def _inverse_cholesky(hessian: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)⁻¹``; λ grows if H is not positive definite."""
    diag_mean = torch.mean(torch.diag(hessian))
    damp = damp_percent
    for _ in range(8):
        h = hessian.clone()
        h.diagonal().add_(damp * diag_mean)
        try:
            lower = torch.linalg.cholesky(h)
            inverse = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(inverse, upper=True)
        except torch.linalg.LinAlgError:
            logger.warning("GPTQ: Hessian not positive definite with damp %.4f; increasing", damp)
            damp = damp * 2 if damp > 0 else 0.01
    raise ValueError("GPTQ: the Hessian stays singular even with heavy dampening; check the calibration data")


@torch.no_grad()
def gptq_quantize_weight(
    weight: torch.Tensor,  # [N, K] (torch Linear orientation)
    hessian: torch.Tensor,  # [K, K]
    settings: GPTQSettings,
    bias: torch.Tensor | None = None,
) -> QuantizedLinear:
    """Quantize one Linear weight with GPTQ; returns codes in the original input-row order."""
    bits, sym = settings.bits, settings.sym
    W = weight.detach().float().clone()  # [N, K]
    H = hessian.detach().float().clone()  # [K, K]
    num_out, num_in = W.shape
    group = effective_group_size(settings.group_size, num_in)
    num_groups = math.ceil(num_in / group)

    dead = torch.diag(H) == 0  # inputs never active: weight irrelevant
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = None
    if settings.desc_act:
        perm = torch.argsort(torch.diag(H), descending=True)  # [K]
        W, H = W[:, perm], H[perm][:, perm]
    Hinv = _inverse_cholesky(H, settings.damp_percent)  # [K, K] upper
    del H

    codes = torch.zeros(num_out, num_in, dtype=torch.uint8, device=W.device)  # [N, K], permuted order
    scales = torch.zeros(num_groups, num_out, dtype=torch.float32, device=W.device)  # [ng, N]
    zeros = torch.zeros(num_groups, num_out, dtype=torch.float32, device=W.device)  # [ng, N]
    scale = zero = None
    for i1 in range(0, num_in, settings.block_size):
        i2 = min(i1 + settings.block_size, num_in)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()  # [N, count]
        Err1 = torch.zeros_like(W1)  # [N, count]
        Hinv1 = Hinv[i1:i2, i1:i2]  # [count, count]
        for i in range(count):
            col = i1 + i
            if col % group == 0:
                # Group parameters from the columns as updated so far (this block's in W1).
                end = col + group
                cols = W1[:, i : min(count, end - i1)]
                if end > i2:
                    cols = torch.cat([cols, W[:, i2:end]], dim=1)
                scale, zero = gptq_qparams(cols, bits, sym, settings.min_zero)  # [N], [N]
                scales[col // group], zeros[col // group] = scale, zero
            w = W1[:, i]  # [N]
            q = quantize_codes(w.unsqueeze(1), scale, zero, bits).squeeze(1)  # [N]
            codes[:, col] = q.to(torch.uint8)
            err = (w - scale * (q - zero)) / Hinv1[i, i]  # [N]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    g_idx = torch.arange(num_in, device=W.device) // group  # [K], group of permuted column j
    if perm is not None:
        invperm = torch.argsort(perm)
        codes = codes[:, invperm]
        g_idx = g_idx[invperm]  # group of each ORIGINAL input row
    return QuantizedLinear(
        bits=bits,
        group_size=settings.group_size,
        sym=sym,
        codes=codes.t().contiguous(),
        scales=scales.half(),
        zeros=zeros.to(torch.uint8),
        g_idx=g_idx.to(torch.int32),
        bias=None if bias is None else bias.detach().clone(),
    )


@torch.no_grad()
def quantize_layer_gptq(
    layer: DenseDecoderLayer, hidden: torch.Tensor, settings: GPTQSettings, batch_size: int
) -> dict[str, QuantizedLinear]:
    """True-sequential GPTQ of one decoder layer on its calibration inputs ``hidden: [S, T, hidden]``.

    Each group's Hessian is collected on inputs that already pass through the quantized earlier
    sub-layers; the layer's weights are replaced by their dequantized values as it goes.
    """
    results: dict[str, QuantizedLinear] = {}
    for names in SEQUENTIAL_GROUPS:
        first = layer.linear(names[0])
        acc = HessianAccumulator(first.in_features, first.weight.device)
        layer.feed_input_of(names[0], hidden, batch_size, acc.add)
        for name in names:
            linear = layer.linear(name)
            result = gptq_quantize_weight(linear.weight, acc.hessian, settings, linear.bias)
            linear.weight.copy_(result.weight().to(linear.weight.dtype))
            results[name] = result
        del acc
    return results
