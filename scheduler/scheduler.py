"""The scheduler: admission, continuous batching, chunked prefill, preemption, step plans.

Every step, every running request takes at least one token (max_num_batched_tokens >= max_num_seqs is
required), so no running request can starve; when the pool cannot give each of them the page its
next token needs, the newest running request is preempted (offloaded to host slots when enough are
free, else dropped for recompute) until it can. Admission is first come, first served (admission.py).
No request that passed `add_request` is ever dropped: a request that fits the pool alone always
progresses once it is the oldest.

This module is the facade: requests come in, steps go out, results come back. The running rows
live in batch.py, their pages in kv_manager.py, the PREPARE is assembled in plan.py, and what
happens when a step ends is in steps.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from protocol.frames import Result
from scheduler.admission import Admitter
from scheduler.batch import Batch
from scheduler.config import SchedulerConfig
from scheduler.errors import AdmissionError, SchedulerConfigError, SchedulerStateError
from scheduler.kv_manager import KVManager
from scheduler.pages import PagePool
from scheduler.plan import EMPTY_I32, StepBuilder, StepPlan, assemble
from scheduler.prefix import PrefixCache
from scheduler.request import HostCopy, Request, RequestOutput, RequestState, SamplingParams, max_kv_len
from scheduler.stats import Counters, RequestView, SchedulerStats
from scheduler.steps import Steps

__all__ = [
    "AdmissionError", "RequestOutput", "RequestView", "Scheduler", "SchedulerConfig", "SchedulerConfigError",
    "SchedulerStateError", "SchedulerStats", "StepPlan",
]

_I32 = np.int32


def _pick(sel: slice | np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The rows of sel where mask (over sel) holds."""
    return np.flatnonzero(mask) if isinstance(sel, slice) else sel[mask]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.batch = Batch(config.max_num_seqs, config.max_pages_per_seq)
        self.kv = KVManager(config, self.batch)
        self.counters = Counters()
        self._eos = frozenset(config.eos_token_ids)
        self._requests: dict[int, Request] = {}
        self._waiting: deque[Request] = deque()
        self._admitter = Admitter(config, self.batch, self.kv, self._waiting, self.counters)
        self._steps = Steps(self)
        self._arrivals = 0

    @property
    def pool(self) -> PagePool:
        return self.kv.pool

    @property
    def cache(self) -> PrefixCache:
        return self.kv.cache

    # ----------------------------------------------------------------------------------- requests

    def add_request(self, request_id: int, prompt_token_ids: Sequence[int] | np.ndarray, params: SamplingParams) -> None:
        if request_id in self._requests:
            raise AdmissionError(f"request id {request_id} is already in use")
        if not 0 <= request_id < 2**63:
            raise AdmissionError(f"request id {request_id} is outside [0, 2**63)")
        try:
            req = Request.create(request_id, prompt_token_ids, params, self._arrivals, self._eos)
        except (OverflowError, ValueError, TypeError) as exc:
            raise AdmissionError(f"request {request_id} has an invalid prompt: {exc}") from exc
        n = req.prompt_len
        if n and req.tokens[:n].min() < 0:
            raise AdmissionError(f"request {request_id} has a negative token id in its prompt")
        self.check_admission(n, params)
        self._arrivals += 1
        self._requests[request_id] = req
        self._waiting.append(req)
        self.counters.waiting += 1

    def check_admission(self, prompt_len: int, params: SamplingParams) -> None:
        """Raises AdmissionError for a request that could never fit. It reads only the immutable
        config, so the frontend may call it from its own thread to answer 400 at once."""
        cfg = self.config
        if prompt_len == 0:
            raise AdmissionError("empty prompt: a request must hold at least one token")
        if prompt_len + params.max_tokens > cfg.max_model_len:
            raise AdmissionError(
                f"prompt of {prompt_len} tokens + max_tokens {params.max_tokens} exceeds max_model_len "
                f"{cfg.max_model_len}"
            )
        pages = -(-max_kv_len(prompt_len, params.max_tokens) // cfg.page_size)
        if pages > cfg.num_kv_pages:
            raise AdmissionError(
                f"a request of {prompt_len} + {params.max_tokens} tokens needs {pages} pages of "
                f"{cfg.page_size} tokens but the cache has only {cfg.num_kv_pages}"
            )

    def cancel(self, request_id: int) -> None:
        """End a request with "cancelled". Its output is in drain_outputs() at once; a token a step
        in flight samples for it is never emitted. Unknown or finished ids are ignored: a client
        may go away after its last token."""
        self._client_end(request_id, "cancelled")

    def finish(self, request_id: int) -> None:
        """The frontend saw a stop string: end the request with "stop" (as cancel does)."""
        self._client_end(request_id, "stop")

    def _client_end(self, request_id: int, reason: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.state is not RequestState.FINISHED:
            self._steps.end(req, reason, None, self._steps.outputs)

    def drain_outputs(self) -> list[RequestOutput]:
        """Outputs made outside on_result/on_abort (cancel and finish)."""
        return self._steps.drain()

    def has_work(self) -> bool:
        """Requests to run, steps in flight, or outputs waiting in drain_outputs."""
        return bool(self.batch.n or self._waiting or self._steps.busy())

    # ----------------------------------------------------------------------------------- planning

    def plan_step(self) -> StepPlan | None:
        """The next step, or None when nothing can run now (with a step in flight: nothing that can
        run before that step's RESULT is in)."""
        self._steps.check_can_plan()
        b = StepBuilder()
        batch, kv, ps = self.batch, self.kv, self.config.page_size
        sel = self._candidates()
        # Rows whose next position starts a page commit one: from the reservation, else fresh.
        opens = batch.ncomp[sel] >= batch.npages[sel] * ps
        deferred = EMPTY_I32
        if self.config.decode_lookahead or int(np.count_nonzero(opens)) > kv.available():
            deferred = self._relieve_pressure(b)
            if deferred is None:
                return None
            sel = self._candidates(deferred)
            opens = batch.ncomp[sel] >= batch.npages[sel] * ps
        known = batch.ntok[sel] + batch.pending[sel] if self._steps.inflight else batch.ntok[sel]
        dec_mask = batch.ncomp[sel] == known - 1
        all_decode = isinstance(sel, slice) and bool(dec_mask.all())
        if all_decode:
            dec_rows = EMPTY_I32
            need = np.flatnonzero(opens)
        else:
            dec_rows = _pick(sel, dec_mask)
            need = _pick(sel, opens & dec_mask)
        if need.shape[0]:
            b.cleared.append(kv.open_pages(need))
        budget = self.config.max_num_batched_tokens - (batch.n if all_decode else dec_rows.shape[0])
        if not all_decode:
            budget = self._plan_prefills(_pick(sel, ~dec_mask), budget, b)
        if not b.preempted and not deferred.shape[0]:
            self._admitter.admit(budget, b)
        if self.config.decode_lookahead and need.shape[0]:
            kv.reserve_lookahead(need)
        if all_decode and b.rows:
            dec_rows = np.arange(sel.stop, dtype=_I32)
        if not (all_decode and batch.n) and not dec_rows.shape[0] and not b.rows:
            return None
        poison = np.unique(kv.pool.take_freed()).astype(_I32) if self.config.poison_freed_pages else EMPTY_I32
        plan = assemble(batch, self._steps.next_step(), None if all_decode and not b.rows else dec_rows, b, poison)
        self._steps.planned(plan)
        return plan

    def _candidates(self, deferred: np.ndarray = EMPTY_I32) -> slice | np.ndarray:
        """The rows this step may plan: live, with a token to compute (a row whose last sample is
        in flight has none), not deferred. slice(0, n) when that is every row."""
        batch = self.batch
        n = batch.n
        if batch.num_live == n and not self._steps.inflight and not deferred.shape[0]:
            return slice(0, n)
        work = batch.live[:n] & (batch.ntok[:n] + batch.pending[:n] < batch.limit[:n])
        work[deferred] = False
        return slice(0, n) if work.all() else np.flatnonzero(work)

    def _relieve_pressure(self, b: StepBuilder) -> np.ndarray | None:
        """Make sure every row this step plans can get the page its next token needs: take back
        reservations, then preempt the newest running requests. With a step in flight, a victim's
        pages come back only once that step has ended: the needy rows that the pages available now
        cannot serve wait for a later step (they are returned), and None says that no row can run
        before the step in flight ends."""
        batch, kv, ps = self.batch, self.kv, self.config.page_size
        inflight = bool(self._steps.inflight)
        returning = self._steps.returning_pages() if inflight else 0
        while True:
            sel = self._candidates()
            rows = np.arange(batch.n) if isinstance(sel, slice) else sel
            if not rows.shape[0]:
                return EMPTY_I32
            needy = rows[batch.ncomp[rows] >= (batch.npages[rows] + batch.nres[rows]) * ps]
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
                    return None if needy.shape[0] == rows.shape[0] else needy
                if needy.shape[0] <= avail + returning:
                    return needy[np.argsort(batch.arrival[needy], kind="stable")][avail:]
            victim = int(rows[np.argmax(batch.arrival[rows])])
            if inflight:
                returning += self._steps.sole_pages(victim)
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
        self._steps.release_row(req, offloaded=off is not None)
        req.preempted = True
        self._waiting.appendleft(req)
        self.counters.preemptions += 1
        self.counters.preempted += 1
        b.preempted += 1

    def _plan_prefills(self, rows: np.ndarray, budget: int, b: StepBuilder) -> int:
        """Chunks for running rows that are still prefilling, oldest first; returns the budget left."""
        batch, ps = self.batch, self.config.page_size
        rows = rows[np.argsort(batch.arrival[rows], kind="stable")]
        held = batch.npages[rows] + batch.nres[rows]
        first_page = (batch.ncomp[rows] >= held * ps).astype(np.int64)
        later_need = (np.cumsum(first_page[::-1])[::-1] - first_page).tolist()
        count = rows.shape[0]
        for i, r in enumerate(rows.tolist()):
            chunk = self.kv.grow(r, budget - (count - i - 1), later_need[i], b.cleared)
            b.rows.append(r)
            b.chunks.append(chunk)
            budget -= chunk
        return budget

    # ------------------------------------------------------------------------------------ results

    def on_result(self, plan: StepPlan, result: Result) -> list[RequestOutput]:
        """The RESULT of the oldest step in flight: the tokens it sampled, as outputs."""
        return self._steps.on_result(plan, result)

    def on_abort(self, plan: StepPlan, reason: str, failed_seq_ids: Sequence[int] | None = None) -> list[RequestOutput]:
        """The newest step in flight never ran (a REJECT, a timeout): undo what it did to the pool.
        Without failed_seq_ids every request of the step fails; with them, only those do, and the
        others are rolled back and planned again by the next step."""
        failed = None if failed_seq_ids is None else frozenset(int(i) for i in failed_seq_ids)
        return self._steps.on_abort(plan, reason, failed)

    # ---------------------------------------------------------------------------------- read-only

    def running_requests(self) -> tuple[int, ...]:
        """Ids of the running requests, in the order of the next PREPARE's decodes (batch rows)."""
        b = self.batch
        return tuple(int(rid) for rid, live in zip(b.req_id[: b.n].tolist(), b.live[: b.n].tolist()) if live)

    def request_ids(self) -> tuple[int, ...]:
        """Every request the scheduler holds: waiting, running, or finished but held for a step in
        flight."""
        return tuple(self._requests)

    def waiting_requests(self) -> tuple[int, ...]:
        """Ids of the waiting requests, in the order they will be admitted."""
        return tuple(req.request_id for req in self._waiting)

    def request_state(self, request_id: int) -> RequestView | None:
        """A copy of what the scheduler holds for one request; None once it is forgotten."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        b, r = self.batch, req.row
        host = req.host.slots if req.host is not None else ()
        if r < 0:
            ncomp = req.host.num_computed if req.host is not None else 0
            return RequestView(request_id, req.state, req.num_tokens, ncomp, 0, (), (), host, False, None)
        np_, nr = int(b.npages[r]), int(b.nres[r])
        pages = b.pages[r, : np_ + nr].tolist()
        return RequestView(
            request_id, req.state, int(b.ntok[r]), int(b.ncomp[r]), int(b.pending[r]), tuple(pages[:np_]),
            tuple(pages[np_:]), host, bool(b.live[r]), None,
        )

    def stats(self) -> SchedulerStats:
        pool, cache, c = self.kv.pool, self.kv.cache, self.counters
        return SchedulerStats(
            running=self.batch.num_live,
            waiting=c.waiting,
            preempted=c.preempted,
            pages_free=pool.free_count,
            pages_used=pool.num_kv_pages - pool.free_count,
            pages_cached=cache.cached_count,
            pages_marked=pool.marked_count,
            pages_cleared_total=pool.cleared_total,
            preemptions_total=c.preemptions,
            offloads_total=c.offloads,
            restores_total=c.restores,
            evictions_total=cache.evictions_total,
            steps_total=self._steps.step,
            aborted_steps_total=c.aborted,
            pages_evictable=cache.evictable_count,
            pages_reserved=self.kv.reserved,
            host_pages_free=len(self.kv.host_free),
            prefix_hit_pages_total=c.prefix_hit_pages,
            prefix_queries_total=c.prefix_queries,
            prefix_hits_total=c.prefix_hits,
            pages_offloaded_total=c.pages_offloaded,
            pages_restored_total=c.pages_restored,
            pages_cleared_last_step=c.pages_cleared_last_step,
            steps_in_flight=self._steps.in_flight(),
        )
