"""SamplingParams: how to pick tokens and when to stop, with vLLM's names, defaults and meaning.

Knows: the per-request sampling and stopping knobs and their valid ranges. Must not know:
torch, tensors, the tokenizer or the engine. Pure Python value object, validated on
construction; attribute assignment afterwards raises (``dataclasses.FrozenInstanceError``).

Semantics (as vLLM):
- ``temperature < 1e-5`` means greedy (argmax); top_p / top_k / min_p are then reset to off.
- ``top_k``: 0 or -1 disable it (stored as 0); otherwise >= 1.
- ``stop`` is normalized to a list of strings; ``stop_token_ids`` to a list of ints.
- ``max_tokens=None`` means "until the model's context length" (the engine caps it).
- ``logprobs`` / ``prompt_logprobs``: number of top alternatives to return in addition to the
  chosen (or actual prompt) token; 0 returns only the chosen token's logprob.
- ``logit_bias``: token id -> value in [-100, 100] added to that token's logit (OpenAI's).
- ``structured_outputs``: a ``StructuredOutputsParams`` the output must match (a JSON
  schema, regex, choice or grammar), enforced by token masks; not with ``min_tokens``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from qserve.structured.params import StructuredOutputsParams

SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("n", _int("n", self.n, minimum=1))
        set_("presence_penalty", _float_range("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_("frequency_penalty", _float_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        rep = _float("repetition_penalty", self.repetition_penalty)
        if rep <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {_show(self.repetition_penalty)}")
        set_("repetition_penalty", rep)
        temp = _float("temperature", self.temperature)
        if temp < 0.0:
            raise ValueError(f"temperature must be >= 0, got {_show(self.temperature)}")
        set_("temperature", temp)
        top_p = _float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {_show(self.top_p)}")
        set_("top_p", top_p)
        top_k = _int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {_show(self.top_k)}")
        set_("top_k", max(top_k, 0))
        set_("min_p", _float_range("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:
            set_("seed", _int("seed", self.seed))
        set_("stop", _str_list("stop", self.stop))
        set_("stop_token_ids", _int_list("stop_token_ids", self.stop_token_ids))
        set_("ignore_eos", _bool("ignore_eos", self.ignore_eos))
        if self.max_tokens is not None:
            set_("max_tokens", _int("max_tokens", self.max_tokens, minimum=1))
        set_("min_tokens", _int("min_tokens", self.min_tokens, minimum=0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {_show(self.min_tokens)}")
        if self.logprobs is not None:
            set_("logprobs", _int("logprobs", self.logprobs, minimum=0))
        if self.prompt_logprobs is not None:
            set_("prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs, minimum=0))
        set_("skip_special_tokens", _bool("skip_special_tokens", self.skip_special_tokens))
        set_("include_stop_str_in_output", _bool("include_stop_str_in_output", self.include_stop_str_in_output))
        if self.logit_bias is not None:
            set_("logit_bias", _logit_bias(self.logit_bias) or None)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
                )
            if self.min_tokens > 0:
                raise ValueError("min_tokens cannot be combined with structured_outputs (the grammar decides the end)")
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs have no effect; turn them off (as vLLM does).
            set_("top_p", 1.0)
            set_("top_k", 0)
            set_("min_p", 0.0)

    # ------------------------------------------------------------------ derived views
    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)  # type: ignore[union-attr]

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed (e.g. ``seed`` for the i-th of ``n`` samples)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values.update(changes)
        return SamplingParams(**values)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]


# Refuse unknown keyword arguments with a ValueError that names them (a plain dataclass
# would raise TypeError). The wrapper keeps the generated signature for help()/inspect.
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _checked_init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    if args:
        raise TypeError("SamplingParams takes keyword arguments only")
    known = SamplingParams.field_names()
    for name in kwargs:
        if name not in known:
            raise ValueError(f"unknown sampling parameter {name!r}; supported: {', '.join(known)}")
    _dataclass_init(self, **kwargs)


SamplingParams.__init__ = _checked_init  # type: ignore[method-assign]


# ---------------------------------------------------------------------- validators
def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message, bounded (messages never echo unbounded input)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_show(value)}")
    return value


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {_show(value)}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_show(value)}")
    value = float(value)
    if not math.isfinite(value):  # NaN or +-inf (JSON's NaN / Infinity parse in Python)
        raise ValueError(f"{name} must be a finite number, got {_show(value)}")
    return value


def _float_range(name: str, value: Any, low: float, high: float) -> float:
    v = _float(name, value)
    if not low <= v <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {_show(value)}")
    return v


def _str_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    out = list(value)
    for s in out:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings, got {_show(s)}")
    return out


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {value!r}")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        out[token] = _float_range("logit_bias", bias, -100.0, 100.0)
    return out


def _int_list(name: str, value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    out = list(value)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{name} must be a list of non-negative token ids, got {_show(t)}")
    return out
