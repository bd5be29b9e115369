"""qserve.engine.core.startup_heap: a server process's start-up heap is frozen out of the collector's
walks, after the start-up's cyclic garbage has been collected (frozen garbage would never be freed)."""

from __future__ import annotations

import gc
import weakref

from qserve.engine.core.startup_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_garbage_is_collected_and_the_live_heap_frozen() -> None:
    garbage_a, garbage_b = _Node(), _Node()
    garbage_a.other, garbage_b.other = garbage_b, garbage_a  # a cycle only the collector frees
    dead = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    alive = _Node()
    alive.other = alive
    try:
        freeze_startup_heap()
        assert dead() is None, "start-up garbage must be collected before the freeze"
        assert gc.get_freeze_count() > 0
        tracked = {id(o) for o in gc.get_objects()}  # what collections still walk
        assert id(alive) not in tracked, "a live start-up object is left in the collector's generations"
    finally:
        gc.unfreeze()  # this test process builds many engines: their garbage must stay collectable
