"""What crosses between ranks each step, both sides: rank 0's runner that broadcasts the step's
``SchedulerOutput`` before running it, and the rank>0 loop that receives and runs it.

Knows: the step protocol — rank 0 broadcasts the ``SchedulerOutput`` (plain data, pickled by
``broadcast_object_list``) or ``None`` to stop; every rank then runs the same forward, whose
collectives (all-reduce after row-parallel layers, all-gather of the logits) line up because
every rank runs the same layers on the same tokens. Only rank 0's sampled tokens are used.
Must not know: scheduling, text, HTTP; how processes are started (``launcher``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

from qserve.distributed.parallel_state import (
    DEFAULT_TIMEOUT_S,
    NCCL_SAFE_ENV,
    TPGroup,
    destroy_tp_group,
    init_tp_group,
    rank_device,
)
from qserve.scheduler.output import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

STOP = None  # broadcast instead of a SchedulerOutput: the workers leave their loop
KEEPALIVE_S = 60.0  # most seconds between two steps sent to the workers (``BroadcastingRunner.keepalive``)


class BroadcastingRunner:
    """Rank 0's runner: sends each step to the other ranks, then runs it like any runner.

    Wraps the engine's ``ModelRunner`` (everything else is delegated to it unchanged).
    """

    def __init__(self, runner: Any, tp: TPGroup) -> None:
        self.runner = runner
        self.tp = tp
        self._last_broadcast = time.monotonic()

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
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
        runner.execute(scheduler_output)
        steps += 1


def run_worker(rank: int, size: int, init_method: str, engine_config: Any, errors: Any) -> None:
    """Entry point of a spawned rank>0 process: join the group, build this rank's engine (model
    shard, KV caches; the same start-up as rank 0, so start-up collectives line up), serve steps.

    ``errors`` (a multiprocessing queue) receives ``(rank, traceback text)`` if anything fails.
    A clean stop ends the process with ``os._exit(0)`` once the group is left: interpreter
    finalization (torch, tokenizers) takes seconds and there is nothing left to release.
    """
    from qserve.engine.engine import Engine, resolve_device

    # Ctrl-C in a terminal reaches the whole process group; rank 0 stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(NCCL_SAFE_ENV)
    tp = None
    try:
        device = rank_device(resolve_device(engine_config.device), rank)
        tp = init_tp_group(rank, size, init_method, device)
        engine = Engine(dataclasses.replace(engine_config, device=str(device)), tp=tp)
        steps = serve_steps(engine.runner, tp)
        logger.debug("tensor-parallel rank %d stops after %d steps", rank, steps)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if tp is not None:
            destroy_tp_group(tp)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
