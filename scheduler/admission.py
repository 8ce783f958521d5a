"""Admission: waiting requests enter the running batch first come, first served.

The head of the queue is admitted when the pages for all its known tokens (minus its prefix hit)
can be had, taking back lookahead reservations if that is what it takes; nothing behind it jumps
ahead. An offloaded request comes back with a restore into fresh pages. A request that follows a
prompt leader (the n samples of one prompt) steps aside until the leader's prompt pages are
snapshots, then comes in with a prefix hit on them.

Admissions of one plan are gathered in a Round and enter the batch together: one `allocate` and
one `commit` for all their fresh pages, one write per column, and per run of consecutive requests
whose hits are the same pages (a shared system prompt) one refcount update and one broadcast table
write. Anything that may free pages (an eviction, a reservation taken back) applies the round
first, so the pool sees the operations in the order one-at-a-time admission would give them: the
free list is a stack, so k pages allocated at once are the pages k single allocations would give.
Deferring a hit's references to the round is safe because nothing drops a reference before the
round is applied, and every page of a hit is already referenced by the request that found it.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from scheduler.batch import Batch
from scheduler.config import SchedulerConfig
from scheduler.kv_manager import KVManager, scatter
from scheduler.plan import EMPTY_I32, StepBuilder
from scheduler.request import Request, RequestState
from scheduler.stats import Counters

_I32 = np.int32


class Round:
    """Admissions decided but not yet in the batch."""

    __slots__ = ("reqs", "heads", "ncomp", "extra", "pages", "runs")

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.heads: list[int] = []  # pages each request starts with: its prefix hit or its restore
        self.ncomp: list[int] = []  # tokens whose KV those pages hold
        self.extra: list[int] = []  # fresh pages each request commits
        self.pages = 0  # their sum
        # [head pages, references the first of the run still has to take on the head's first
        # `known` pages, how many requests, whether later requests may share it]
        self.runs: list[list] = []

    def add(self, req: Request, head: np.ndarray, known: int, ncomp: int, extra: int, shared: bool) -> None:
        m = head.shape[0]
        self.reqs.append(req)
        self.heads.append(m)
        self.ncomp.append(ncomp)
        self.extra.append(extra)
        self.pages += extra
        runs = self.runs
        # known == m: the hit is the previous request's hit cut to m pages, and all of it if m is
        # that hit's length.
        if shared and m and known == m and runs and runs[-1][3] and runs[-1][0].shape[0] == m:
            runs[-1][2] += 1
        else:
            runs.append([head, known, 1, shared])


class Admitter:
    def __init__(self, config: SchedulerConfig, batch: Batch, kv: KVManager, waiting: deque[Request], counters: Counters):
        self.config = config
        self.batch = batch
        self.kv = kv
        self.waiting = waiting
        self.counters = counters

    def admit(self, budget: int, b: StepBuilder) -> None:
        """Admit waiting requests while seats, budget and pages allow; their rows and chunks go to b."""
        if not self.waiting:
            return
        ps = self.config.page_size
        seats = self.config.max_num_seqs
        prefix_cache = self.config.enable_prefix_cache
        last_hit: tuple[Request, np.ndarray] | None = None  # the previous prefix hit of this call
        rnd = Round()
        waiting, kv, pool, cache = self.waiting, self.kv, self.kv.pool, self.kv.cache
        i = 0  # waiting requests before it wait for their prompt leaders
        while i < len(waiting) and self.batch.n + len(rnd.reqs) < seats and budget > 0:
            req = waiting[i]
            if req.row >= 0:  # preempted while a step in flight still uses its pages
                break
            if req.leader is not None and self._follows(req):
                i += 1
                continue
            restore = req.state is RequestState.OFFLOADED
            if restore:
                self._apply(rnd, b)
                if not kv.can_get(-(-req.num_tokens // ps)):
                    break
                head, known, ncomp, need = self._restore(req, b)
            else:
                head, known = kv.match(req, last_hit) if prefix_cache else (EMPTY_I32, 0)
                if prefix_cache:
                    last_hit = (req, head)
                ncomp = head.shape[0] * ps
                need = -(-req.num_tokens // ps) - head.shape[0]
            chunk = min(req.num_tokens - ncomp, budget)
            extra = -(-(ncomp + chunk) // ps) - head.shape[0]
            free = pool.free_count - rnd.pages
            if need > free + cache.evictable_count or extra > free:
                self._apply(rnd, b)
                if not kv.can_get(need):
                    cache.release(head[known:])
                    break
                kv.make_free(extra)
            del waiting[i]
            self._count(req, head.shape[0], ncomp, restore)
            b.rows.append(self.batch.n + len(rnd.reqs))
            b.chunks.append(chunk)
            rnd.add(req, head, known, ncomp, extra, not restore)
            budget -= chunk
        self._apply(rnd, b)

    def admissible(self) -> bool:
        """Whether admit() may take a waiting request now. False only where it surely takes none:
        no seat is free, the first request waits for the pages a step in flight holds (preempted),
        or every request waits for its prompt leader, as admit() walks them. Pages are not asked
        (a prefix hit can make them enough): a request short of them counts as admissible."""
        if not self.waiting or self.batch.n >= self.config.max_num_seqs:
            return False
        for req in self.waiting:
            if req.row >= 0:
                return False
            if req.leader is None or not self._follows(req):
                return True
        return False

    def _follows(self, req: Request) -> bool:
        """Whether req still waits for its leader: until the pages of the prompt it can share are
        snapshots, or the leader has ended."""
        leader = req.leader
        if leader.state is RequestState.FINISHED or leader.num_registered >= (req.prompt_len - 1) // self.config.page_size:
            req.leader = None
            return False
        return True

    def _restore(self, req: Request, b: StepBuilder) -> tuple[np.ndarray, int, int, int]:
        """Fresh pages for an offloaded request's host copy, restored by this step."""
        host = req.host
        assert host is not None
        targets = self.kv.restore_targets(len(host.slots))
        b.restore_pages.append(targets)
        b.restore_slots.extend(host.slots)
        b.restored.append((req.request_id, host))
        req.host = None
        return targets, 0, host.num_computed, 0

    def _count(self, req: Request, hit_pages: int, ncomp: int, restore: bool) -> None:
        c = self.counters
        if req.preempted:
            c.preempted -= 1
        else:
            c.waiting -= 1
        if restore:
            c.restores += 1
            c.pages_restored += hit_pages
            return
        req.num_registered = hit_pages
        c.prefix_hit_pages += hit_pages
        if self.config.enable_prefix_cache:
            c.prefix_queries += req.num_tokens
            c.prefix_hits += ncomp

    def _apply(self, rnd: Round, b: StepBuilder) -> None:
        """The round's requests enter the batch: what admitting them one at a time would do, as
        one operation per column and a few per run of requests that share a hit."""
        reqs = rnd.reqs
        k = len(reqs)
        if not k:
            return
        batch, pool = self.batch, self.kv.pool
        r0 = batch.n
        r = r0
        for head, known, count, shared in rnd.runs:
            m_run = head.shape[0]
            if m_run:
                if shared and known:
                    pool.share(head[:known])
                if count > 1:
                    pool.share(head, count - 1)
                batch.pages[r : r + count, :m_run] = head
            r += count
        m = np.array(rnd.heads, dtype=_I32)
        extra = np.array(rnd.extra, dtype=_I32)
        fresh = pool.allocate(rnd.pages)
        b.cleared.append(pool.commit(fresh))
        scatter(batch.pages, np.arange(r0, r0 + k, dtype=_I32), m, extra, fresh)
        for req in reqs:
            req.state = RequestState.RUNNING
        batch.add(reqs, ncomp=rnd.ncomp, npages=m + extra)
        rnd.__init__()
