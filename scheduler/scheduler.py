"""The scheduler: admission, continuous batching, chunked prefill, preemption, step plans.

Every step, every running request takes at least one token (max_num_batched_tokens >= max_num_seqs is
required), so no running request can starve; when the pool cannot give each of them the page its
next token needs, the newest running request is preempted (offloaded to host slots when enough are
free, else dropped for recompute) until it can. Admission is first come, first served (admission.py).
No request that passed `add_request` is ever dropped: a request that fits the pool alone always
progresses once it is the oldest.

This module is the facade: requests come in, steps go out, results come back. The running rows
live in batch.py, their pages in kv_manager.py, the PREPARE is assembled in plan.py, and what
happens when a step ends is in steps.py; running.py plans the running rows' share of a step
(pressure, preemption, prefill chunks) and admission.py the newcomers'.
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
from scheduler.request import Request, RequestOutput, RequestState, SamplingParams, max_kv_len
from scheduler.running import RunningRows
from scheduler.stats import Counters, RequestView, SchedulerStats
from scheduler.steps import Steps

__all__ = [
    "AdmissionError", "RequestOutput", "RequestView", "Scheduler", "SchedulerConfig", "SchedulerConfigError",
    "SchedulerStateError", "SchedulerStats", "StepPlan",
]

_I32 = np.int32


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
        self._steps = Steps(config, self.batch, self.kv, self.counters, self._requests, self._waiting)
        self._running = RunningRows(config, self.batch, self.kv, self._steps, self._waiting, self.counters)
        self._arrivals = 0

    @property
    def pool(self) -> PagePool:
        return self.kv.pool

    @property
    def cache(self) -> PrefixCache:
        return self.kv.cache

    # ----------------------------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: int,
        prompt_token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        *,
        prompt_leader: int | None = None,
    ) -> None:
        """Queue a request (AdmissionError if it could never run).

        prompt_leader: the id of a request with the same prompt (the first of n samples). This
        one waits until the leader's prompt is computed and its full pages are prefix snapshots,
        then shares them by reference and computes only the prompt's tail; requests behind it are
        not held up meanwhile. If the leader ends first (or is unknown, or prefix caching is off)
        it goes on alone."""
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
        leader = self._requests.get(prompt_leader) if prompt_leader is not None else None
        if leader is not None and leader.state is not RequestState.FINISHED and self.config.enable_prefix_cache:
            req.leader = leader
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
        run before that step's RESULT is in). Nothing is planned after a step of several forwards
        in flight: it may be cut (should_cut), and then its RESULT says where its rows stand."""
        inflight = self._steps.inflight
        if inflight and inflight[-1].prepare.decode_steps > 1:
            return None
        self._steps.check_can_plan()
        b = StepBuilder()
        admission = self._admitter.admissible()
        rows = self._running.plan(b, admission)
        if rows is None:
            return None
        if admission and not b.preempted and not rows.deferred:
            self._admitter.admit(rows.budget, b)
        if self.config.decode_lookahead and rows.opened.shape[0]:
            self.kv.reserve_lookahead(rows.opened)
        if rows.every_row_decodes:
            if not self.batch.n:
                return None
            # None: the fast PREPARE; with admissions, the rows that were there decode first.
            dec_rows = np.arange(self.batch.n - len(b.rows), dtype=_I32) if b.rows else None
        else:
            dec_rows = rows.dec_rows
            if not dec_rows.shape[0] and not b.rows:
                return None
        kv = self.kv
        poison = np.unique(kv.pool.take_freed()).astype(_I32) if self.config.poison_freed_pages else EMPTY_I32
        plan = assemble(
            self.batch, self._steps.next_step(), dec_rows, b, poison, self._steps.base(), rows.forwards, rows.first_row_end
        )
        self._steps.planned(plan)
        return plan

    # ------------------------------------------------------------------------------------ results

    def on_result(self, plan: StepPlan, result: Result) -> list[RequestOutput]:
        """The RESULT of the oldest step in flight: the tokens it sampled, as outputs. A step of
        several forwards that was cut brings fewer forwards than planned: its rows step back to
        the last one that ran."""
        return self._steps.on_result(plan, result)

    def should_cut(self, plan: StepPlan) -> bool:
        """Whether the step of several forwards `plan`, in flight, should end after the forward
        running (a CUT): a request waits that could be admitted, and would otherwise wait for
        every one of them; or one waits for a seat that a row frees before the frame's last
        forward (the frame was planned before it came, up to its longest row). A frame planned
        while it waited ends where the first row does: no cut."""
        forwards = plan.prepare.decode_steps
        if forwards == 1 or not self._waiting:
            return False
        return plan.first_row_end < forwards or self._admitter.admissible()

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
        leader = req.leader.request_id if req.leader is not None else None
        if r < 0:
            ncomp = req.host.num_computed if req.host is not None else 0
            return RequestView(request_id, req.state, req.num_tokens, ncomp, 0, (), (), host, False, leader)
        np_, nr = int(b.npages[r]), int(b.nres[r])
        pages = b.pages[r, : np_ + nr].tolist()
        return RequestView(
            request_id, req.state, int(b.ntok[r]), int(b.ncomp[r]), int(b.pending[r]), tuple(pages[:np_]),
            tuple(pages[np_:]), host, bool(b.live[r]), leader,
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
