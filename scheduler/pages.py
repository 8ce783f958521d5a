"""The page pool: refcounts, the free list and the clear marks (DESIGN.md, page lifecycle).

The pool knows pages, never requests or prefixes (vLLM V1's split of block pool and cache manager).
Every operation takes an array of distinct page ids and costs O(pages touched), never O(pool size).

The clear mark of a page says "its bytes are not known to be zero or written by its owner". It is
set at construction (cache memory is allocated uninitialized) and by `free` (a page that returns to
the free list keeps whatever its last owner wrote). It is dropped in exactly two places:
`commit`, which returns the marked pages so that the caller lists them in the step's
`cleared_pages` (each marked page is therefore listed exactly once), and `overwrite`, for host
restore targets that the executor overwrites whole. `allocate` and `free` never touch a mark
except to set it: nothing is cleared at release or at reservation.

The free list is a LIFO stack: allocating and freeing are one slice of a preallocated array, and a
page freed a moment ago is the first one handed out again, so a missing clear surfaces at once in
the tests rather than after the pool has cycled.
"""

from __future__ import annotations

import numpy as np

from scheduler.errors import SchedulerError


class PagePoolError(SchedulerError, RuntimeError):
    """An operation would break the pool's bookkeeping (a double free, a leak, an exhausted pool)."""


class PagePool:
    def __init__(self, num_kv_pages: int, *, track_freed: bool = False) -> None:
        if num_kv_pages < 1:
            raise PagePoolError(f"a page pool needs at least one page, got {num_kv_pages}")
        self.num_kv_pages = num_kv_pages
        self.refcount = np.zeros(num_kv_pages, dtype=np.int32)
        self.marked = np.ones(num_kv_pages, dtype=bool)
        self._is_free = np.ones(num_kv_pages, dtype=bool)
        # Popped from the end, so page 0 is handed out first.
        self._stack = np.arange(num_kv_pages - 1, -1, -1, dtype=np.int32)
        self._top = num_kv_pages
        self._track_freed = track_freed
        self._freed: list[np.ndarray] = []
        self.cleared_total = 0
        self.marked_count = num_kv_pages

    @property
    def free_count(self) -> int:
        return self._top

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def allocate(self, n: int) -> np.ndarray:
        """Take n pages off the free list with refcount 1; their marks stay as they are."""
        if n > self._top:
            raise PagePoolError(f"asked for {n} pages but only {self._top} are free")
        pages = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self.refcount[pages] = 1
        self._is_free[pages] = False
        return pages

    def incref(self, pages: np.ndarray) -> None:
        if pages.size and self._is_free[pages].any():
            raise PagePoolError(f"cannot share free pages {pages[self._is_free[pages]].tolist()}")
        self.refcount[pages] += 1

    def share(self, pages: np.ndarray, times: int = 1) -> None:
        """incref (`times` references each) for pages the caller knows to be referenced already."""
        self.refcount[pages] += times

    def decref(self, pages: np.ndarray) -> np.ndarray:
        """Drop one reference from each page; return those nobody references any more."""
        if pages.size and (self.refcount[pages] <= 0).any():
            raise PagePoolError(f"released pages nobody holds: {pages[self.refcount[pages] <= 0].tolist()}")
        self.refcount[pages] -= 1
        return pages[self.refcount[pages] == 0]

    def free(self, pages: np.ndarray) -> None:
        """Return unreferenced pages to the free list, marked (they hold their last owner's bytes)."""
        if not pages.size:
            return
        if (self.refcount[pages] != 0).any() or self._is_free[pages].any():
            raise PagePoolError(f"cannot free pages that are referenced or already free: {pages.tolist()}")
        n = pages.shape[0]
        self._stack[self._top : self._top + n] = pages
        self._top += n
        self._is_free[pages] = True
        self.marked_count += n - int(np.count_nonzero(self.marked[pages]))
        self.marked[pages] = True
        if self._track_freed:
            self._freed.append(pages.copy())

    def commit(self, pages: np.ndarray) -> np.ndarray:
        """Pages enter a request's KV for the first time: return the marked ones and drop their marks.

        The caller must list every returned page in this step's cleared_pages.
        """
        hit = pages[self.marked[pages]]
        self.marked[hit] = False
        self.cleared_total += hit.shape[0]
        self.marked_count -= hit.shape[0]
        return hit

    def overwrite(self, pages: np.ndarray) -> None:
        """Pages a host restore overwrites whole: drop their marks without listing them."""
        self.marked_count -= int(np.count_nonzero(self.marked[pages]))
        self.marked[pages] = False

    def remark(self, pages: np.ndarray) -> None:
        """Undo `commit` for a step that never ran: the pages were (maybe) not zeroed after all."""
        self.marked_count += pages.shape[0] - int(np.count_nonzero(self.marked[pages]))
        self.marked[pages] = True

    def take_freed(self) -> np.ndarray:
        """Pages freed since the last call, in order (the debug poison list); empty unless tracked."""
        if not self._freed:
            return np.empty(0, dtype=np.int32)
        out = np.concatenate(self._freed)
        self._freed.clear()
        return out

    def free_pages(self) -> np.ndarray:
        """The free list as an array (tests and invariants only: O(pool size))."""
        return self._stack[: self._top].copy()
