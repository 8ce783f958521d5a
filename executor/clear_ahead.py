"""Zeroing a step's cleared pages on the link thread, while the step before it runs (CPU caches).

DESIGN.md's rule is that a cleared page is zero before the forward that first writes it; the model's
thread zeroes a step's pages right before its forward (executor/steps.py says why there), which on a
CPU put the clear between two forwards: ~95 us a page in bench_step's gap, most of it torch's
OpenMP pool waking (docs/control_plane.md, change 56). Zeroed on the link thread once the step is
handed to a model thread still in the step before, during that step's forward, it leaves the gap.
(DESIGN.md's rule 5 places the CPU's clear on the model's stream after the input copies: a CPU has
no stream, and what the rule orders, zero before the forward and nothing else touching the pages
in between, holds, as below.)

Each step's clear is claimed once (`PendingClear`), by whichever thread comes first: the link thread
right after the hand-off, or the model's thread when it reaches the step's cache operations. A model
thread that comes while the link thread is still at it waits for the rest. A model thread that was
idle at the hand-off clears the step itself (the link thread leaves it): with nothing else to do,
torch's threads clear a prefill's pages faster than one thread's memset. The hand-off never waits
for a clear.

Early is safe only when nothing before the step's clear in DESIGN.md's order can still touch those
pages, so the link thread claims a step's clear only when:
- every step GOed before it has run its cache operations on the model's thread. An earlier step's
  offload may read a page that this step clears (evicted there, handed out here), and its debug
  poison may fill one: both run before that step's forward, so once they ran, the forwards still to
  come before this step touch only their own pages, which the scheduler hands out to no other step
  while a step in flight holds them (scheduler/steps.py);
- the step itself offloads, restores and poisons nothing: those come before its clear in the order;
- the cache is on the CPU. On a GPU the clear is a memset queued on the model's stream, ordered
  before the forward for the cost of a launch, where a clear from another thread would need a
  stream and an event of its own.
A clear that fails on the link thread is left to the model's thread, which fails the step if it
fails there too, as any failed cache operation does (a REJECT, the rank ends).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from executor.cache import KVCache
from executor.options import ExecutorOptions
from protocol.frames import Prepare

logger = logging.getLogger("tp_runtime.executor")


class PendingClear:
    """A staged step's cleared pages, zeroed once, by whichever of a rank's threads claims them first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def claim(self, clear: Callable[[], None]) -> bool:
        """Runs `clear` unless it ran already (waiting for a claim in progress); True when this call
        ran it. A clear that raises leaves the pages to the next claim."""
        with self._lock:
            if self._done:
                return False
            clear()
            self._done = True
            return True


class ClearAhead:
    """Shared by a rank's two threads: the model's reports each step whose cache operations ran,
    the link's claims the clears of a step it has handed over, when it may."""

    def __init__(self, cache: KVCache, options: ExecutorOptions) -> None:
        self._cache = cache
        self._enabled = cache.device.type == "cpu" and not options.debug_skip_clears
        self._poisons = options.debug_poison_freed
        # The last step whose cache operations ran on the model's thread: one int, written there
        # and read on the link thread.
        self._operated = -1

    def operated(self, step: int) -> None:
        """On the model's thread: step `step`'s cache operations ran."""
        self._operated = step

    def clear(self, step: int, prepare: Prepare, pending: PendingClear) -> bool:
        """On the link thread, once step `step` is handed over: its cleared pages zeroed now when
        that is safe (the module says when) and the model's thread has not claimed them; True when
        this call zeroed them."""
        if not self._enabled or not prepare.cleared_pages.size:
            return False
        if prepare.offload_pages.size or prepare.restore_pages.size or (self._poisons and prepare.poison_pages.size):
            return False
        # Step ids go up by one from step to step; a step refused or aborted in between never runs
        # here, and then the check fails safe (the model's thread clears).
        if self._operated != step - 1:
            return False
        try:
            return pending.claim(lambda: self._cache.clear_pages_beside(prepare.cleared_pages))
        except Exception:  # noqa: BLE001 - the model's thread clears them, and fails the step if it fails too
            logger.exception("clearing the pages of step %d ahead failed; the model's thread clears them", step)
            return False
