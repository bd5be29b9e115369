"""Counters of speculative decoding, as vLLM exports them (``vllm:spec_decode_*``).

Knows: what a verified draft adds to the counters, and how they travel in a host's ``stats()``
numbers (``stats_entries``: flat int keys, so the engine-core process sends them as it sends the
others). Must not know: Prometheus, the engine, torch.
A "draft" is one sequence's proposal verified in one step (vLLM's ``num_drafts``); accepted
tokens are the drafts the rejection sampler kept, counted before stop conditions cut the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at position i (0-based) was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verified draft of ``num_draft_tokens`` tokens, of which the first
        ``num_accepted`` were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


# stats() keys (qserve.server.spec_metrics reads them back); per position: PER_POS_PREFIX + str(i)
DRAFTS_KEY = "spec_decode_num_drafts"
DRAFT_TOKENS_KEY = "spec_decode_num_draft_tokens"
ACCEPTED_KEY = "spec_decode_num_accepted_tokens"
PER_POS_PREFIX = "spec_decode_num_accepted_tokens_pos_"


def stats_entries(stats: SpecDecodeStats | None) -> dict[str, int]:
    """The counters as ``stats()`` entries of one model; none when it does not speculate."""
    if stats is None:
        return {}
    entries = {
        DRAFTS_KEY: stats.num_drafts,
        DRAFT_TOKENS_KEY: stats.num_draft_tokens,
        ACCEPTED_KEY: stats.num_accepted_tokens,
    }
    entries.update({f"{PER_POS_PREFIX}{i}": n for i, n in enumerate(stats.accepted_per_pos)})
    return entries
