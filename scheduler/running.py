"""The running rows' share of a step: which rows run, the pages their next tokens open, who is
preempted when the pool runs short, and the chunks of the rows still prefilling.

Every step, every running request takes at least one token (max_num_batched_tokens >= max_num_seqs
is required): decodes first, then prefilling rows oldest first, each chunk cut to the budget and to
the pages available beyond what later rows need for their next token. When the pool cannot give
every row the page its next token needs, lookahead reservations are given back, then the newest
running request is preempted until it can.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from scheduler.batch import Batch
from scheduler.config import SchedulerConfig
from scheduler.kv_manager import KVManager
from scheduler.plan import EMPTY_I32, StepBuilder
from scheduler.request import HostCopy, Request, RequestState
from scheduler.stats import Counters
from scheduler.steps import Steps


class RowsPlan(NamedTuple):
    every_row_decodes: bool  # every row of the batch decodes one token (the fast PREPARE)
    forwards: int  # the step's decode_steps: more than 1 only when every row decodes
    first_row_end: int  # with several forwards: the one at which the first row to end samples its last token
    dec_rows: np.ndarray  # the decoding rows, in row order (unless every row decodes)
    opened: np.ndarray  # decoding rows whose token opened a page
    budget: int  # tokens left for admissions
    deferred: bool  # a needy row waits for pages that a step in flight still holds


def _pick(sel: slice | np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The rows of sel where mask (over sel) holds."""
    return mask.nonzero()[0] if isinstance(sel, slice) else sel[mask]


class RunningRows:
    def __init__(
        self, config: SchedulerConfig, batch: Batch, kv: KVManager, steps: Steps, waiting: deque[Request],
        counters: Counters,
    ) -> None:
        self.config = config
        self.batch = batch
        self.kv = kv
        self.steps = steps
        self.waiting = waiting
        self.counters = counters

    def plan(self, b: StepBuilder, admission: bool) -> RowsPlan | None:
        """Commit the pages the running rows' next tokens open and size the prefill chunks (into b);
        None when no row can run before the step in flight ends. `admission`: a waiting request
        may be admitted by this step."""
        batch, kv, ps = self.batch, self.kv, self.config.page_size
        sel = self.candidates()
        forwards, first_row_end = self._steady_forwards(sel, admission) if self.config.num_scheduler_steps > 1 else (1, 1)
        # Rows whose next position (the last of the step's forwards) starts a page commit one: from
        # the reservation, else fresh.
        opens = batch.ncomp[sel] + (forwards - 1) >= batch.npages[sel] * ps
        deferred = EMPTY_I32
        if self.config.decode_lookahead or int(np.count_nonzero(opens)) > kv.available():
            deferred = self._relieve_pressure(b)
            if deferred is None:
                return None
            sel = self.candidates(deferred)
            opens = batch.ncomp[sel] + (forwards - 1) >= batch.npages[sel] * ps
        known = batch.ntok[sel] + batch.pending[sel] if self.steps.inflight else batch.ntok[sel]
        dec_mask = batch.ncomp[sel] == known - 1
        every = isinstance(sel, slice) and bool(dec_mask.all())
        if every:
            dec_rows = EMPTY_I32
            need = opens.nonzero()[0]
            budget = self.config.max_num_batched_tokens - batch.n
        else:
            dec_rows = _pick(sel, dec_mask)
            need = _pick(sel, opens & dec_mask)
            budget = self.config.max_num_batched_tokens - dec_rows.shape[0]
        if need.shape[0]:
            b.cleared.append(kv.open_pages(need))
        if not every:
            budget = self._plan_prefills(_pick(sel, ~dec_mask), budget, b)
        return RowsPlan(every, forwards if every else 1, first_row_end, dec_rows, need, budget, bool(deferred.shape[0]))

    def _steady_forwards(self, sel: slice | np.ndarray, admission: bool) -> tuple[int, int]:
        """How many forwards the step may run on one frame: up to num_scheduler_steps while every
        running row decodes, no request can be admitted (its admission is a step of one forward),
        no stop token is still banned, and the page each row's last forward may open can be had
        without taking anything back. No forward writes past max_model_len (every row has two
        positions left at least: it has a token to sample), and none samples past the longest
        row's last token; a row that ends sooner wastes the forwards after its end, and their
        tokens are dropped. While requests wait that cannot be admitted (no seat), none samples
        past the shortest row's last token either: its end frees the seat they wait for.
        With the forwards, the one at which the first row to end samples its last token."""
        batch, cfg = self.batch, self.config
        if admission or not isinstance(sel, slice) or batch.num_live != batch.n or not batch.n:
            return 1, 1
        n = batch.n
        ncomp = batch.ncomp[:n]
        known = batch.ntok[:n] + batch.pending[:n]
        if not (ncomp == known - 1).all():
            return 1, 1
        if batch.num_processed and (known < batch.min_len[:n]).any():
            return 1, 1
        left = batch.limit[:n] - known
        first_row_end = int(left.min())
        forwards = min(
            cfg.num_scheduler_steps, cfg.page_size, int((cfg.max_model_len - ncomp).min()),
            first_row_end if self.waiting else int(left.max()),
        )
        opening = int(np.count_nonzero(ncomp + (forwards - 1) >= batch.npages[:n] * cfg.page_size))
        return (forwards, first_row_end) if forwards == 1 or opening <= self.kv.available() else (1, 1)

    def candidates(self, deferred: np.ndarray = EMPTY_I32) -> slice | np.ndarray:
        """The rows this step may plan: live, with a token to compute (a row whose last sample is
        in flight has none), not deferred. slice(0, n) when that is every row."""
        batch = self.batch
        n = batch.n
        if batch.num_live == n and not self.steps.inflight and not deferred.shape[0]:
            return slice(0, n)
        work = batch.live[:n] & (batch.ntok[:n] + batch.pending[:n] < batch.limit[:n])
        work[deferred] = False
        return slice(0, n) if work.all() else work.nonzero()[0]

    def _relieve_pressure(self, b: StepBuilder) -> np.ndarray | None:
        """Make sure every row this step plans can get the page its next token needs: take back
        reservations, then preempt the newest running requests. With a step in flight, a victim's
        pages come back only once that step has ended: the needy rows that the pages available now
        cannot serve wait for a later step (they are returned), and None says that no row can run
        before the step in flight ends."""
        batch, kv, ps = self.batch, self.kv, self.config.page_size
        inflight = bool(self.steps.inflight)
        returning = self.steps.returning_pages() if inflight else 0
        while True:
            sel = self.candidates()
            count = sel.stop if isinstance(sel, slice) else sel.shape[0]
            if not count:
                return EMPTY_I32
            needy = _pick(sel, batch.ncomp[sel] >= (batch.npages[sel] + batch.nres[sel]) * ps)
            avail = kv.available()
            if needy.shape[0] <= avail:
                return EMPTY_I32
            if kv.reserved:
                kv.drop_reservations()
                continue
            if inflight:
                if not avail:
                    # No needy row can run in this step whoever is preempted: the others run, and
                    # the plan after the step in flight ends preempts if it must.
                    return None if needy.shape[0] == count else needy
                if needy.shape[0] <= avail + returning:
                    return needy[np.argsort(batch.arrival[needy], kind="stable")][avail:]
            newest = int(np.argmax(batch.arrival[sel]))
            victim = newest if isinstance(sel, slice) else int(sel[newest])
            if inflight:
                returning += self.steps.sole_pages(victim)
            self._preempt(victim, b)

    def _preempt(self, r: int, b: StepBuilder) -> None:
        """The request of row r leaves the batch: its KV copied to host slots by this step if enough
        are free, else dropped for recompute. It waits at the head of the queue."""
        batch = self.batch
        req = batch.reqs[r]
        assert req is not None
        off = self.kv.offload(r)
        if off is not None:
            pages, slots = off
            b.offload_pages.append(pages)
            b.offload_slots.extend(slots)
            b.offloaded.append(req.request_id)
            req.host = HostCopy(slots, int(batch.ncomp[r]))
            req.state = RequestState.OFFLOADED
            self.counters.offloads += 1
            self.counters.pages_offloaded += len(slots)
        else:
            req.state = RequestState.WAITING
        self.steps.release_row(req, offloaded=off is not None)
        req.preempted = True
        self.waiting.appendleft(req)
        self.counters.preemptions += 1
        self.counters.preempted += 1
        b.preempted += 1

    def _plan_prefills(self, rows: np.ndarray, budget: int, b: StepBuilder) -> int:
        """Chunks for running rows that are still prefilling, oldest first; returns the budget left."""
        batch, ps = self.batch, self.config.page_size
        rows = rows[np.argsort(batch.arrival[rows], kind="stable")]
        held = batch.npages[rows] + batch.nres[rows]
        first_page = (batch.ncomp[rows] >= held * ps).astype(np.int64)
        later_need = (first_page[::-1].cumsum()[::-1] - first_page).tolist()
        count = rows.shape[0]
        for i, r in enumerate(rows.tolist()):
            chunk = self.kv.grow(r, budget - (count - i - 1), later_need[i], b.cleared)
            b.rows.append(r)
            b.chunks.append(chunk)
            budget -= chunk
        return budget
