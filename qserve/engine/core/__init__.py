"""The engine core in its own process (``qserve serve``'s default on CUDA): HTTP, tokenization, detokenization, stop
strings and grammar checks stay in the front end; the core owns every hosted model's engine,
the scheduler and the shared page pool, and talks to the front end over ZMQ in msgspec-encoded
batches of token ids.

Modules, one idea each: ``messages`` (what crosses the socket), ``core_engine`` (the core's
``Engine``: token ids and finish reasons out, no text), ``core`` (the core process's loop, for one
front end or several), ``process`` (starting it), ``output_processor`` (the front end's half of a
step: text, stop strings, ``RequestOutput``s), ``client`` (the front end's ``AsyncEngine``-shaped
handle on the core process).

Switch: ``QSERVE_ENABLE_MULTIPROCESSING`` (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``): ``1`` makes
``qserve serve`` start the core process, ``0`` keeps the engine in the server's process; unset, the
command decides (``qserve.commands.serve``: the core process on CUDA where it is supported, measured
on the H100 against one process; in one process on CPU). ``qserve serve --api-server-count N`` with
N > 1 implies it (N front ends, one core). Must not know: HTTP, FastAPI, Prometheus.
"""

from __future__ import annotations

import os

ENABLE_MULTIPROCESSING_ENV = "QSERVE_ENABLE_MULTIPROCESSING"


def multiprocessing_setting() -> bool | None:
    """``QSERVE_ENABLE_MULTIPROCESSING``: True (1 / true / yes / on: the separate engine-core process),
    False (0 / false / no / off: one process), None (unset or empty: the caller's default). Anything
    else is refused, naming the variable."""
    value = os.environ.get(ENABLE_MULTIPROCESSING_ENV, "").strip().lower()
    if value == "":
        return None
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${ENABLE_MULTIPROCESSING_ENV}={value!r}: use 1 (separate engine-core process) or 0")
