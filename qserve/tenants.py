"""Tenants: API keys map to who is asking, and each tenant has a share and limits.

Knows: the tenants file (JSON)::

    {"tenants": {
        "alice": {"api_keys": ["sk-alice-1"], "weight": 3, "max_concurrent": 32, "max_queued": 64,
                  "tokens_per_minute": 200000},
        "bob":   {"api_keys": ["sk-bob"]}
    }}

(``weight`` default 1, a finite positive number; limits default to none; keys are non-empty
and free of whitespace and control characters, as an ``Authorization`` header carries them),
key -> tenant lookup (constant-time comparisons), and admission: a tenant may have
``max_concurrent + max_queued`` sequences in flight, counted as the engine counts them (a request
of 4 prompts with ``n=8`` is 32; the scheduler runs at most ``max_concurrent`` of them and shares
seats by ``weight``; the rest wait), and spends tokens from a bucket refilled at ``tokens_per_minute`` (a request
costs its prompt plus ``max_tokens`` per sequence up front; what it did not generate is given
back when it ends). Over a limit, ``TenantLimitError`` says which, with a ``Retry-After``.
Per-tenant counters are kept here for metrics. Must not know: HTTP, the engine, torch.
"""

from __future__ import annotations

import hmac
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FIELDS = {"api_keys", "weight", "max_concurrent", "max_queued", "tokens_per_minute"}


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    api_keys: tuple[str, ...]
    weight: float = 1.0
    max_concurrent: int | None = None  # running sequences (the scheduler's seats)
    max_queued: int | None = None  # sequences waiting beyond max_concurrent
    tokens_per_minute: int | None = None

    @property
    def max_in_flight(self) -> int | None:
        """Sequences admitted and not finished: running plus queued."""
        if self.max_concurrent is None or self.max_queued is None:
            return None
        return self.max_concurrent + self.max_queued


class TenantLimitError(Exception):
    """Over a tenant's limit: HTTP 429 with ``Retry-After: retry_after_s``."""

    def __init__(self, tenant: str, reason: str, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.reason = reason  # "queue" | "tokens" | "too_large"
        self.retry_after_s = retry_after_s


def _positive(name: str, tenant: str, value: Any, kind: type) -> Any:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)  # json accepts NaN and Infinity
        or (kind is int and not float(value).is_integer())
    ):
        what = "finite positive number" if kind is float else "positive integer"
        raise ValueError(f"tenant {tenant!r}: {name} must be a {what}, got {value!r}")
    if value <= 0 and not (name == "max_queued" and value == 0):
        raise ValueError(f"tenant {tenant!r}: {name} must be positive, got {value!r}")
    return kind(value)


def parse_tenants(data: Any, source: str = "tenants") -> dict[str, TenantConfig]:
    """Validate the file's content; errors name the tenant and the field."""
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict) or not data["tenants"]:
        raise ValueError(f'{source}: expected {{"tenants": {{"NAME": {{"api_keys": [...], ...}}, ...}}}}')
    tenants: dict[str, TenantConfig] = {}
    owners: dict[str, str] = {}
    for name, spec in data["tenants"].items():
        if not isinstance(spec, dict):
            raise ValueError(f"{source}: tenant {name!r} must be an object")
        unknown = sorted(set(spec) - _FIELDS)
        if unknown:
            raise ValueError(f"{source}: tenant {name!r} has unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
        keys = spec.get("api_keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"{source}: tenant {name!r} needs api_keys, a non-empty list of non-empty strings")
        for key in keys:
            if any(c.isspace() or not c.isprintable() for c in key):
                raise ValueError(
                    f"{source}: tenant {name!r} has an API key with whitespace or control characters "
                    "(an Authorization: Bearer header cannot carry it)"
                )
            if key in owners:
                raise ValueError(f"{source}: an API key of tenant {name!r} is also tenant {owners[key]!r}'s")
            owners[key] = name
        try:
            tenants[name] = TenantConfig(
                name=name,
                api_keys=tuple(keys),
                weight=_positive("weight", name, spec.get("weight", 1.0), float),
                max_concurrent=_positive("max_concurrent", name, spec.get("max_concurrent"), int),
                max_queued=_positive("max_queued", name, spec.get("max_queued"), int),
                tokens_per_minute=_positive("tokens_per_minute", name, spec.get("tokens_per_minute"), int),
            )
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
    return tenants


def load_tenants(path: str | Path) -> dict[str, TenantConfig]:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg} at line {err.lineno})") from None
    return parse_tenants(data, str(path))


@dataclass
class _TenantState:
    in_flight: int = 0  # requests
    sequences: int = 0  # their sequences (prompts x n): what the limits count
    tokens: float = 0.0  # the bucket
    refilled_at: float = 0.0
    # counters for metrics
    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    tokens_charged: int = 0
    tokens_refunded: int = 0


@dataclass(eq=False)
class Admission:
    """One admitted request: released (once) when it ends, giving back unused tokens."""

    tenant: str
    cost: int
    prompt_tokens: int
    sequences: int = 1
    released: bool = False


class Tenants:
    """Key lookup and admission for every tenant. Used from one thread (the event loop)."""

    def __init__(self, tenants: Mapping[str, TenantConfig], clock: Callable[[], float] = time.monotonic) -> None:
        self.configs = dict(tenants)
        self._clock = clock
        now = clock()
        self._state = {
            name: _TenantState(tokens=float(c.tokens_per_minute or 0), refilled_at=now)
            for name, c in self.configs.items()
        }
        self._keys = [(key.encode(), name) for name, c in self.configs.items() for key in c.api_keys]

    def tenant_for_key(self, key: str) -> TenantConfig | None:
        """The tenant owning ``key`` (every key compared in constant time), or None."""
        found = None
        given = key.encode()
        for candidate, name in self._keys:
            if hmac.compare_digest(given, candidate):
                found = name
        return None if found is None else self.configs[found]

    @property
    def weights(self) -> dict[str, float]:
        return {name: c.weight for name, c in self.configs.items()}

    @property
    def max_running(self) -> dict[str, int | None]:
        return {name: c.max_concurrent for name, c in self.configs.items()}

    def _refill(self, config: TenantConfig, state: _TenantState) -> None:
        now = self._clock()
        if config.tokens_per_minute:
            rate = config.tokens_per_minute / 60.0
            state.tokens = min(float(config.tokens_per_minute), state.tokens + (now - state.refilled_at) * rate)
        state.refilled_at = now

    def _reject(self, state: _TenantState, error: TenantLimitError) -> TenantLimitError:
        state.rejected[error.reason] = state.rejected.get(error.reason, 0) + 1
        return error

    def admit(self, tenant: str, prompt_tokens: int, max_new_tokens: int, sequences: int = 1) -> Admission:
        """Admit a request of ``sequences`` sequences (prompts x n) costing ``prompt_tokens +
        max_new_tokens`` tokens, or raise ``TenantLimitError``."""
        config, state = self.configs[tenant], self._state[tenant]
        limit = config.max_in_flight
        if limit is not None and sequences > limit:
            raise self._reject(
                state,
                TenantLimitError(
                    tenant, "too_large", f"this request asks for {sequences} sequences (prompts x n), more than "
                    f"tenant {tenant!r} may have in flight (max_concurrent {config.max_concurrent} + max_queued "
                    f"{config.max_queued}); lower n or send fewer prompts", retry_after_s=60,
                ),
            )  # fmt: skip
        if limit is not None and state.sequences + sequences > limit:
            raise self._reject(
                state,
                TenantLimitError(
                    tenant, "queue", f"tenant {tenant!r} has {state.sequences} sequences in flight; {sequences} more "
                    f"would pass its limit (max_concurrent {config.max_concurrent} + max_queued "
                    f"{config.max_queued}); retry later",
                ),
            )  # fmt: skip
        cost = prompt_tokens + max_new_tokens
        if config.tokens_per_minute:
            if cost > config.tokens_per_minute:
                raise self._reject(
                    state,
                    TenantLimitError(
                        tenant, "too_large", f"this request needs {cost} tokens (prompt + max_tokens), more than "
                        f"tenant {tenant!r}'s tokens_per_minute of {config.tokens_per_minute}; lower max_tokens",
                        retry_after_s=60,
                    ),
                )  # fmt: skip
            self._refill(config, state)
            if state.tokens < cost:
                wait = math.ceil((cost - state.tokens) / (config.tokens_per_minute / 60.0))
                raise self._reject(
                    state,
                    TenantLimitError(
                        tenant, "tokens", f"tenant {tenant!r} is over its {config.tokens_per_minute} tokens per "
                        f"minute (this request needs {cost}); retry in {wait} s", retry_after_s=max(wait, 1),
                    ),
                )  # fmt: skip
            state.tokens -= cost
        state.in_flight += 1
        state.sequences += sequences
        state.admitted += 1
        state.tokens_charged += cost
        return Admission(tenant, cost, prompt_tokens, sequences)

    def release(self, admission: Admission, generated_tokens: int) -> None:
        """The request ended (finished, failed or aborted); idempotent."""
        if admission.released:
            return
        admission.released = True
        config, state = self.configs[admission.tenant], self._state[admission.tenant]
        state.in_flight -= 1
        state.sequences -= admission.sequences
        unused = max(admission.cost - admission.prompt_tokens - generated_tokens, 0)
        state.tokens_refunded += unused
        if config.tokens_per_minute and unused:
            self._refill(config, state)
            state.tokens = min(float(config.tokens_per_minute), state.tokens + unused)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "in_flight": s.in_flight,
                "sequences_in_flight": s.sequences,
                "admitted": s.admitted,
                "rejected": dict(s.rejected),
                "tokens_used": s.tokens_charged - s.tokens_refunded,
            }
            for name, s in self._state.items()
        }
