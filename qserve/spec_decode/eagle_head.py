"""An EAGLE / EAGLE-3 head: the small decoder that drafts from the target's hidden states, built from
the checkpoint vLLM loads (``EagleLlamaForCausalLM`` / ``Eagle3LlamaForCausalLM`` names and layout;
no remote code).

Knows: the head's layers and forward, its tensor names and how they route into its modules; how
its logits become target token ids. Must not know: requests, pages or scheduling (the proposer in
``qserve.spec_decode.eagle`` drives it with ``AttentionMetadata`` it builds).

EAGLE (Li et al. 2024), for a position p: ``x = fc(concat(embed(token[p + 1]), h[p]))`` with h the
target's final (normed) hidden state at p; the head's decoder layers follow (the first without its
input norm); the output (no final norm) is both the next input feature and, through the TARGET's
lm_head, the logits of the token at p + 2. Tensors: ``fc.weight [H, 2H]`` (``fc.bias`` if saved),
``layers.N.*`` as a Llama layer; ``embed_tokens`` / ``lm_head`` in the checkpoint are copies of the
target's and are not loaded (the target's are used, as vLLM does).

EAGLE-3 (Li et al. 2025): the target's input streams of three layers, concatenated, go through
``fc [H, 3 H_target]``; the first layer's attention reads ``concat(input_layernorm(embed(token)),
hidden_norm(h))`` (width 2H; the residual is h itself, or ``hidden_norm(h)`` with
``norm_before_residual``); after the layers ``norm`` gives the logits' input, the stream before it
is the next input feature. Its own ``lm_head [draft_vocab, H]`` scores a draft vocabulary; draft id
d is target id ``d + d2t[d]``. Tensors: ``fc.weight``, ``midlayer.*`` (or ``layers.0.*``) with
``hidden_norm``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 [draft_vocab]; absent: the
identity, when the vocabularies are equal); ``t2d`` is not needed; ``embed_tokens.weight`` is
used when present, the target's otherwise. A leading ``model.`` in a name is ignored.

Drafts are the argmax of the head's logits over ids the target's tokenizer knows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from loaders.safetensors_io import CheckpointFiles
from qserve.layers.held_bytes import held_weight_bytes
from qserve.layers.linear import DenseLinearMethod, Linear
from qserve.layers.norm import RMSNorm
from qserve.layers.quant_methods import tensor_nbytes
from qserve.layers.rotary import RotaryEmbedding
from qserve.model.llama import FUSED_SLICES, DecoderLayer
from qserve.runner.attn_metadata import AttentionMetadata
from qserve.spec_decode import draft_layers, draft_lm_head
from qserve.spec_decode.eagle_config import EagleHeadConfig

logger = logging.getLogger(__name__)

# Tensors a head checkpoint may hold that qserve does not need (EAGLE: copies of the target's).
_IGNORED = {"eagle": ("embed_tokens.weight", "lm_head.weight", "t2d"), "eagle3": ("t2d",)}


class EagleHead(nn.Module):
    """The head's modules (HF-style names under ``layers``, ``fc``, ...); the target's embedding
    and, for EAGLE, its lm_head are borrowed, never registered as this module's parameters."""

    def __init__(
        self,
        config: EagleHeadConfig,
        target: nn.Module,  # qserve.model.llama.LlamaFamilyForCausalLM
        dtype: torch.dtype,
        max_positions: int,
        fc_bias: bool = False,  # EAGLE checkpoints trained with a bias in fc (EAGLE's own default)
    ) -> None:
        super().__init__()
        self.config = config
        self.eagle3 = config.method == "eagle3"
        model = config.model
        hidden = model.hidden_size
        self._borrowed = {"target": target}  # a plain dict: not a submodule (no shared parameters)
        self.layers = nn.ModuleList(
            DecoderLayer(model, f"layers.{i}", dtype, lambda _names: DenseLinearMethod(), layer_index=i)
            for i in range(model.num_layers)
        )
        first = self.layers[0]
        if self.eagle3:
            q_size, kv_size = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
            first.self_attn.qkv_proj = Linear(
                2 * hidden,
                [q_size, kv_size, kv_size],
                bias=model.qkv_bias,
                params_dtype=dtype,
                method=DenseLinearMethod(),
                prefix="layers.0.self_attn.qkv_proj",
            )
            first.hidden_norm = RMSNorm(hidden, model.rms_norm_eps, dtype)
            self.norm = RMSNorm(hidden, model.rms_norm_eps, dtype)
            self.fc = None
            if config.aux_layer_ids is not None:
                width = len(config.aux_layer_ids) * config.target_hidden_size
                self.fc = _dense(width, hidden, False, dtype, "fc")
            self.lm_head = _dense(hidden, config.draft_vocab_size, False, dtype, "lm_head")
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64), persistent=False)
        else:
            first.input_layernorm = nn.Identity()  # EAGLE's first layer reads fc's output as it is
            self.fc = _dense(2 * hidden, hidden, fc_bias, dtype, "fc")
            self.norm = self.lm_head = None
        self.embed_tokens: nn.Embedding | None = None  # EAGLE-3's own, when its checkpoint has one
        self.rotary = RotaryEmbedding(
            model.rope, model.head_dim, max(max_positions, model.max_position_embeddings), rotary_dim=model.rotary_dim
        )
        # draft ids whose target id the tokenizer does not know are never proposed (set_valid_vocab_size)
        self.valid_vocab_size: int | None = None
        self._invalid_drafts: torch.Tensor | None = None  # EAGLE-3: bool [draft_vocab]
        # speculative_config "draft_lm_head": "int4": drafts scored through a 4-bit copy of the lm_head
        # this head drafts with (qserve.spec_decode.draft_lm_head); None: that lm_head itself
        self.draft_lm_head = None

    @property
    def target(self) -> nn.Module:
        return self._borrowed["target"]

    def set_valid_vocab_size(self, valid_vocab_size: int | None) -> None:
        """Target ids at or past ``valid_vocab_size`` (model rows beyond the tokenizer) are never drafted."""
        self.valid_vocab_size = valid_vocab_size
        self._invalid_drafts = None
        if self.eagle3 and valid_vocab_size is not None:
            target_ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t  # [draft_vocab]
            self._invalid_drafts = target_ids >= valid_vocab_size

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the head reads them: ``[T, width] -> [T, H]`` (EAGLE-3's
        fc over the tapped streams; EAGLE reads them as they are)."""
        return target_hidden if self.fc is None or not self.eagle3 else self.fc(target_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]: the token after each position
        positions: torch.Tensor,  # int64 [T]
        hidden: torch.Tensor,  # [T, H]: the feature of each position (combined target states or the head's own)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one per head layer
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits' input ``[T, H]``, the next input feature ``[T, H]``)."""
        embed = self.embed_tokens if self.embed_tokens is not None else self.target.model.embed_tokens
        embeds = embed(input_ids)  # [T, H]
        if not self.eagle3:
            x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))  # [T, H]
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(positions, x, residual, self.rotary, kv_cache, metadata)
            out = x + residual
            return out, out
        first = self.layers[0]
        hidden = hidden.to(embeds.dtype)
        if self.config.norm_before_residual:
            residual = hidden = first.hidden_norm(hidden)
        else:
            residual, hidden = hidden, first.hidden_norm(hidden)
        x = torch.cat([first.input_layernorm(embeds), hidden], dim=-1)  # [T, 2H]
        attn_out = first.self_attn(positions, x, self.rotary, kv_caches[0], metadata)
        normed, residual = first.post_attention_layernorm.add_and_norm(attn_out, residual)
        x = first.mlp(normed)
        for layer, kv_cache in zip(self.layers[1:], kv_caches[1:]):
            x, residual = layer(positions, x, residual, self.rotary, kv_cache, metadata)
        return self.norm.add_and_norm(x, residual)

    def draft_tokens(self, logits_input: torch.Tensor) -> torch.Tensor:
        """int64 [R]: each row's draft, a target token id (argmax over ids the tokenizer knows)."""
        logits = self._draft_logits(logits_input)  # float32 [R, V] (EAGLE-3: [R, draft_vocab])
        if not self.eagle3:
            if self.valid_vocab_size is not None and self.valid_vocab_size < logits.shape[-1]:
                logits[:, self.valid_vocab_size :] = float("-inf")
            return logits.argmax(dim=-1)
        if self._invalid_drafts is not None:
            logits.masked_fill_(self._invalid_drafts, float("-inf"))  # (a mask, not an index: no host sync)
        draft_ids = logits.argmax(dim=-1)  # [R]
        return draft_ids + self.d2t.index_select(0, draft_ids)

    def _draft_logits(self, logits_input: torch.Tensor) -> torch.Tensor:
        """float32 logits of the lm_head this head drafts with: the 4-bit copy where there is one, else
        EAGLE-3's own lm_head or the target's."""
        if self.draft_lm_head is not None:
            return draft_lm_head.logits(logits_input, self.draft_lm_head)
        if self.eagle3:
            return self.lm_head(logits_input).float()
        return self.target.compute_logits(logits_input)

    # ------------------------------------------------------------------------------------------
    # Loading
    # ------------------------------------------------------------------------------------------

    def load_checkpoint(self, path: str | Path) -> None:
        """Every tensor of the head from ``path`` (safetensors); a missing, unknown or misshapen
        tensor is refused naming it."""
        files = CheckpointFiles(path)
        try:
            self._load(files, Path(path))
        finally:
            files.close()

    def _load(self, files: CheckpointFiles, path: Path) -> None:
        method = self.config.method
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        plain = {name for name, _ in self.named_parameters() if not any(name.startswith(f"{lin}.") for lin in linears)}
        expected = {_checkpoint_name(lin, i) for lin, m in linears.items() for i in range(len(m.output_sizes))}
        expected |= plain
        loaded: set[str] = set()
        has_d2t = False
        for stored in files.names():
            name = _canonical(stored)
            if name in _IGNORED[method] or "rotary_emb" in name or (name.startswith("fc.") and self.fc is None):
                continue  # (EAGLE-3 without aux hidden states has no fc; vLLM skips it too)
            if name == "layers.0.input_layernorm.weight" and method == "eagle":
                continue  # EAGLE's first layer has no input norm (vLLM drops it too)
            value = files.get(stored)
            if name == "d2t" and self.eagle3:
                self._load_d2t(value, stored, path)
                has_d2t = True
                continue
            if name == "embed_tokens.weight" and self.eagle3:
                self._load_embedding(value, stored, path)
                continue
            module_path, _, leaf = name.rpartition(".")
            parent, _, sub = module_path.rpartition(".")
            target_linear, shard = module_path, 0
            if sub in _FUSED_NAMES:
                target_linear, shard = f"{parent}.{_FUSED_NAMES[sub][0]}", _FUSED_NAMES[sub][1]
            if target_linear in linears and leaf in ("weight", "bias"):
                layer = linears[target_linear]
                start, size = layer.shard_range(shard)
                want = (size, layer.in_features) if leaf == "weight" else (size,)
                _check_shape(path, stored, value, want)
                if leaf == "bias":
                    if layer.bias is None:
                        raise ValueError(f"{path}: tensor {stored!r}: this head's {target_linear} has no bias")
                    layer.bias.data[start : start + size].copy_(value)
                    continue
                layer.load_weight(shard, value.to(layer.params_dtype))
                loaded.add(_checkpoint_name(target_linear, shard))
            elif name in plain:
                param = self.get_parameter(name)
                _check_shape(path, stored, value, tuple(param.shape))
                param.data.copy_(value)
                loaded.add(name)
            else:
                raise ValueError(
                    f"{path}: tensor {stored!r} is not part of an {method} head with this config.json "
                    f"(expected fc, layers.0..{len(self.layers) - 1}, "
                    f"{'norm, lm_head, d2t, ' if self.eagle3 else ''}as vLLM's {_ARCH[method]} names them)"
                )
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"{path}: the {method} head is missing tensors: {shown}{more}")
        if self.eagle3 and not has_d2t and self.config.draft_vocab_size != self.config.model.vocab_size:
            raise ValueError(
                f"{path}: tensor 'd2t' is missing: draft_vocab_size={self.config.draft_vocab_size} differs from "
                f"vocab_size={self.config.model.vocab_size}, so draft ids need d2t to map to the target's"
            )
        for layer in linears.values():
            layer.process_after_loading()

    def _load_d2t(self, value: torch.Tensor, stored: str, path: Path) -> None:
        _check_shape(path, stored, value, (self.config.draft_vocab_size,))
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{path}: tensor {stored!r} must hold integer offsets, got {value.dtype}")
        target_ids = torch.arange(len(value)) + value.long()
        if bool((target_ids < 0).any()) or bool((target_ids >= self.config.model.vocab_size).any()):
            raise ValueError(
                f"{path}: tensor {stored!r} maps draft ids outside the target's vocabulary [0, "
                f"{self.config.model.vocab_size})"
            )
        self.d2t.copy_(value.long())

    def _load_embedding(self, value: torch.Tensor, stored: str, path: Path) -> None:
        model = self.config.model
        _check_shape(path, stored, value, (model.vocab_size, model.hidden_size))
        dtype = self.layers[0].post_attention_layernorm.weight.dtype
        device = self.layers[0].post_attention_layernorm.weight.device
        embedding = nn.Embedding(model.vocab_size, model.hidden_size, dtype=dtype, device=device)
        embedding.weight.requires_grad_(False)
        embedding.weight.data.copy_(value)
        self.embed_tokens = embedding

    def weight_bytes(self) -> int:
        """Bytes this head reads per draft forward (its own weights and, for EAGLE, the target's lm_head;
        with a 4-bit draft lm_head, that copy instead of the lm_head it stands for)."""
        own = held_weight_bytes(self)  # (4-bit layers, draft_layers "int4", hold theirs outside parameters)
        if self.draft_lm_head is not None:  # (EAGLE-3's dense lm_head is gone)
            return own + tensor_nbytes(self.draft_lm_head)
        if self.eagle3:
            return own
        target = self.target
        head = target.lm_head if target.lm_head is not None else target.model.embed_tokens
        return own + held_weight_bytes(head)  # (a 4-bit lm_head's packed weights are not parameters)

    def quantize_draft_lm_head(self) -> None:
        """Draft through a 4-bit round-to-nearest copy of the lm_head this head scores with (EAGLE: the
        target's, or its tied embedding, kept beside it: the target still verifies with its own; EAGLE-3:
        its own, which the copy replaces). Refused for an lm_head that is not one dense weight (quantized,
        vocabulary-parallel)."""
        if self.eagle3:
            weight = self.lm_head.weight
        else:  # (speculation is refused with tensor parallelism: no vocabulary-parallel lm_head here)
            target = self.target
            source = target.lm_head if target.lm_head is not None else target.model.embed_tokens
            weight = getattr(source, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise ValueError(
                    "speculative_config.draft_lm_head 'int4': the target's lm_head is not a dense weight "
                    "(a quantized lm_head is already cheap to draft with); use 'target'"
                )
        self.draft_lm_head = draft_lm_head.prepare(weight.detach())
        if self.eagle3:  # its own lm_head: nothing reads the dense one now
            self.lm_head = None
        if weight.is_cuda:  # the quantization's temporaries: back to the device before the memory plan
            del weight
            torch.cuda.empty_cache()

    def quantize_layers(self) -> None:
        """Draft through 4-bit round-to-nearest copies of the head's dense linear layers (its decoder
        layers and fc; ``qserve.spec_decode.draft_layers``); an lm_head stays as it is (``draft_lm_head``
        decides that one)."""
        linears = [m for m in (*self.layers.modules(), self.fc) if isinstance(m, Linear)]
        for layer in linears:
            draft_layers.quantize_linear(layer)
        device = self.layers[0].post_attention_layernorm.weight.device
        if device.type == "cuda":  # the dense weights' memory: back to the device before the memory plan
            torch.cuda.empty_cache()

    def draft_lm_head_bytes(self) -> int:
        """Device bytes of the 4-bit draft lm_head (0 without one): not a parameter, so counted apart."""
        return tensor_nbytes(self.draft_lm_head)  # (0 for None)


# HF sub-module -> (fused module, shard)
_FUSED_NAMES = {sub: (fused, i) for fused, subs in FUSED_SLICES.items() for i, sub in enumerate(subs)}
_ARCH = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}


def _checkpoint_name(linear: str, shard: int) -> str:
    """The checkpoint tensor of a (fused) linear's shard: ``layers.0.self_attn.qkv_proj`` shard 1
    is ``layers.0.self_attn.k_proj.weight``."""
    parent, _, sub = linear.rpartition(".")
    if sub in FUSED_SLICES:
        return f"{parent}.{FUSED_SLICES[sub][shard]}.weight"
    return f"{linear}.weight"


def _canonical(name: str) -> str:
    """A checkpoint name as this module names it (vLLM's remapping: ``midlayer.`` is layer 0)."""
    name = name.removeprefix("model.")
    if name.startswith("midlayer."):
        name = "layers.0." + name.removeprefix("midlayer.")
    return name


def _check_shape(path: Path, name: str, value: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(
            f"{path}: tensor {name!r} has shape {tuple(value.shape)}, the head's config.json implies {tuple(expected)}"
        )


def _dense(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, prefix: str) -> Linear:
    return Linear(in_features, [out_features], bias=bias, params_dtype=dtype, method=DenseLinearMethod(), prefix=prefix)


def load_eagle_head(
    path: str | Path,
    config: EagleHeadConfig,
    target: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> EagleHead:
    """The head of checkpoint ``path`` on ``device``, beside ``target`` (whose embedding it borrows)."""
    files = CheckpointFiles(path)
    fc_bias = config.method == "eagle" and "fc.bias" in {_canonical(n) for n in files.names()}
    files.close()
    with torch.device(device):
        head = EagleHead(config, target, dtype, max_positions, fc_bias=fc_bias)
    head.load_checkpoint(path)
    head.eval()
    return head


def eagle_head_bytes(path: str | Path, method: str, dtype: torch.dtype, int4_layers: bool = False) -> int:
    """Bytes the head's weights take in ``dtype``, from the checkpoint's headers (``qserve plan``);
    ``int4_layers``: its linear layers (every 2-D weight but the embedding and lm_head) as the 4-bit
    copies of ``draft_layers`` "int4"."""
    files = CheckpointFiles(path)
    try:
        element = torch.empty((), dtype=dtype).element_size()
        total = 0
        for name in files.names():
            canonical = _canonical(name)
            if canonical in _IGNORED[method] or "rotary_emb" in canonical:
                continue
            info = files.info(name)
            if int4_layers and len(info.shape) == 2 and canonical not in ("embed_tokens.weight", "lm_head.weight"):
                total += draft_lm_head.planned_bytes(info.shape[0], info.shape[1], dtype)  # [N, K]: same layout
                continue
            size = info.nbytes // max(torch.empty((), dtype=info.torch_dtype).element_size(), 1)
            total += size * (8 if canonical == "d2t" else element)
        return total
    finally:
        files.close()
