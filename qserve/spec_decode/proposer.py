"""The one interface every proposer of draft tokens implements (the engine builds each: n-gram
lookup, a draft model and an EAGLE head, the latter two sharing its page pool).

Knows: what a proposer is given (each sequence's token ids and how many drafts it may propose)
and what it returns (up to that many token ids per sequence, possibly none). Must not know: the
scheduler's queues, KV pages, sampling or how drafts are verified: a proposer only guesses; the
target model's rejection sampling keeps the output distribution exact whatever it guesses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ProposalInput:
    """One sequence to propose for: its id (for per-sequence state), every token id it has
    (prompt then outputs; shared lists, read-only) and the most drafts it may get."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    max_num_tokens: int
    sampling_params: Any = None  # the request's (a draft model applies its penalties and logit_bias)


@dataclass(frozen=True, slots=True)
class DeviceDrafts:
    """Drafts a proposer left on the device (no host sync): row ``rows[request_id]`` of ``drafts``
    holds that sequence's drafts in its first columns (as many as its count in the proposal)."""

    drafts: Any  # torch.Tensor int64 [rows, k_max] on the device
    rows: dict[str, int]


class Proposer(ABC):
    @abstractmethod
    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        """Draft tokens for each input, in order (``len(result[i]) <= batch[i].max_num_tokens``)."""

    def propose_on_device(self, batch: Sequence[ProposalInput]) -> tuple[list[int], DeviceDrafts | None] | None:
        """Drafts left on the device: (how many each input gets, in order; where they are, None when
        none gets any). None: this proposer cannot (the caller asks ``propose``)."""
        return None

    def forget(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - optional hook
        """Drop any state kept for these (finished) sequences."""
