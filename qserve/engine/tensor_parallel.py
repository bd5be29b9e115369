"""Start a tensor-parallel engine: one process per device, rank 0 in the calling process.

Knows: how to spawn the rank>0 processes (``torch.multiprocessing`` spawn context, a free TCP
port on 127.0.0.1 for the rendezvous), which backend and device each rank gets (gloo on CPU —
every rank on the CPU; NCCL on CUDA — rank r on ``cuda:r``, with ``NCCL_SAFE_ENV`` set in every
process), how each rank builds its engine (``run_worker``: the same start-up as rank 0, so the
start-up collectives line up), and how to stop them. Must not know: what the engine does inside.

It lives beside the engine, not in ``qserve.distributed``, because it builds engines; the
package below it only knows process groups, sharded layers and the step protocol.

Rank 0 runs the engine and its scheduler (``TensorParallelEngine.engine`` is an ordinary
``Engine``); every rank holds a model shard and a runner (``qserve.distributed.worker``). CUDA graphs are not
captured under tensor parallelism yet (``enforce_eager`` is forced on).

Because processes are spawned, a script that starts one must guard its entry point with
``if __name__ == "__main__":`` (as with any ``multiprocessing`` spawn user).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import signal
import sys
import traceback
import weakref
from typing import Any

import torch
import torch.multiprocessing as mp

from qserve.distributed.parallel_state import (
    NCCL_SAFE_ENV,
    TPGroup,
    destroy_tp_group,
    free_port,
    init_tp_group,
    rank_device,
)
from qserve.distributed.sharding import per_rank_config
from qserve.distributed.worker import BroadcastingRunner, serve_steps
from qserve.engine.engine import Engine, resolve_device
from qserve.model.registry import read_model_config

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30


class TensorParallelEngine:
    """Rank 0's engine plus the processes of the other ranks. ``shutdown()`` stops them all."""

    def __init__(self, engine: Any, tp: TPGroup, processes: list[Any]) -> None:
        self.engine = engine
        self.tp = tp
        self.processes = processes
        self._closed = False

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them, leave the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.runner.stop_workers()
        except Exception:  # a broken group: the workers are terminated below
            logger.warning("could not tell the tensor-parallel workers to stop; terminating them", exc_info=True)
        _stop_processes(self.processes)
        destroy_tp_group(self.tp)


def _stop_processes(processes: list[Any]) -> None:
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(JOIN_TIMEOUT_S)


def _worker_errors(errors: Any) -> str:
    lines = []
    while True:
        try:
            rank, text = errors.get(timeout=1.0)
        except queue.Empty:
            break
        lines.append(f"rank {rank}:\n{text}")
    return "\n".join(lines)


def launch_engine(config: Any, tensor_parallel_size: int) -> TensorParallelEngine:
    """Spawn ranks 1..N-1, join the group as rank 0 and build rank 0's engine (an ``EngineConfig``)."""
    size = int(tensor_parallel_size)
    if size < 2:
        raise ValueError(f"launch_engine needs tensor_parallel_size >= 2, got {size}")
    base_device = resolve_device(config.device)
    if base_device.type == "cuda":
        available = torch.cuda.device_count()
        if available < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices, {available} visible")
        if base_device.index not in (None, 0):
            raise ValueError(f"tensor parallelism uses cuda:0..cuda:{size - 1}; got device={config.device!r}")
    elif base_device.type != "cpu":
        raise ValueError(f"tensor parallelism runs on cuda or cpu, not {base_device.type}")
    check_partition(config, size)
    if base_device.type == "cuda" and not config.enforce_eager:
        logger.info("tensor parallelism: CUDA graphs are not captured yet (running eagerly)")
    config = dataclasses.replace(config, enforce_eager=True)
    os.environ.update(NCCL_SAFE_ENV)  # inherited by the spawned ranks; rank 0 needs it as well

    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    processes = []
    for rank in range(1, size):
        process = ctx.Process(
            target=run_worker, args=(rank, size, init_method, config, errors), name=f"qserve-tp{rank}", daemon=True
        )
        process.start()
        processes.append(process)
    tp = None
    try:
        device = rank_device(base_device, 0)
        tp = init_tp_group(0, size, init_method, device)
        engine = Engine(dataclasses.replace(config, device=str(device)), tp=tp)
    except BaseException as err:
        for process in processes:
            process.join(5)  # a worker that failed the same way has reported it by now
        detail = _worker_errors(errors)
        for process in processes:
            if process.is_alive():
                process.terminate()
        _stop_processes(processes)
        if tp is not None:
            destroy_tp_group(tp)
        if detail and not isinstance(err, ValueError):
            raise RuntimeError(f"tensor-parallel start-up failed: {err}\nworker errors:\n{detail}") from err
        raise
    engine.runner = BroadcastingRunner(engine.runner, tp)
    handle = TensorParallelEngine(engine, tp, processes)
    atexit.register(_shutdown_ref, weakref.ref(handle))
    logger.info("tensor parallel: %d ranks (%s), rank 0 drives", size, tp.backend)
    return handle


def check_partition(config: Any, tensor_parallel_size: int) -> None:
    """Refuse a model that does not split over the ranks (heads, intermediate sizes, experts:
    ``sharding.per_rank_config``), from its ``config.json``, before any process starts."""
    try:
        per_rank_config(read_model_config(config.model), tensor_parallel_size, config.enable_expert_parallel)
    except ValueError as err:
        raise ValueError(f"{config.model}: {err}") from err


def _shutdown_ref(ref: weakref.ref) -> None:
    handle = ref()
    if handle is not None:
        handle.shutdown()


def run_worker(rank: int, size: int, init_method: str, engine_config: Any, errors: Any) -> None:
    """Entry point of a spawned rank>0 process: join the group, build this rank's engine (model
    shard, KV caches; the same start-up as rank 0, so start-up collectives line up), serve steps.

    ``errors`` (a multiprocessing queue) receives ``(rank, traceback text)`` if anything fails.
    A clean stop ends the process with ``os._exit(0)`` once the group is left: interpreter
    finalization (torch, tokenizers) takes seconds and there is nothing left to release.
    """
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
