"""Adaptive speculation (``enable_adaptive_verification``): how many draft tokens a step gets, from
the measured acceptance and the batch size, so that speculation is used where it pays and switched
off where the card is busy and drafts would only take rows from real tokens.

Knows: a running estimate of the acceptance of each draft position and a cost model of a step.
Must not know: torch, the engine, proposers. Pure Python.

Acceptance: ``rates[j]`` estimates the probability that draft j (0-based) is kept given that every
draft before it was (the rejection sampler keeps a prefix). Each verified proposal counts one trial
at every position it tried (those up to and including the first rejected one) and a success where
the draft was kept; every step the counts decay by ``1 - 1 / memory_steps``, so old measurements
fade. The estimate is ``(kept + w base) / (trials + w)`` with ``w = prior_weight`` pseudo-trials
at ``base``: the prior for position 0, the estimate of position j - 1 for position j. So a position
seldom tried (k was smaller) follows the one before it, and a policy that stopped speculating
drifts back toward the prior and tries again rather than never measuring anything again.

Value of k: a sequence given k drafts emits ``expected_tokens(rates, k) = 1 + sum_{j=1..k}
prod_{i<j} rates[i]`` tokens per verify step (with one rate a for every position this is
``(1 - a^(k+1)) / (1 - a)``).

Cost of a step (in units of the step's fixed cost, streaming the weights): with B sequences each
verifying k drafts the target scores ``B (k + 1)`` rows, each costing ``row_cost``; the proposer
runs k forwards of B rows, each ``draft_cost`` times a target forward of B rows (0 for n-gram
lookup; the ratio of the weights read for a draft model or an EAGLE head):
``cost(k) = 1 + row_cost B (k + 1) + k draft_cost (1 + row_cost B)``.

Choice: the k in ``[0, max_k]`` that maximizes tokens per unit cost, ``expected_tokens(k) /
cost(k)``; ties go to the smaller k (k = 0: plain decoding, at exactly the cost of no speculation).
As B grows the row term dominates and every k > 0 loses unless drafts are nearly always kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Acceptance assumed before anything is measured, and where unmeasured estimates drift back to:
# optimistic, so the policy speculates (where the batch allows) and so measures; a few verified
# proposals outweigh it. A pessimistic prior could keep k = 0 forever, measuring nothing.
DEFAULT_PRIOR = 0.8
DEFAULT_PRIOR_WEIGHT = 2.0  # pseudo-trials of the prior (or of the position before)
DEFAULT_MEMORY_STEPS = 64.0  # steps over which a measurement fades by 1/e


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Tokens a sequence emits per verify step with ``k`` drafts (the target's own token included)."""
    total, survive = 1.0, 1.0
    for j in range(k):
        survive *= rates[j]
        total += survive
    return total


def step_cost(k: int, batch_size: int, row_cost: float, draft_cost: float = 0.0) -> float:
    """A step of ``batch_size`` sequences with ``k`` drafts each, in units of its fixed cost."""
    return 1.0 + row_cost * batch_size * (k + 1) + k * draft_cost * (1.0 + row_cost * batch_size)


def choose_num_tokens(
    rates: Sequence[float], max_k: int, batch_size: int, row_cost: float, draft_cost: float = 0.0
) -> int:
    """The k in ``[0, max_k]`` with the most expected tokens per unit cost (the smaller on ties)."""
    best_k, best = 0, 1.0 / step_cost(0, batch_size, row_cost, draft_cost)
    for k in range(1, max_k + 1):
        value = expected_tokens(rates, k) / step_cost(k, batch_size, row_cost, draft_cost)
        if value > best * (1 + 1e-9):
            best_k, best = k, value
    return best_k


@dataclass
class AdaptiveSpeculation:
    """The policy's state: per-position acceptance counts and the cost model's parameters."""

    max_k: int
    row_cost: float
    draft_cost: float = 0.0
    prior: float = DEFAULT_PRIOR
    prior_weight: float = DEFAULT_PRIOR_WEIGHT
    memory_steps: float = DEFAULT_MEMORY_STEPS

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not self.row_cost > 0 or self.draft_cost < 0:
            raise ValueError(f"row_cost must be > 0 and draft_cost >= 0, got {self.row_cost}, {self.draft_cost}")
        if not 0 <= self.prior <= 1 or self.prior_weight <= 0 or self.memory_steps < 1:
            raise ValueError("prior must be in [0, 1], prior_weight > 0 and memory_steps >= 1")
        self._trials = [0.0] * self.max_k  # decayed counts of drafts tried at each position
        self._kept = [0.0] * self.max_k  # and of those kept

    @property
    def rates(self) -> list[float]:
        """Each position's acceptance estimate (given the drafts before it were kept)."""
        rates, base = [], self.prior
        for trials, kept in zip(self._trials, self._kept):
            base = (kept + self.prior_weight * base) / (trials + self.prior_weight)
            rates.append(base)
        return rates

    def num_tokens(self, batch_size: int) -> int:
        """Drafts per sequence for a step of ``batch_size`` sequences (0: no speculation). No side effects."""
        return choose_num_tokens(self.rates, self.max_k, max(batch_size, 1), self.row_cost, self.draft_cost)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verified proposal of ``num_drafts`` drafts, of which the first
        ``num_accepted`` were kept: a trial at each position it tried, kept before the first rejection."""
        for j in range(min(num_accepted + 1, num_drafts, self.max_k)):
            self._trials[j] += 1.0
            self._kept[j] += 1.0 if j < num_accepted else 0.0

    def end_step(self) -> None:
        """Once per step: the counts decay (old measurements fade; estimates drift to their base)."""
        keep = 1.0 - 1.0 / self.memory_steps
        self._trials = [t * keep for t in self._trials]
        self._kept = [k * keep for k in self._kept]
