"""The KV cache manager: the one caller of the page pool and the prefix cache.

It knows requests and their page tables (the `pages`, `npages` and `nres` columns of the batch),
where the pool knows only pages (vLLM V1's split of KVCacheManager and BlockPool). Every page a
step first writes goes through `commit` here, which hands back the marked ones: the caller lists
exactly those in the step's cleared_pages (DESIGN.md, the clearing rule). It also owns the host
slots that preemption by offload copies pages into.
"""

from __future__ import annotations

import numpy as np

from scheduler.batch import Batch
from scheduler.config import SchedulerConfig
from scheduler.errors import SchedulerStateError
from scheduler.pages import PagePool
from scheduler.prefix import PageKey, PrefixCache, PrefixHasher
from scheduler.request import Request

_I32 = np.int32


def scatter(table: np.ndarray, rows: np.ndarray, start: np.ndarray, counts: np.ndarray, values: np.ndarray) -> None:
    """table[rows[i], start[i] : start[i] + counts[i]] = the next counts[i] values, for every i."""
    total = values.shape[0]
    if not total:
        return
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    table[np.repeat(rows, counts), np.repeat(start, counts) + offsets] = values


class KVManager:
    def __init__(self, config: SchedulerConfig, batch: Batch) -> None:
        self.config = config
        self.page_size = config.page_size
        self.batch = batch
        self.pool = PagePool(config.num_kv_pages, track_freed=config.poison_freed_pages)
        self.cache = PrefixCache(self.pool)
        self.hasher = PrefixHasher(config.page_size, config.max_model_len)
        self.host_free: list[int] = list(range(config.num_host_pages - 1, -1, -1))
        self.reserved = 0  # pages in reservations, all rows together
        self._last_keyed: Request | None = None  # see _reuse_keys

    # ---------------------------------------------------------------------------- pool capacity

    def available(self) -> int:
        """Pages that can be had now: free, or evictable snapshots."""
        return self.pool.free_count + self.cache.evictable_count

    def can_get(self, k: int) -> bool:
        """Whether k pages can be had, taking back lookahead reservations if that is what it takes."""
        if k > self.available() and self.reserved:
            self.drop_reservations()
        return k <= self.available()

    def make_free(self, k: int) -> None:
        short = k - self.pool.free_count
        if short > 0:
            self.cache.evict(short)

    def take(self, k: int) -> np.ndarray:
        """k pages off the free list, evicting snapshots first if needed."""
        self.make_free(k)
        return self.pool.allocate(k)

    # ------------------------------------------------------------------------- a row's pages

    def open_pages(self, rows: np.ndarray) -> np.ndarray:
        """Each row's next token starts a page: commit one, from its reservation or fresh. Returns
        the pages to clear."""
        b = self.batch
        cols = b.npages[rows]
        bare = rows[b.nres[rows] == 0] if self.reserved else rows
        if bare.shape[0]:
            b.pages[bare, b.npages[bare]] = self.take(bare.shape[0])
            b.nres[bare] += 1
            self.reserved += bare.shape[0]
        b.nres[rows] -= 1
        self.reserved -= rows.shape[0]
        b.npages[rows] = cols + 1
        return self.pool.commit(b.pages[rows, cols])

    def grow(self, r: int, max_chunk: int, keep: int, cleared: list[np.ndarray]) -> int:
        """Size row r's next chunk to `max_chunk` and to the pages available beyond `keep`, then
        commit the pages it writes (their marked ones into `cleared`). The caller guarantees that
        the first token fits. Returns the chunk."""
        b, ps = self.batch, self.page_size
        ncomp = int(b.ncomp[r])
        npages = int(b.npages[r])
        held = npages + int(b.nres[r])
        chunk = min(int(b.ntok[r] + b.pending[r]) - ncomp, max_chunk)
        extra = -(-(ncomp + chunk) // ps) - held
        if extra > 0:
            avail = self.available() - keep
            if extra > avail:
                extra = avail
                chunk = (held + avail) * ps - ncomp
            if chunk <= 0:
                raise SchedulerStateError(f"row {r} cannot take a token: the pressure check is wrong")
            b.pages[r, held : held + extra] = self.take(extra)
            b.nres[r] += extra
            self.reserved += extra
        new_npages = -(-(ncomp + chunk) // ps)
        if new_npages > npages:
            cleared.append(self.pool.commit(b.pages[r, npages:new_npages]))
            b.nres[r] -= new_npages - npages
            self.reserved -= new_npages - npages
            b.npages[r] = new_npages
        return chunk

    def reserve_lookahead(self, rows: np.ndarray) -> None:
        """Reserve pages ahead for decodes that just used up their reservation, from free pages only."""
        b = self.batch
        rows = rows[b.nres[rows] == 0]
        max_pages = -(-(b.limit[rows] - 1) // self.page_size)
        counts = np.maximum(np.minimum(self.config.decode_lookahead, max_pages - b.npages[rows]), 0)
        total = int(counts.sum())
        if total == 0 or total > self.pool.free_count:
            return
        scatter(b.pages, rows, b.npages[rows], counts, self.pool.allocate(total))
        b.nres[rows] += counts.astype(_I32)
        self.reserved += total

    def drop_reservations(self) -> None:
        b = self.batch
        for r in np.flatnonzero(b.nres[: b.n]).tolist():
            np_, nr = int(b.npages[r]), int(b.nres[r])
            self.cache.release(b.pages[r, np_ : np_ + nr].copy())
            b.nres[r] = 0
            self.reserved -= nr

    def free_row(self, r: int) -> None:
        """Give back every page row r holds (references dropped: marked if they reach the pool)."""
        self.reserved -= int(self.batch.nres[r])
        self.cache.release(self.batch.held_pages(r))

    def uncommit(self, r: int, start: int) -> None:
        """Row r goes back to `start` computed tokens (its step never ran): the pages past them go
        back to its reservation, marked, to be listed when they are committed again. The aborted
        step's own may not have been zeroed on every rank; a page a cut step committed past its
        context was, and is listed again for nothing rather than kept unmarked in a reservation."""
        b = self.batch
        keep = -(-start // self.page_size)
        back = int(b.npages[r]) - keep
        self.pool.remark(b.pages[r, keep : keep + back])
        b.ncomp[r] = start
        b.npages[r] = keep
        b.nres[r] += back
        self.reserved += back

    # ----------------------------------------------------------------------------- host slots

    def offload(self, r: int) -> tuple[np.ndarray, tuple[int, ...]] | None:
        """Host slots for the pages of row r's computed tokens, if enough are free: (pages, slots) to
        copy. A page a cut step committed past them (zeroed, unwritten) is not copied."""
        npages = -(-int(self.batch.ncomp[r]) // self.page_size)
        if not 0 < npages <= len(self.host_free):
            return None
        slots = tuple(self.host_free[: -npages - 1 : -1])  # popped from the end, one by one
        del self.host_free[-npages:]
        return self.batch.pages[r, :npages].copy(), slots

    def restore_targets(self, k: int) -> np.ndarray:
        """Pages a host restore overwrites whole: their marks drop without a listing."""
        targets = self.take(k)
        self.pool.overwrite(targets)
        return targets

    def free_slots(self, slots) -> None:
        self.host_free.extend(slots)

    # ------------------------------------------------------------------------- prefix snapshots

    def match(self, req: Request, last_hit: tuple[Request, np.ndarray] | None) -> tuple[np.ndarray, int]:
        """The request's prefix hit (at least one token is always left to compute) and how many of
        its first pages come from the previous hit of the same admission round. Those are still
        referenced by that request, so the full pages both prompts share are known without a
        lookup; the caller takes their references (see PrefixCache.match)."""
        n_pages = (req.num_tokens - 1) // self.page_size
        if last_hit is None or not last_hit[1].shape[0]:
            return self.cache.match(self._keys(req, n_pages)), 0
        other, hit = last_hit
        shared = self._shared_pages(req, other, min(hit.shape[0], n_pages))
        if not req.page_keys and shared:
            # Keys are a function of the tokens: the shared pages' keys are the other's (which it
            # computed for its own match, so it has at least `shared`).
            req.page_keys.extend(other.page_keys[:shared])
            req.hash_state = other.page_keys[shared - 1]
            self._last_keyed = req
            if shared == n_pages == hit.shape[0]:  # all its full pages: nothing left to look up
                return hit, shared
        return self.cache.match(self._keys(req, n_pages), hit if shared == hit.shape[0] else hit[:shared]), shared

    def _shared_pages(self, req: Request, other: Request, limit: int) -> int:
        """How many of the first `limit` full pages hold the same tokens in both requests (the
        other's first `limit` pages are known tokens: it is keyed or matched that far)."""
        n = min(limit * self.page_size, self.known_tokens(req))
        mine, theirs = req.tokens[:n], other.tokens[:n]
        if mine.tobytes() == theirs.tobytes():  # the common case, at memcmp speed
            return n // self.page_size
        diff = np.flatnonzero(mine != theirs)
        return (int(diff[0]) if diff.shape[0] else n) // self.page_size

    def known_tokens(self, req: Request) -> int:
        return req.num_tokens if req.row < 0 else int(self.batch.ntok[req.row])

    def _keys(self, req: Request, n_pages: int) -> list[PageKey]:
        """Prefix keys of the request's first n_pages full pages (computed once, extended lazily)."""
        keys = req.page_keys
        if not keys and n_pages:
            self._reuse_keys(req)
            self._last_keyed = req
        if len(keys) < n_pages:
            ps = self.page_size
            new, req.hash_state = self.hasher.extend(req.hash_state, req.tokens, len(keys) * ps, n_pages * ps)
            keys.extend(new)
        return keys[:n_pages] if len(keys) > n_pages else keys

    def _reuse_keys(self, req: Request) -> None:
        """Start from the keys of the last request keyed, as far as both token streams agree.

        A key is a function of the tokens alone, so this is exact: one vectorized compare replaces
        hashing the shared part again.
        """
        last = self._last_keyed
        if last is None or not last.page_keys:
            return
        shared = self._shared_pages(req, last, len(last.page_keys))
        if shared:
            req.page_keys.extend(last.page_keys[:shared])
            req.hash_state = last.page_keys[shared - 1]

    def register(self, rows: list[int], fulls: list[int]) -> None:
        """Offer each row's full pages up to fulls[i] to the prefix cache (their writes are done).
        A decoding row that just filled one page past the keys it has needs one page hashed: those
        are hashed together in one vectorized call."""
        b, ps = self.batch, self.page_size
        reqs = [b.reqs[r] for r in rows]
        one = [
            i for i, (req, f) in enumerate(zip(reqs, fulls)) if 1 < f == len(req.page_keys) + 1 == req.num_registered + 1
        ]
        keys = {}
        if one:
            starts = np.array([(fulls[i] - 1) * ps for i in one], dtype=np.int64)
            tokens = np.stack([reqs[i].tokens[s : s + ps] for i, s in zip(one, starts.tolist())])
            new = self.hasher.next_pages([reqs[i].hash_state for i in one], tokens, starts)
            pages = b.pages[[rows[i] for i in one], [fulls[i] - 1 for i in one]].tolist()
            keys = dict(zip(one, zip(new, pages)))
        insert = self.cache.insert
        for i, (r, req, full) in enumerate(zip(rows, reqs, fulls)):
            hit = keys.get(i)
            if hit is not None:
                key, page = hit
                req.page_keys.append(key)
                req.hash_state = key
                insert(key, page)
                req.num_registered = full
            elif full > req.num_registered:
                page_keys = self._keys(req, full)
                for key, page in zip(page_keys[req.num_registered : full], b.pages[r, req.num_registered : full].tolist()):
                    insert(key, page)
                req.num_registered = full
