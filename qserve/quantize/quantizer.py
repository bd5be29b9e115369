"""Group quantization primitives shared by RTN, GPTQ and AWQ, and the result they all produce.

Knows: how to pick per-group scales and zero points (the GPTQ convention, formats.md §2.3, and
the AutoAWQ convention, §3.1), how to round weights to unsigned codes and back, and the
``QuantizedLinear`` record (codes in the layer's original input order, fp16 scales, true
zeros, ``g_idx``). Must not know: checkpoint formats (``writers`` turns a ``QuantizedLinear``
into GPTQ or AWQ tensors), models or calibration.

Orientation: quantizers work on torch's ``weight [N, K]`` (out_features, in_features);
``QuantizedLinear`` stores codes as ``[K, N]`` like the on-disk formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_BITS = {"gptq": (4, 8), "rtn": (4, 8), "awq": (4,)}
_MIN_SCALE = 1e-6  # keeps scales positive after rounding to fp16


@dataclass
class QuantizedLinear:
    """One quantized Linear, format-neutral (see the module docstring)."""

    bits: int
    group_size: int  # as configured: -1 = one group over all of K
    sym: bool
    codes: torch.Tensor  # uint8 [K, N], unsigned codes, rows in original input order
    scales: torch.Tensor  # fp16 [num_groups, N]
    zeros: torch.Tensor  # uint8 [num_groups, N], true zero points (2**(bits-1) when sym)
    g_idx: torch.Tensor  # int32 [K], group of each original input row
    bias: torch.Tensor | None = None  # [N]

    @property
    def in_features(self) -> int:
        return self.codes.shape[0]

    @property
    def out_features(self) -> int:
        return self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 ``[K, N]``: ``scales[g_idx[k], n] * (codes[k, n] - zeros[g_idx[k], n])``."""
        g_idx = self.g_idx.long()
        codes = self.codes.to(torch.int32) - self.zeros.to(torch.int32)[g_idx]  # [K, N]
        return codes.to(torch.float32) * self.scales.to(torch.float32)[g_idx]

    def weight(self) -> torch.Tensor:
        """float32 torch-orientation weight ``[N, K]``."""
        return self.dequantize().t().contiguous()


def effective_group_size(group_size: int, in_features: int) -> int:
    return in_features if group_size == -1 else group_size


def check_settings(method: str, bits: int, group_size: int) -> None:
    supported = SUPPORTED_BITS[method]
    if bits not in supported:
        raise ValueError(f"--bits {bits} is not supported by {method}; supported: {', '.join(map(str, supported))}")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"--group-size {group_size} is not valid; use a positive size (e.g. 128) or -1 (per-channel)")


def gptq_qparams(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and zero for ``w: [N, C]`` (one group per row), GPTQ convention.

    The range always includes 0; sym uses zero ``2**(bits-1)``. ``min_zero=1`` keeps asymmetric
    zeros >= 1 so the GPTQ v1 "zero - 1" encoding never underflows (formats.md §2.4). Scales are
    rounded to fp16 here, so everything downstream quantizes against the stored values.
    Returns (scale float32 [N], zero float32 [N]).
    """
    maxq = (1 << bits) - 1
    w = w.float()
    xmin = w.amin(dim=1).clamp(max=0)  # [N]
    xmax = w.amax(dim=1).clamp(min=0)  # [N]
    if sym:
        xmax = torch.maximum(xmax, xmin.abs())
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -torch.ones_like(xmin), xmin)
    xmax = torch.where(empty, torch.ones_like(xmax), xmax)
    scale = ((xmax - xmin) / maxq).clamp(min=_MIN_SCALE)
    if sym:
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        zero = torch.round(-xmin / scale).clamp(0, maxq)
        low = zero < min_zero
        if bool(low.any()):
            # All weights >= 0 here: spend min_zero codes below zero, the rest on [0, xmax].
            scale = torch.where(low, (xmax / (maxq - min_zero)).clamp(min=_MIN_SCALE), scale)
            zero = torch.where(low, torch.full_like(zero, float(min_zero)), zero)
    return _fp16_scale(scale), zero


def awq_qparams(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and zero for ``w: [N, C]``, AutoAWQ ``pseudo_quantize_tensor`` convention
    (asymmetric, range ``[min, max]`` not forced to include 0). Returns float32 ([N], [N])."""
    maxq = (1 << bits) - 1
    w = w.float()
    xmax, xmin = w.amax(dim=1), w.amin(dim=1)
    scale = _fp16_scale((xmax - xmin).clamp(min=1e-5) / maxq)
    zero = torch.round(-xmin / scale).clamp(0, maxq)
    return scale, zero


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.clamp(min=_MIN_SCALE).half().float().clamp(min=2.0**-24)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``clamp(round(w / scale) + zero, 0, maxq)`` for ``w: [N, C]``, scale/zero ``[N]`` or ``[N, 1]``."""
    scale, zero = scale.reshape(-1, 1), zero.reshape(-1, 1)
    return (torch.round(w.float() / scale) + zero).clamp(0, (1 << bits) - 1)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale.reshape(-1, 1) * (codes - zero.reshape(-1, 1))


def quantize_rtn(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    *,
    style: str = "gptq",
    min_zero: int = 0,
    bias: torch.Tensor | None = None,
) -> QuantizedLinear:
    """Round-to-nearest group quantization of ``weight: [N, K]`` (``style``: "gptq" or "awq" qparams)."""
    num_out, num_in = weight.shape
    group = effective_group_size(group_size, num_in)
    num_groups = math.ceil(num_in / group)
    codes = torch.empty(num_out, num_in, dtype=torch.uint8, device=weight.device)  # [N, K]
    scales = torch.empty(num_groups, num_out, dtype=torch.float32, device=weight.device)  # [ng, N]
    zeros = torch.empty(num_groups, num_out, dtype=torch.float32, device=weight.device)  # [ng, N]
    for g in range(num_groups):
        cols = weight[:, g * group : (g + 1) * group].float()  # [N, G]
        if style == "awq":
            scale, zero = awq_qparams(cols, bits)
        else:
            scale, zero = gptq_qparams(cols, bits, sym, min_zero)
        codes[:, g * group : (g + 1) * group] = quantize_codes(cols, scale, zero, bits).to(torch.uint8)
        scales[g], zeros[g] = scale, zero
    g_idx = (torch.arange(num_in, device=weight.device) // group).to(torch.int32)  # [K]
    return QuantizedLinear(
        bits=bits,
        group_size=group_size,
        sym=sym,
        codes=codes.t().contiguous(),
        scales=scales.half(),
        zeros=zeros.to(torch.uint8),
        g_idx=g_idx,
        bias=bias,
    )


def pseudo_quantize(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """AWQ-style asymmetric fake quantization of ``weight: [N, K]`` (same shape and dtype back)."""
    num_out, num_in = weight.shape
    group = effective_group_size(group_size, num_in)
    if num_in % group == 0:
        w = weight.float().reshape(-1, group)  # [N * K/G, G]
        scale, zero = awq_qparams(w, bits)
        deq = dequantize_codes(quantize_codes(w, scale, zero, bits), scale, zero)
        return deq.reshape(num_out, num_in).to(weight.dtype)
    out = torch.empty_like(weight)
    for start in range(0, num_in, group):
        w = weight[:, start : start + group].float()
        scale, zero = awq_qparams(w, bits)
        out[:, start : start + group] = dequantize_codes(quantize_codes(w, scale, zero, bits), scale, zero).to(
            weight.dtype
        )
    return out
