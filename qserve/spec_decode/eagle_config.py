"""The configuration of an EAGLE / EAGLE-3 head checkpoint, as vLLM reads it (no remote code).

Knows: which ``config.json`` keys describe a head and what they mean (vLLM's reading), and how they
must agree with the target. Must not know: tensors, devices, the engine.

A head's ``config.json`` is a Llama config of the head's own decoder layer(s) (``num_hidden_layers``,
usually 1) plus, for EAGLE-3: ``draft_vocab_size`` (the head's own, smaller vocabulary; ``d2t``
maps it to the target's), ``target_hidden_size`` (when the target's width differs from the head's),
``norm_before_residual`` (the first layer's residual taken after ``hidden_norm``; default false),
and the target layers whose input streams the head reads: ``eagle_aux_hidden_state_layer_ids``, at
the top level or inside ``eagle_config`` (vLLM looks in both), defaulting to vLLM's
``(2, num_layers // 2, num_layers - 3)`` of the target; ``eagle_config.use_aux_hidden_state: false``
makes it read the target's final hidden states instead (no ``fc``). ``architectures`` names one of
``EAGLE_ARCHITECTURES`` / ``EAGLE3_ARCHITECTURES`` (vLLM's names, or plain ``LlamaForCausalLM`` as
the EAGLE authors' checkpoints say, the method telling which head it is).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qserve.config import ModelConfig

EAGLE_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLM")
EAGLE3_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "LlamaForCausalLM")
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True, slots=True)
class EagleHeadConfig:
    method: str  # "eagle" | "eagle3"
    model: ModelConfig  # the head's decoder layer(s), read as a Llama config
    draft_vocab_size: int  # EAGLE-3's own vocabulary (EAGLE: the target's)
    target_hidden_size: int
    # EAGLE-3: the target layers whose input streams are concatenated into fc (None: the target's
    # final hidden states, as EAGLE reads them)
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool = False

    @property
    def taps(self) -> tuple[int, ...]:
        """What the target's runner returns for this head (``ModelRunner.enable_spec_hidden_states``)."""
        return () if self.aux_layer_ids is None else self.aux_layer_ids


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 taps: a low, a middle and a high layer of the target."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def read_eagle_config(path: str | Path, method: str, target: ModelConfig) -> EagleHeadConfig:
    """The head config of checkpoint ``path`` for ``method``; ValueError naming the file and key."""
    source = Path(path) / "config.json"
    if not source.is_file():
        raise FileNotFoundError(f"speculative_config.model {path}: no config.json (an EAGLE head's checkpoint)")
    try:
        cfg = json.loads(source.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{source}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: expected a JSON object")
    return eagle_config_from_dict(cfg, method, target, str(source))


def eagle_config_from_dict(cfg: dict[str, Any], method: str, target: ModelConfig, source: str) -> EagleHeadConfig:
    supported = EAGLE3_ARCHITECTURES if method == "eagle3" else EAGLE_ARCHITECTURES
    architectures = cfg.get("architectures") or []
    if not any(a in supported for a in architectures):
        raise ValueError(
            f"{source}: architectures {architectures!r} is not an {method} head qserve loads; supported: "
            f"{', '.join(supported)} (speculators-format checkpoints are not supported yet)"
        )
    try:
        model = ModelConfig.from_hf({**cfg, "architectures": ["LlamaForCausalLM"]}, source)
    except KeyError as err:
        raise ValueError(f"{source}: required field {err.args[0]!r} is missing") from None
    if model.vocab_size != target.vocab_size:
        raise ValueError(
            f"{source}: vocab_size={model.vocab_size} differs from the target's {target.vocab_size}: "
            "the head must be trained for this target"
        )
    if method == "eagle":
        if model.hidden_size != target.hidden_size:
            raise ValueError(
                f"{source}: hidden_size={model.hidden_size} differs from the target's {target.hidden_size} "
                "(an EAGLE head's fc reads the target's hidden states)"
            )
        return EagleHeadConfig("eagle", model, model.vocab_size, target.hidden_size, None)
    draft_vocab = cfg.get("draft_vocab_size") or model.vocab_size
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 0 < draft_vocab <= model.vocab_size:
        raise ValueError(f"{source}: draft_vocab_size={draft_vocab!r} must be an integer in [1, {model.vocab_size}]")
    target_hidden = cfg.get("target_hidden_size") or model.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"{source}: target_hidden_size={target_hidden} differs from the target's hidden_size "
            f"{target.hidden_size} (fc reads three of the target's hidden states)"
        )
    eagle_config = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    aux: tuple[int, ...] | None
    if not eagle_config.get("use_aux_hidden_state", True):
        if model.hidden_size != target.hidden_size:
            raise ValueError(
                f"{source}: without aux hidden states the head reads the target's hidden states directly, "
                f"so hidden_size={model.hidden_size} must equal the target's {target.hidden_size}"
            )
        aux = None
    else:
        ids = cfg.get(AUX_LAYERS_KEY) or eagle_config.get(AUX_LAYERS_KEY)
        key = AUX_LAYERS_KEY
        if not ids:
            ids, key = default_aux_layer_ids(target.num_layers), f"{AUX_LAYERS_KEY} (vLLM's default)"
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{source}: {AUX_LAYERS_KEY} must be a list of layer ids, got {ids!r}")
        bad = [i for i in ids if not 0 <= i < target.num_layers]
        if bad or len(ids) != 3:
            raise ValueError(
                f"{source}: {key} {list(ids)} must be 3 layer ids of the target, each in [0, {target.num_layers}) "
                f"(the target has {target.num_layers} layers; set {AUX_LAYERS_KEY} in the head's config.json)"
            )
        aux = tuple(ids)
    norm_before = cfg.get("norm_before_residual", False)
    if not isinstance(norm_before, bool):
        raise ValueError(f"{source}: norm_before_residual must be true or false, got {norm_before!r}")
    return EagleHeadConfig("eagle3", model, int(draft_vocab), int(target_hidden), aux, norm_before)
