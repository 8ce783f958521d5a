"""tp_runtime/heap.py: what start-up built is left out of later collections, what it left behind
is collected first."""

from __future__ import annotations

import gc
import weakref

from tp_runtime.heap import freeze_startup_objects


class Node:
    """An object in a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_startup_objects_are_frozen_after_startup_garbage_is_collected() -> None:
    assert gc.get_freeze_count() == 0  # the unfreeze below must not thaw what something else froze
    garbage, kept = Node(), Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_startup_objects()
        assert gone() is None  # collected, not frozen for ever
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # frozen: out of every collection
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
