"""Per-sequence back-off of proposals that keep failing, so speculation that does not pay for a
sequence stops costing it verify steps.

Knows: request ids and how many drafts of each verified proposal were accepted. Must not know:
torch, the scheduler, proposers' internals. Pure Python.

Rule: after a proposal of which nothing was accepted, the sequence gets no proposal for its next
``wait`` steps, ``wait`` multiplied by ``growth`` (1, 2, 4, ... ``max_wait`` with growth 2; ``growth`` 1
keeps it at 1) while its proposals keep failing; the first accepted draft resets it. At 0% acceptance a sequence then speculates about one step in
``max_wait``; where drafts are accepted nothing changes. Outputs never depend on it (a skipped
proposal is a plain decode step).

Steps count through ``allow``, called once per sequence per proposal round whatever else keeps the
sequence from proposing; ``ready`` says, without counting, whether the next round may propose, so
the engine can leave a round that none may propose in the asynchronous order, its step uncaptured.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_WAIT_STEPS = 16
GROWTH = 2
# A proposer whose failed probe costs about a whole step (an EAGLE head: two synchronized steps, its
# catch-up over the skipped positions, its drafting) backs off harder. Measured on an H100 at batch 1
# (bench/RESULTS.md, fourteenth session): a head whose drafts all fail 0.91-0.92x no speculation with
# 2,16, 0.97x with 4,64; a good head (84% / 100% acceptance) the same steps and speed with either. An
# n-gram proposal costs only its verify rows and fails more often between hits: 4,64 held it back
# (2.30x -> 2.07x on repeated text, 47 -> 53 steps), so it keeps 2,16, as does a draft model (not measured).
EAGLE_GROWTH, EAGLE_MAX_WAIT_STEPS = 4, 64


def parse_backoff(text: str | None, default: tuple[int, int] = (GROWTH, MAX_WAIT_STEPS)) -> DraftBackoff:
    """A back-off from ``"GROWTH,MAX_WAIT"`` (QSERVE_SPEC_BACKOFF: e.g. ``"4,64"``; unset or empty:
    ``default``, the proposer's). Measured at batch 1 with a head whose drafts all fail (bench/RESULTS.md), each
    probe costs about one step (two synchronized steps, the head's catch-up over the skipped positions,
    the drafting): the cap sets what 0% acceptance costs once it is reached (about 1 / max_wait), the
    growth how soon it is reached."""
    if not text or not text.strip():
        growth, max_wait = default
        return DraftBackoff(max_wait=max_wait, growth=growth)
    try:
        growth, max_wait = (int(part) for part in text.split(","))
        return DraftBackoff(max_wait=max_wait, growth=growth)
    except ValueError as error:
        raise ValueError(
            f"QSERVE_SPEC_BACKOFF={text!r}: expected GROWTH,MAX_WAIT, two integers >= 1 (e.g. 4,64)"
        ) from error


class DraftBackoff:
    def __init__(self, max_wait: int = MAX_WAIT_STEPS, growth: int = GROWTH) -> None:
        if max_wait < 1:
            raise ValueError(f"max_wait must be >= 1, got {max_wait}")
        if growth < 1:
            raise ValueError(f"growth must be >= 1, got {growth}")
        self.max_wait = max_wait
        self.growth = growth
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
        wait = 1 if state is None else min(self.growth * state[1], self.max_wait)
        self._state[request_id] = [wait, wait]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._state.pop(request_id, None)
