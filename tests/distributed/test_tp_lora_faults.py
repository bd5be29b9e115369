"""An adapter that rank 0 reads but another rank cannot (files missing there, unreadable, another
version), under tensor parallelism on CPU (gloo, two ranks): the load fails on every rank with an
error naming the adapter, the rank and the reason, instead of the server hanging in the next
collective; the requests already running finish as they would have, and later loads still work.

Rank 1 cannot read one adapter directory (``ONLY_RANK_0``): there, the loader is pointed at a
directory that does not exist, so the real loader fails the real way. Both ways an adapter gets
loaded are tried: ``add_lora`` (``/v1/load_lora_adapter``, ``--lora-modules``) and a request naming
a new adapter. The ranks run under a deadline and gloo collectives time out after ``GROUP_TIMEOUT_S``,
so a rank stuck in a collective fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from qserve import LLM, LoRARequest
from tests.distributed.test_tp_equality import assert_same
from tests.distributed.test_tp_lora import CONFIG, PARAMS, PROMPTS, write_adapters

# two gloo processes: CI's newest job runs them, the lowest-versions job leaves them out
pytestmark = pytest.mark.slow

MODEL = "gptq-act-order"
ONLY_RANK_0 = "b"  # the adapter directory rank 1 cannot read
GROUP_TIMEOUT_S = 30  # a collective that waits longer raises (on main this is where rank 0 hung)
DEADLINE_S = 240  # both ranks, start-up included


def scenario(engine, adapters: dict[str, str], with_faults: bool) -> tuple[list, list[str], list[str]]:  # noqa: ANN001
    """A base request and one with adapter a run; meanwhile the unreadable adapter is loaded twice
    (``add_lora``, then a request naming it); then a request with adapter c joins. Returns the
    outputs in order, the errors of the two failed loads and the adapters registered at the end."""
    loras = [None, LoRARequest("a", 1, adapters["a"]), LoRARequest("c", 3, adapters["c"])]
    for i in (0, 1):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, PARAMS, lora_request=loras[i])
    engine.step()
    engine.step()  # r0 and r1 are running
    errors = []
    if with_faults:
        unreadable = LoRARequest("broken", 2, adapters[ONLY_RANK_0])
        attempts = (
            lambda: engine.add_lora(unreadable),
            lambda: engine.add_request("r-broken", {"prompt_token_ids": PROMPTS[3]}, PARAMS, lora_request=unreadable),
        )
        for attempt in attempts:
            try:
                attempt()
                errors.append("no error")
            except ValueError as err:
                errors.append(str(err))
    engine.add_request("r2", {"prompt_token_ids": PROMPTS[2]}, PARAMS, lora_request=loras[2])
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[f"r{i}"] for i in range(3)], errors, sorted(engine.list_loras())


def _unreadable_on_this_rank(directory: str) -> None:
    """Point this process's adapter loader elsewhere for ``directory`` (a path that does not exist)."""
    import qserve.lora.slots as slots

    read = slots.load_peft_adapter

    def load_peft_adapter(name, path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if os.path.normpath(path) == os.path.normpath(directory):
            path = os.path.join(os.path.dirname(path), "not-on-this-rank")
        return read(name, path, *args, **kwargs)

    slots.load_peft_adapter = load_peft_adapter


def _rank_main(rank: int, size: int, init_method: str, path: str, adapters: dict, out: str) -> None:
    from qserve.distributed.parallel_state import destroy_tp_group, init_tp_group
    from qserve.distributed.worker import BroadcastingRunner, serve_steps
    from qserve.engine.engine import Engine, EngineConfig

    result: dict = {}
    tp = None
    try:
        if rank == 1:
            _unreadable_on_this_rank(adapters[ONLY_RANK_0])
        tp = init_tp_group(rank, size, init_method, torch.device("cpu"), timeout_s=GROUP_TIMEOUT_S)
        engine = Engine(EngineConfig(path, enforce_eager=True, **CONFIG), tp=tp)
        if rank == 0:
            runner = BroadcastingRunner(engine.runner, tp)
            engine.runner = runner
            result["scenario"] = scenario(engine, adapters, with_faults=True)
            runner.stop_workers()
        else:
            serve_steps(engine.runner, tp)
        manager = engine.lora_manager
        result["registry"] = (sorted(manager.names()), sorted(manager._by_id), dict(manager._slot_of))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
        result["error"] = traceback.format_exc()
    finally:
        if tp is not None:
            destroy_tp_group(tp)
    Path(f"{out}.{rank}").write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip seconds of interpreter finalization


def run_ranks(path: str, adapters: dict, out: Path) -> list[dict]:
    """Both ranks under ``DEADLINE_S``: a rank still running then is stopped and the test fails."""
    from qserve.distributed.parallel_state import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.start_processes(_rank_main, args=(2, init_method, path, adapters, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"tensor-parallel ranks still running after {DEADLINE_S}s (a rank waits in a collective)")
    results = [pickle.loads(Path(f"{out}.{rank}").read_bytes()) for rank in range(2)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return results


def test_load_that_fails_on_one_rank_fails_on_all(tp_checkpoints, tmp_path) -> None:
    adapters = write_adapters(tmp_path / "adapters", kv_heads=2)
    want, _, want_names = scenario(LLM(tp_checkpoints[MODEL], **CONFIG).engine, adapters, with_faults=False)
    ranks = run_ranks(tp_checkpoints[MODEL], adapters, tmp_path / "results")

    got, errors, names = ranks[0]["scenario"]
    assert len(errors) == 2
    for error in errors:  # the adapter, the rank, the reason (rank 1's loader's own message)
        assert "'broken'" in error and "rank 1" in error and "not a directory" in error, error
        assert error.startswith("lora_path"), error  # the server's 400 names the field
    assert_same(want, got)  # the running requests and the later load are unaffected
    assert names == want_names == ["a", "c"]
    # Every rank holds the same adapters under the same ids in the same slots: the load that
    # succeeded on rank 0 was undone there.
    assert ranks[0]["registry"] == ranks[1]["registry"]
