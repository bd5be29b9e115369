"""Test setup: on a machine without CUDA, Triton kernels run through the interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined — ours, and
``triton.language``'s own (``tl.cdiv`` is one): a library that imports triton at import time
(peft does) defines those while pytest collects the test modules. So this is the root conftest,
which pytest loads before it collects anything; in ``tests/kernels/conftest.py`` it came after
``tests/integration/test_lora_peft.py`` had been collected, and every interpreted kernel calling
``tl.cdiv`` failed ("Cannot call @triton.jit'd outside of the scope of a kernel"). The variable
changes nothing else on CPU: the engine runs Triton only on CUDA devices.

Triton 3.6's interpreter turns a scalar into a Python int with ``int(array_of_shape_(1,))``,
which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted"), so every loop with
a run-time bound fails there. ``_fix_interpreter_index`` re-registers ``__index__`` to read the
single element instead; it touches nothing outside interpreter runs.

``QSERVE_CI_SLOW_COUNT=<file>`` (set by ``.ci/run``'s lowest job): the run writes to that file how many
CPU tests it collected marked ``slow``, before ``-m`` deselects them. The lowest job runs the others and
checks the newest job will have some to run, without a second collection of the whole suite (~14 s).

Tests in ``INTERPRETED_MODULES`` that are not ``gpu`` tests get the ``interpreted`` marker: they run
Triton kernels through the interpreter to check their numerics. The lowest CI job leaves them to the
newest (``-m "... and not interpreted"``); it still compiles every launch the engine makes under its
Triton (the device's 3.6: ``test_launch_compile.py``) and runs the PTX / SASS tests.

When the session runs launch-compile tests (``tests/kernels/test_launch_compile.py``), their drives and
scripts are queued at the end of collection on two background workers, niced, and compile while the other
tests run (``pytest_collection_finish``); those tests run last (``pytest_collection_modifyitems``), so they
mostly find the compiles done.

Under pytest-xdist (addopts' ``-n auto``), each worker's torch gets the cores divided by the workers as its
OpenMP threads (``OMP_NUM_THREADS``, set in the controller before it starts the workers, unless set already;
the servers, engine cores, ranks and scripts the tests start inherit it). With torch's default, a thread per
core in every worker and in every process a test starts, OpenMP's spinning threads fought over CI's two cores:
the same 53 tests (EAGLE, engine-core process, SIGTERM, MoE families) on two workers used 143 CPU-s in 86 s,
and 71 CPU-s in 68 s with one thread each (tiny models gain nothing from a second thread).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch


def _fix_interpreter_index() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_qserve_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._qserve_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _fix_interpreter_index()


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller, before it starts the workers: each worker's OpenMP threads (see the docstring)."""
    workers = config.getoption("numprocesses", None)
    if workers and not hasattr(config, "workerinput"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))


LAUNCH_COMPILE_MODULE = "test_launch_compile.py"

# The kernel test modules whose CPU tests run Triton kernels through the interpreter (numerics, shapes).
INTERPRETED_MODULES = frozenset(
    f"test_{name}.py"
    for name in (
        "attention",
        "attention_alibi",
        "attention_int4",
        "elementwise",
        "lora",
        "moe",
        "moe_mma",
        "moe_router",
        "reference_attention_bounded",
        "w4a16_ops",
        "w4a16_mma",
    )
)


def _is_launch_compile(item: pytest.Item) -> bool:
    return item.path.name == LAUNCH_COMPILE_MODULE


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects the slow tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = sorted(name for name in INTERPRETED_MODULES if not (Path(__file__).parent / "kernels" / name).exists())
    if missing:  # a renamed module would otherwise leave the lowest job running it, or the marker naming nothing
        raise pytest.UsageError(f"INTERPRETED_MODULES names no file in tests/kernels: {missing}")
    interpreted = pytest.mark.interpreted
    for item in items:
        if item.path.name in INTERPRETED_MODULES and item.path.parent.name == "kernels":
            if item.get_closest_marker("gpu") is None:
                item.add_marker(interpreted)
    target = os.environ.get("QSERVE_CI_SLOW_COUNT")
    if target:
        cpu = [item for item in items if not item.get_closest_marker("gpu") and not item.get_closest_marker("peer")]
        Path(target).write_text(str(sum(1 for item in cpu if item.get_closest_marker("slow"))))
    # the launch-compile tests last: their compiles, started at the end of collection, run meanwhile
    items[:] = [item for item in items if not _is_launch_compile(item)] + [i for i in items if _is_launch_compile(i)]


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the session runs launch-compile tests (tests/kernels/test_launch_compile.py), start their
    drives and scripts now, niced, so that they compile while the other tests run; the tests collect them."""
    module = next((item.module for item in session.items if _is_launch_compile(item)), None)
    if module is None or hasattr(session.config, "workerinput"):  # an xdist worker: each test starts its own
        return
    from tests.helpers.result_scripts import BackgroundPool

    tmp = Path(tempfile.mkdtemp(prefix="qserve-launches-"))
    pool = BackgroundPool(workers=2)
    units, scripts = module.start_early(session.items, tmp, pool)
    session.config.stash[module.EARLY_UNITS] = units
    session.config.stash[module.EARLY_SCRIPTS] = scripts

    def stop() -> None:  # an interrupted session leaves no drive behind
        pool.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    session.config.add_cleanup(stop)
