"""What crosses between ranks each step, both sides: rank 0's runner that broadcasts the step's
``SchedulerOutput`` before running it, and the rank>0 loop that receives and runs it.

Knows: the step protocol — rank 0 broadcasts the ``SchedulerOutput`` (plain data, pickled by
``broadcast_object_list``) or ``None`` to stop; every rank then runs the same forward, whose
collectives (all-reduce after row-parallel layers, all-gather of the logits) line up because
every rank runs the same layers on the same tokens. Only rank 0's sampled tokens are used.

LoRA: rank 0's adapter registry changes between steps (an adapter added at run time, one
forgotten when its last request finished). Rank 0 sends the changes (``LoRAChanges``, in order)
when it adds an adapter, and else before the next step; every other rank replays them on its
``LoRAManager``, which reads its own shard of an added adapter, and answers with the adds it could
not read (every rank's answer is gathered on rank 0: ``LoRAManager.publish``). Rank 0 then undoes
such an add everywhere and reports it, so every rank's registry, and thus the slots a step assigns,
stay the same as rank 0's, and a worker that cannot read an adapter never leaves its loop.
Must not know: scheduling, text, HTTP; engines; how processes are started
(``qserve.engine.tensor_parallel``, which builds each rank's engine and calls ``serve_steps``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from qserve.distributed.parallel_state import (
    DEFAULT_TIMEOUT_S,
    TPGroup,
)
from qserve.scheduler.output import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

STOP = None  # broadcast instead of a SchedulerOutput: the workers leave their loop
KEEPALIVE_S = 60.0  # most seconds between two steps sent to the workers (``BroadcastingRunner.keepalive``)


@dataclass(frozen=True, slots=True)
class LoRAChanges:
    """Rank 0's adapter registry changes since the previous step (``LoRAManager.journal``)."""

    changes: list[tuple]


class BroadcastingRunner:
    """Rank 0's runner: sends each step to the other ranks, then runs it like any runner.

    Wraps the engine's ``ModelRunner`` (everything else is delegated to it unchanged).
    """

    def __init__(self, runner: Any, tp: TPGroup) -> None:
        self.runner = runner
        self.tp = tp
        self._last_broadcast = time.monotonic()
        self._lora = getattr(runner, "lora_manager", None)
        if self._lora is not None:
            self._lora.journal = []  # recorded from now on, sent on each add and before each step
            self._lora.publish = self.send_lora_changes

    def send_lora_changes(self) -> list[tuple[int, int, str]]:
        """Send rank 0's registry changes now; returns the adds another rank could not read,
        ``(rank, lora_id, reason)`` (their registries lack them; rank 0 undoes them)."""
        changes, self._lora.journal = self._lora.journal, []
        if not changes:
            return []
        self.tp.broadcast_object(LoRAChanges(changes), src=0)
        replies = self.tp.gather_objects([])  # rank 0 replayed nothing
        return [(rank, lora_id, reason) for rank, failed in enumerate(replies) for lora_id, reason in failed]

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if self._lora is not None and self._lora.journal:
            failures = self.send_lora_changes()  # forgets only: every add was sent when made
            if failures:
                raise RuntimeError(
                    f"LoRA: adds rank 0 did not publish failed on other ranks (rank, id, reason): {failures}"
                )
        self.tp.broadcast_object(scheduler_output, src=0)
        self._last_broadcast = time.monotonic()
        return self.runner.execute(scheduler_output)

    def keepalive(self) -> None:
        """Send an empty step if none went out for ``KEEPALIVE_S``. The workers wait for the next
        step in a collective bounded by the group's timeout, so a driver idle for longer (a
        server with no requests) would lose them; the runners return at once on an empty step."""
        if time.monotonic() - self._last_broadcast >= min(KEEPALIVE_S, DEFAULT_TIMEOUT_S / 4):
            self.execute(SchedulerOutput(sequences=[], num_batched_tokens=0))

    def stop_workers(self) -> None:
        self.tp.broadcast_object(STOP, src=0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def serve_steps(runner: Any, tp: TPGroup) -> int:
    """Rank>0: run every step rank 0 broadcasts until it sends ``STOP``; returns the step count.

    The runner samples too (its result is discarded): the logits are identical on every rank,
    and only rank 0's tokens reach the scheduler.
    """
    steps = 0
    while True:
        scheduler_output = tp.broadcast_object(None, src=0)
        if scheduler_output is STOP:
            return steps
        if isinstance(scheduler_output, LoRAChanges):
            tp.gather_objects(runner.lora_manager.replay(scheduler_output.changes))
            continue
        runner.execute(scheduler_output)
        steps += 1
