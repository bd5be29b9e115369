"""``speculative_config`` (vLLM's name and keys): which proposer, how many draft tokens, when off.

Knows: the accepted keys, their defaults and ranges, and how a JSON string or a dict becomes a
``SpeculativeConfig``; every error names the offending key as ``speculative_config.<key>``. Must
not know: torch, the engine, the proposers' internals.

Keys (vLLM's): ``method`` ("ngram", "draft_model", "eagle" or "eagle3"; MTP, Medusa and the
others are refused, naming what is supported), ``model`` (the checkpoint of "draft_model" (a
model of the same tokenizer) or of an EAGLE / EAGLE-3 head), ``num_speculative_tokens`` (k >= 1,
required), ``prompt_lookup_max`` / ``prompt_lookup_min`` (n-gram sizes; one given sets the other,
neither gives vLLM's 5 and 5), ``disable_by_batch_size`` (no proposals while more requests than
this are enqueued, running or waiting, as vLLM counts: a busy engine decodes exactly as without
speculation, and a burst being admitted over several steps is busy from its first step),
``enable_adaptive_verification`` (vLLM's name; off by default: k chosen per step from the measured
acceptance and the batch size, ``qserve.spec_decode.adaptive``) and qserve's own
``adaptive_verification_row_cost`` (that policy's cost of one verified row relative to the fixed
cost of a step; default ``DEFAULT_ROW_COST``). ``model`` is accepted as vLLM's older way to say
``"[ngram]"`` / ``"ngram"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
NOT_YET_METHODS = ("medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix", "dflash")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # need speculative_config.model
EAGLE_METHODS = ("eagle", "eagle3")
KNOWN_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "enable_adaptive_verification",
    "adaptive_verification_row_cost",
    "draft_lm_head",
    "draft_layers",
)
# What an EAGLE head drafts through: the lm_head it scores with ("target": as it is; "int4": a 4-bit
# round-to-nearest copy, qserve.spec_decode.draft_lm_head; the target verifies with its own either way).
DRAFT_LM_HEADS = ("target", "int4")
# What an EAGLE head's own linear layers are ("checkpoint": dense as loaded; "int4": 4-bit round-to-nearest
# copies, qserve.spec_decode.draft_layers).
DRAFT_LAYERS = ("checkpoint", "int4")
# vLLM's defaults when neither n-gram size is given.
DEFAULT_PROMPT_LOOKUP = 5
# The adaptive policy's cost of one verified row (a sequence's token scored by the target) relative
# to a step's fixed cost (streaming the weights). Conservative: 32 rows cost as much as the weights,
# so a step of 32 plain decodes already costs twice a step of one, and speculation stops well
# before the card is compute-bound (an H100 with a 4-bit 7B model is memory-bound up to ~64 rows).
DEFAULT_ROW_COST = 1 / 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None  # None: always propose
    model: str | None = None  # the draft checkpoint (method "draft_model") or the EAGLE head's
    enable_adaptive_verification: bool = False  # k per step from acceptance and batch size
    adaptive_verification_row_cost: float = DEFAULT_ROW_COST
    draft_lm_head: str = "target"  # EAGLE heads: DRAFT_LM_HEADS
    draft_layers: str = "checkpoint"  # EAGLE heads: DRAFT_LAYERS

    @property
    def is_eagle(self) -> bool:
        return self.method in EAGLE_METHODS

    def proposes_at(self, num_enqueued: int) -> bool:
        """Whether this step gets proposals: off while the enqueued requests (running and waiting,
        vLLM's count) exceed the threshold."""
        return self.disable_by_batch_size is None or num_enqueued <= self.disable_by_batch_size


def _positive_int(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"speculative_config.{key} must be >= {minimum}, got {value}")
    return value


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A ``SpeculativeConfig`` from a JSON string (``--speculative-config``), a dict
    (``LLM(speculative_config=...)``) or one already built; None stays None (speculation off)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"speculative_config is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
    unknown = sorted(set(value) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]} is not supported; supported keys: {', '.join(KNOWN_KEYS)}")
    method = value.get("method")
    model = value.get("model")
    if method is None and isinstance(model, str) and model.strip("[]") == "ngram":
        method = "ngram"  # vLLM's older spelling: {"model": "[ngram]"}
    elif model is not None and method == "ngram":
        raise ValueError("speculative_config.model must not be given with method 'ngram' (it uses no model)")
    elif method in MODEL_METHODS and (not isinstance(model, str) or not model):
        what = "the draft checkpoint" if method == "draft_model" else "the EAGLE head's checkpoint"
        raise ValueError(f"speculative_config.model is required with method {method!r} ({what})")
    if method is None:
        raise ValueError(f"speculative_config.method is required; supported: {', '.join(SUPPORTED_METHODS)}")
    if method not in SUPPORTED_METHODS:
        later = " (not implemented in qserve yet)" if method in NOT_YET_METHODS else ""
        raise ValueError(
            f"speculative_config.method {method!r} is not supported{later}; supported: {', '.join(SUPPORTED_METHODS)}"
        )
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config.num_speculative_tokens is required (the draft tokens per step)")
    k = _positive_int("num_speculative_tokens", value["num_speculative_tokens"])
    lookup_max = value.get("prompt_lookup_max")
    lookup_min = value.get("prompt_lookup_min")
    if lookup_max is not None:
        lookup_max = _positive_int("prompt_lookup_max", lookup_max)
    if lookup_min is not None:
        lookup_min = _positive_int("prompt_lookup_min", lookup_min)
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
    elif lookup_min is None:
        lookup_min = lookup_max
    elif lookup_max is None:
        lookup_max = lookup_min
    if lookup_min > lookup_max:
        raise ValueError(
            f"speculative_config.prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max ({lookup_max})"
        )
    disable = value.get("disable_by_batch_size")
    if disable is not None:
        disable = _positive_int("disable_by_batch_size", disable)
    adaptive = value.get("enable_adaptive_verification", False)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative_config.enable_adaptive_verification must be true or false, got {adaptive!r}")
    row_cost = value.get("adaptive_verification_row_cost", DEFAULT_ROW_COST)
    if isinstance(row_cost, bool) or not isinstance(row_cost, (int, float)) or not 0 < row_cost < float("inf"):
        raise ValueError(
            f"speculative_config.adaptive_verification_row_cost must be a number > 0 (a row's cost relative to a "
            f"step's fixed cost), got {row_cost!r}"
        )
    lm_head = _eagle_choice(value, "draft_lm_head", DRAFT_LM_HEADS, method)
    layers = _eagle_choice(value, "draft_layers", DRAFT_LAYERS, method)
    return SpeculativeConfig(
        method,
        k,
        lookup_max,
        lookup_min,
        disable,
        model if method in MODEL_METHODS else None,
        adaptive,
        float(row_cost),
        lm_head,
        layers,
    )


def _eagle_choice(value: dict[str, Any], key: str, choices: tuple[str, ...], method: str) -> str:
    """An EAGLE head's option ``key``: one of ``choices`` (the first is the default, the only one other
    methods take)."""
    chosen = value.get(key, choices[0])
    if chosen not in choices:
        raise ValueError(f"speculative_config.{key} must be one of {', '.join(choices)}, got {chosen!r}")
    if chosen != choices[0] and method not in EAGLE_METHODS:
        raise ValueError(
            f"speculative_config.{key} {chosen!r} applies to EAGLE heads (method eagle or eagle3), not method {method!r}"
        )
    return chosen


def check_tensor_parallel_speculation(config: SpeculativeConfig | None, tensor_parallel_size: int) -> None:
    """Speculative decoding runs in one process only (for now)."""
    if config is not None and tensor_parallel_size > 1:
        raise ValueError(
            f"speculative_config is not supported with tensor parallelism (tensor_parallel_size={tensor_parallel_size})"
        )
