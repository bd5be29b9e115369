"""Per-sequence back-off of proposals that keep failing, so speculation that does not pay for a
sequence stops costing it verify steps.

Knows: request ids and how many drafts of each verified proposal were accepted. Must not know:
torch, the scheduler, proposers' internals. Pure Python.

Rule: after a proposal of which nothing was accepted, the sequence gets no proposal for its next
``wait`` steps, ``wait`` doubling (1, 2, 4, ... ``max_wait``) while its proposals keep failing;
the first accepted draft resets it. At 0% acceptance a sequence then speculates about one step in
``max_wait``; where drafts are accepted nothing changes. Outputs never depend on it (a skipped
proposal is a plain decode step).

Steps count through ``allow``, called once per sequence per proposal round whatever else keeps the
sequence from proposing; ``ready`` says, without counting, whether the next round may propose, so
the engine can leave a round that none may propose in the asynchronous order, its step uncaptured.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_WAIT_STEPS = 16


class DraftBackoff:
    def __init__(self, max_wait: int = MAX_WAIT_STEPS) -> None:
        if max_wait < 1:
            raise ValueError(f"max_wait must be >= 1, got {max_wait}")
        self.max_wait = max_wait
        self._state: dict[str, list[int]] = {}  # request id -> [steps still to skip, current wait]

    def allow(self, request_id: str) -> bool:
        """Whether the sequence may get a proposal this step (a refused call counts one step)."""
        state = self._state.get(request_id)
        if state is None or state[0] == 0:
            return True
        state[0] -= 1
        return False

    def ready(self, request_id: str) -> bool:
        """Whether the next ``allow`` of the sequence will say yes (no step counted)."""
        state = self._state.get(request_id)
        return state is None or state[0] == 0

    def observe(self, request_id: str, num_accepted: int) -> None:
        """A verified proposal of the sequence, of which ``num_accepted`` drafts were kept."""
        if num_accepted:
            self._state.pop(request_id, None)
            return
        state = self._state.get(request_id)
        wait = 1 if state is None else min(2 * state[1], self.max_wait)
        self._state[request_id] = [wait, wait]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._state.pop(request_id, None)
