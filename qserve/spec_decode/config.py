"""``speculative_config`` (vLLM's name and keys): which proposer, how many draft tokens, when off.

Knows: the accepted keys, their defaults and ranges, and how a JSON string or a dict becomes a
``SpeculativeConfig``; every error names the offending key as ``speculative_config.<key>``. Must
not know: torch, the engine, the proposers' internals.

Keys (vLLM's): ``method`` ("ngram" or "draft_model"; EAGLE and the others are refused for now,
naming what is supported), ``model`` (the draft checkpoint of "draft_model": a directory of the
same tokenizer), ``num_speculative_tokens`` (k >= 1, required), ``prompt_lookup_max`` /
``prompt_lookup_min`` (n-gram sizes; one given sets the other, neither gives vLLM's 5 and 5),
``disable_by_batch_size`` (no proposals while more sequences than this are running, so a busy
engine decodes exactly as without speculation). ``model`` is accepted as vLLM's older way to
say ``"[ngram]"`` / ``"ngram"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("ngram", "draft_model")
NOT_YET_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
KNOWN_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
)
# vLLM's defaults when neither n-gram size is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None  # None: always propose
    model: str | None = None  # the draft checkpoint (method "draft_model")

    def proposes_at(self, num_running: int) -> bool:
        """Whether this step gets proposals: off while the running batch exceeds the threshold."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size


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
    elif method == "draft_model" and (not isinstance(model, str) or not model):
        raise ValueError("speculative_config.model is required with method 'draft_model' (the draft checkpoint)")
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
    return SpeculativeConfig(method, k, lookup_max, lookup_min, disable, model if method == "draft_model" else None)


def check_tensor_parallel_speculation(config: SpeculativeConfig | None, tensor_parallel_size: int) -> None:
    """Speculative decoding runs in one process only (for now)."""
    if config is not None and tensor_parallel_size > 1:
        raise ValueError(
            f"speculative_config is not supported with tensor parallelism (tensor_parallel_size={tensor_parallel_size})"
        )
