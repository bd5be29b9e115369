"""N-gram prompt lookup (vLLM's ``method: "ngram"``): draft the tokens that followed the last
time the sequence's own last n tokens appeared in it.

Knows: token ids and the n-gram sizes. Must not know: torch, models, the scheduler. Pure
Python plus numpy.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: find the most recent earlier
position where the sequence's last n tokens occur (prompt or outputs), and propose the k
tokens that followed it; the longest n that matches wins, no match gives no drafts. When the
continuation reaches the end of the sequence it goes on as an overlapping copy (a repeating
loop of period p continues for all k tokens, not just p). Each
sequence's ids are kept in a growing numpy buffer (tokens are only ever appended), so a step
copies only the tokens added since the previous one; the search itself is vectorized: the
positions holding the last token, then filtered by each earlier token of the n-gram.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from qserve.spec_decode.proposer import ProposalInput, Proposer


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """``k`` tokens following the most recent earlier occurrence of the longest suffix of
    ``tokens`` (an int64 array) whose length is in ``[min_n, max_n]``; [] when none occurs."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    # ends[i]: an earlier position (not the last) holding the last token; a match of the n-gram
    # ending there leaves at least one following token to propose.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [C]
    best: np.ndarray | None = ends if min_n <= 1 else None
    for t in range(1, min(max_n, length - 1)):
        ends = ends[ends >= t]
        ends = ends[tokens[ends - t] == tokens[length - 1 - t]]  # the n-gram's token t back matches too
        if not len(ends):
            break
        if t + 1 >= min_n:
            best = ends
    if best is None or not len(best):
        return []
    start = int(best[-1]) + 1  # the most recent match
    proposal = tokens[start : start + k].tolist()
    # The continuation ran into the end: copy on from the proposal itself (a loop of period
    # length - start repeats), as an overlapping LZ77 copy does.
    period = length - start
    while len(proposal) < k:
        proposal.append(proposal[len(proposal) - period])
    return proposal


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (ids buffer, ids in it)

    def _tokens(self, item: ProposalInput) -> np.ndarray:
        prompt, output = item.prompt_token_ids, item.output_token_ids
        total = len(prompt) + len(output)
        buffer, filled = self._buffers.get(item.request_id, (None, 0))
        if buffer is None or filled > total:  # new (or restarted with other tokens): build it
            buffer = np.empty(max(2 * total, 64), dtype=np.int64)
            buffer[: len(prompt)] = prompt
            filled = len(prompt)
        if total > len(buffer):
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:filled] = buffer[:filled]
            buffer = grown
        if filled < total:
            buffer[filled:total] = output[filled - len(prompt) :]
        self._buffers[item.request_id] = (buffer, total)
        return buffer[:total]

    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        return [
            ngram_lookup(self._tokens(item), self.min_n, self.max_n, item.max_num_tokens)
            if item.max_num_tokens > 0
            else []
            for item in batch
        ]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._buffers.pop(request_id, None)
