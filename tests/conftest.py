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

When the session runs launch-compile tests (``tests/kernels/test_launch_compile.py``), their drives and
scripts are queued at the end of collection on two background workers, niced, and compile while the other
tests run (``pytest_collection_finish``); those tests run last (``pytest_collection_modifyitems``), so they
mostly find the compiles done.
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


LAUNCH_COMPILE_MODULE = "test_launch_compile.py"


def _is_launch_compile(item: pytest.Item) -> bool:
    return item.path.name == LAUNCH_COMPILE_MODULE


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects the slow tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
