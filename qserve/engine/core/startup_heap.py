"""The start-up heap out of the garbage collector's sight (what vLLM does in its API server and engine
core): once a server process has loaded, ``gc.freeze()`` moves every object alive then into a
permanent generation that collections no longer walk.

Why: a full collection walks every tracked object, and a server process holds a few hundred thousand
from its imports alone (FastAPI, pydantic, transformers, torch): 152 ms for one collection of the front
end's modules on this project's 2-core CI machine (measured, twelfth session). The collector runs one
when enough long-lived objects have accumulated, at a moment it picks: in the front end that stalls
the event loop (every stream and ``/health``), in the engine core the next step.

Knows: Python's collector. Must not know: what the process serves. Call it once, from a server
process's entry point, after loading; not from library code (a test process that builds many apps
or engines would keep its earlier ones' cyclic garbage forever).
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect what start-up left as garbage, then freeze every object still alive."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug(
        "start-up heap frozen: %d objects out of the collector's walks (%.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - start) * 1e3,
    )
