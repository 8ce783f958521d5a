"""Prefix snapshots: full KV pages kept for reuse by later requests with the same token prefix.

A full page is named by a key of its whole token prefix (every token from position 0 to the
page's end), so a hit on page i implies the same tokens at the same positions in pages 0..i: the
KV is the same. Pages are shared zero-copy: a hit adds a reference. A cached page that nobody
references sits in an LRU list and is evicted, back to the free pool and marked, when the pool runs
short; a page whose references drop to zero and that holds no snapshot goes straight to the pool.

Keys: a keyed polynomial hash of the prefix, two independent 64-bit lanes with per-position random
weights drawn from os.urandom at start-up, over token id + 1 (so that every position counts: with
the ids themselves a page of token 0 would add nothing and take its predecessor's key). For any two
different prefixes a collision has probability about 2**-94 (token ids are < 2**31), the weights are
never revealed, and the whole chain of a prompt is one numpy cumsum instead of one Python hash per
page.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from scheduler.pages import PagePool

PageKey = tuple[int, int]


class PrefixHasher:
    def __init__(self, page_size: int, max_len: int, seed: int | None = None) -> None:
        self.page_size = page_size
        rng = np.random.default_rng(seed if seed is not None else int.from_bytes(os.urandom(16), "little"))
        self._w = rng.integers(0, 2**64, size=(2, max_len), dtype=np.uint64, endpoint=False)

    def extend(
        self, state: PageKey, tokens: np.ndarray, start: int, stop: int
    ) -> tuple[list[PageKey], PageKey]:
        """Keys of the full pages in tokens[start:stop] (start on a page boundary), chained on `state`.

        `state` is the pair of running sums at `start` ((0, 0) at position 0); the new one is returned.
        """
        ps = self.page_size
        n_pages = (stop - start) // ps
        if n_pages <= 0:
            return [], state
        end = start + n_pages * ps
        terms = (tokens[start:end].astype(np.uint64) + 1) * self._w[:, start:end]
        sums = np.cumsum(terms, axis=1, dtype=np.uint64)[:, ps - 1 :: ps]
        sums += np.array(state, dtype=np.uint64)[:, None]
        k0 = sums[0].tolist()
        k1 = sums[1].tolist()
        keys = list(zip(k0, k1))
        return keys, keys[-1]

    def next_pages(self, states: list[PageKey], tokens: np.ndarray, starts: np.ndarray) -> list[PageKey]:
        """`extend` over exactly one page for each of many sequences at once: the key of the page
        tokens[i] (ps tokens from position starts[i]) chained on states[i]."""
        cols = starts[:, None] + np.arange(self.page_size)
        terms = (tokens.astype(np.uint64) + 1)[None] * self._w[:, cols]
        sums = terms.sum(axis=2, dtype=np.uint64) + np.array(states, dtype=np.uint64).T
        return list(zip(sums[0].tolist(), sums[1].tolist()))


class PrefixCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        self.evictions_total = 0

    @property
    def cached_count(self) -> int:
        return len(self._key_of)

    @property
    def evictable_count(self) -> int:
        return len(self._lru)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def evictable_pages(self) -> list[int]:
        """Unreferenced snapshot pages, first to be evicted first."""
        return list(self._lru)

    def match(self, keys: list[PageKey], known: np.ndarray | None = None) -> np.ndarray:
        """Take a reference on the longest cached run of pages named by keys[0], keys[1], ...

        `known`, when given, are the pages of keys[:len(known)], found by an earlier match that
        still holds its references (so none of them can have been evicted or re-keyed since):
        requests sharing a system prompt are admitted together, and this skips their common part.
        The caller takes the references on `known` (an admission round takes them all at once).
        """
        start = 0 if known is None else known.shape[0]
        if start and start >= len(keys):
            return known
        pages: list[int] = []
        page_of = self._page_of
        for i in range(start, len(keys)):
            page = page_of.get(keys[i])
            if page is None:
                break
            pages.append(page)
        found = np.array(pages, dtype=np.int32) if pages or not start else known[:0]
        if pages:
            lru = self._lru
            if lru:
                for page in found[self.pool.refcount[found] == 0].tolist():
                    del lru[page]
            self.pool.incref(found)
        if not start:
            return found
        return np.concatenate((known, found)) if pages else known

    def insert(self, key: PageKey, page: int) -> None:
        """Offer a full, written page as the snapshot for key (first writer wins)."""
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def release(self, pages: np.ndarray) -> None:
        """Drop one reference from each page (given in page-table order).

        Unreferenced snapshots join the LRU list deepest page first, so a chain is evicted from its
        tail and its head stays matchable longest; other unreferenced pages go back to the pool.
        """
        if not pages.size:
            return
        dropped = self.pool.decref(pages)
        if not dropped.size:
            return
        key_of = self._key_of
        if not key_of:
            self.pool.free(dropped)
            return
        loose = []
        for page in dropped[::-1].tolist():
            if page in key_of:
                self._lru[page] = None
            else:
                loose.append(page)
        if loose:
            self.pool.free(np.array(loose, dtype=np.int32))

    def evict(self, n: int) -> int:
        """Free up to n unreferenced snapshot pages, least recently released first; return how many."""
        n = min(n, len(self._lru))
        if n <= 0:
            return 0
        victims = [self._lru.popitem(last=False)[0] for _ in range(n)]
        for page in victims:
            del self._page_of[self._key_of.pop(page)]
        self.pool.free(np.array(victims, dtype=np.int32))
        self.evictions_total += n
        return n
