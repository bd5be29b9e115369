"""A dense, batch-of-sequences decoder layer for calibration: the quantizers' view of one layer.

Knows: the Llama-family decoder layer (Llama, Mistral, Qwen2 q/k/v bias, Qwen3 q/k norm) as
plain ``nn.Linear`` modules with HF names, run over ``[batch, seq, hidden]`` calibration windows
with causal attention (no KV cache, no paging), and how to stop a forward pass as soon as one
Linear's input has been seen. Must not know: quantization algorithms, checkpoint formats or the
serving engine (whose paged layers are built for token-flattened batches, not calibration).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qserve.config import ModelConfig
from qserve.layers.rotary import RotaryEmbedding
from quant_kernels import elementwise_ops

# Short name -> HF name relative to "model.layers.{i}.", in the order a forward pass meets them.
LINEARS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(weight, requires_grad=False)  # [size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        return elementwise_ops.rms_norm(x, self.weight, self.eps)


class _StopForward(Exception):
    """Raised by a capture hook once the wanted input has been seen."""


class DenseDecoderLayer(nn.Module):
    """One decoder layer built from its checkpoint tensors (HF names relative to the layer)."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        rotary: RotaryEmbedding,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        linear_names: dict[str, str] | None = None,
        plain: tuple[str, ...] = (),
    ) -> None:
        """``linear_names``: short -> HF name of the layer's Linears (default ``LINEARS``; a
        mixture-of-experts layer lists its experts); ``plain``: other tensors it keeps as they
        are (a router), returned by ``fp_tensors``."""
        super().__init__()
        self.config = config
        self.rotary = rotary
        self.linear_names = dict(LINEARS if linear_names is None else linear_names)
        self.linears = nn.ModuleDict()
        for short, hf in self.linear_names.items():
            weight = tensors[f"{hf}.weight"]  # [N, K]
            bias = tensors.get(f"{hf}.bias")  # [N] or None
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            linear.weight = nn.Parameter(weight.to(device=device, dtype=dtype, copy=True), requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype, copy=True), requires_grad=False)
            self.linears[short] = linear
        self.norms = nn.ModuleDict()
        for hf in NORMS:
            if f"{hf}.weight" in tensors:
                weight = tensors[f"{hf}.weight"].to(device=device, dtype=dtype, copy=True)
                self.norms[hf.replace(".", "__")] = RMSNorm(weight, config.rms_norm_eps)
        self.plain = {name: tensors[name].to(device=device, dtype=dtype, copy=True) for name in plain}
        known = {f"{hf}.{p}" for hf in self.linear_names.values() for p in ("weight", "bias")}
        known |= {f"{n}.weight" for n in NORMS} | set(plain)
        unknown = sorted(set(tensors) - known)
        if unknown:
            raise ValueError(f"decoder layer holds tensors the quantizer does not know: {unknown}")

    # -- parts ------------------------------------------------------------------------------
    def linear(self, short: str) -> nn.Linear:
        return self.linears[short]

    def norm(self, hf_name: str) -> RMSNorm | None:
        key = hf_name.replace(".", "__")
        return self.norms[key] if key in self.norms else None

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Self-attention of normed input ``x: [B, T, hidden]`` incl. ``o_proj`` -> ``[B, T, hidden]``."""
        cfg = self.config
        batch, seq, _ = x.shape
        q = self.linears["q_proj"](x).view(batch, seq, cfg.num_heads, cfg.head_dim)  # [B, T, h, d]
        k = self.linears["k_proj"](x).view(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, T, kvh, d]
        v = self.linears["v_proj"](x).view(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, T, kvh, d]
        q_norm, k_norm = self.norm("self_attn.q_norm"), self.norm("self_attn.k_norm")
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        positions = torch.arange(seq, device=x.device)  # [T]
        q, k = self.rotary(positions, q, k)
        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.transpose(1, 2)  # [B, h, T, d]
        k = k.transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, h, T, d]
        v = v.transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, h, T, d]
        window = cfg.sliding_window
        if window is not None and seq > window:
            idx = torch.arange(seq, device=x.device)
            diff = idx.view(-1, 1) - idx.view(1, -1)  # [T, T]
            mask = (diff >= 0) & (diff < window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(batch, seq, cfg.num_heads * cfg.head_dim)  # [B, T, h*d]
        return self.linears["o_proj"](out)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU MLP of normed input ``x: [B, T, hidden]`` -> ``[B, T, hidden]``."""
        act = F.silu(self.linears["gate_proj"](x)) * self.linears["up_proj"](x)  # [B, T, inter]
        return self.linears["down_proj"](act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, hidden] -> [B, T, hidden]
        h = x + self.attention(self.norm("input_layernorm")(x))
        return h + self.mlp(self.norm("post_attention_layernorm")(h))

    # -- batched helpers ----------------------------------------------------------------------
    @torch.no_grad()
    def run(self, hidden: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Forward every calibration window: ``[S, T, hidden]`` -> ``[S, T, hidden]``."""
        out = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], batch_size):
            out[start : start + batch_size] = self(hidden[start : start + batch_size])
        return out

    @torch.no_grad()
    def feed_input_of(
        self, short: str, hidden: torch.Tensor, batch_size: int, callback: Callable[[torch.Tensor], None]
    ) -> None:
        """Run the windows until ``short``'s input is known; ``callback([b, T, K])`` once per batch."""

        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            callback(args[0])
            raise _StopForward

        self._run_until_stop(self.linears[short].register_forward_pre_hook(hook), hidden, batch_size)

    @torch.no_grad()
    def capture_mlp_input(self, hidden: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The MLP's normed input (``post_attention_layernorm``'s output) of every window:
        ``[S, T, hidden]``; each batch's forward stops there."""
        parts: list[torch.Tensor] = []

        def hook(_module: nn.Module, _args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            parts.append(output.detach().clone())
            raise _StopForward

        self._run_until_stop(self.norm("post_attention_layernorm").register_forward_hook(hook), hidden, batch_size)
        return torch.cat(parts)  # [S, T, hidden]

    def _run_until_stop(self, handle: torch.utils.hooks.RemovableHandle, hidden: torch.Tensor, batch_size: int) -> None:
        """Forward each batch of windows until ``handle``'s hook raises ``_StopForward``; remove the hook."""
        try:
            for start in range(0, hidden.shape[0], batch_size):
                try:
                    self(hidden[start : start + batch_size])
                except _StopForward:
                    pass
        finally:
            handle.remove()

    def fp_tensors(self) -> dict[str, torch.Tensor]:
        """Unquantized tensors of the layer (norm weights), HF names relative to the layer."""
        norms = {f"{key.replace('__', '.')}.weight": norm.weight.detach() for key, norm in self.norms.items()}
        return {**norms, **self.plain}
