"""Steps in flight and what happens when one ends: its RESULT (tokens, stops, prefix snapshots), or
its abort (the requests it fails, what it undoes).

A request that ends while a step in flight still reads or writes its pages is finished at once (its
last output is emitted, later plans leave it out) but its row and pages are held, and so are host
slots it holds, until the newest step in flight at that moment has ended; a request preempted with
a step in flight keeps its row (no longer live) the same way, until the step that offloads it has
ended if it is offloaded. `retired` lists them, in the order they ended, with the step whose end
releases them. Rows that stay put while their steps are in flight are what lets a RESULT find its
rows, a late token be dropped, and an aborted step be rolled back.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from protocol.frames import Prepare, Result
from scheduler.batch import Batch
from scheduler.config import SchedulerConfig
from scheduler.errors import SchedulerStateError
from scheduler.kv_manager import KVManager
from scheduler.plan import StepPlan
from scheduler.request import Alternatives, Request, RequestOutput, RequestState
from scheduler.stats import Counters

_I32 = np.int32


class Steps:
    def __init__(
        self, config: SchedulerConfig, batch: Batch, kv: KVManager, counters: Counters, requests: dict[int, Request],
        waiting: deque[Request],
    ) -> None:
        self.config = config
        self.batch = batch
        self.kv = kv
        self.counters = counters
        self.requests = requests
        self.waiting = waiting
        self.step = 0
        self.inflight: deque[StepPlan] = deque()
        self._ended_whole: StepPlan | None = None  # the last step that ended, if it ran every forward
        self.retired: list[tuple[int, Request]] = []
        self.outputs: list[RequestOutput] = []

    # ---------------------------------------------------------------------------------- planning

    def check_can_plan(self) -> None:
        if len(self.inflight) >= self.config.max_inflight_steps:
            steps = " and ".join(str(p.step) for p in self.inflight)
            raise SchedulerStateError(
                f"plan_step called while step {steps} {'is' if len(self.inflight) == 1 else 'are'} still in "
                f"flight (max_inflight_steps {self.config.max_inflight_steps}): call on_result or on_abort first"
            )

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def planned(self, plan: StepPlan) -> None:
        self.inflight.append(plan)
        self.counters.pages_cleared_last_step = int(plan.prepare.cleared_pages.shape[0])

    def base(self) -> StepPlan | None:
        """The step the next one follows on the ranks: the newest in flight, or with none in
        flight, a step of several forwards that ended having run them all (the ranks hold its
        PREPARE and its last samples, so the next step may be its CONTINUE, as one planned ahead
        would be; nothing is planned ahead of such a step). A step of one forward that ended is
        not a base: with one step in flight at a time, every PREPARE stays the serial scheduler's
        (test_serial_identity)."""
        if self.inflight:
            return self.inflight[-1]
        last = self._ended_whole
        return last if last is not None and last.prepare.decode_steps > 1 else None

    def busy(self) -> bool:
        return bool(self.inflight or self.outputs)

    def in_flight(self) -> int:
        return len(self.inflight)

    def drain(self) -> list[RequestOutput]:
        out, self.outputs = self.outputs, []
        return out

    def returning_pages(self) -> int:
        """Pages that return to the pool (or to the evictable snapshots) once the rows held for
        steps in flight are released."""
        return sum(self.sole_pages(req.row) for _, req in self.retired if req.row >= 0)

    def sole_pages(self, r: int) -> int:
        """Pages of row r that no other row references."""
        return int(np.count_nonzero(self.kv.pool.refcount[self.batch.held_pages(r)] == 1))

    # ------------------------------------------------------------------------- ending requests

    def end(self, req: Request, reason: str | None, error: str | None, outputs: list[RequestOutput] | None) -> None:
        """Finish a request now (and report it in outputs, when given); what it holds is released
        once no step in flight uses it."""
        if req.state in (RequestState.WAITING, RequestState.OFFLOADED):
            self.waiting.remove(req)
            if req.preempted:
                self.counters.preempted -= 1
            else:
                self.counters.waiting -= 1
        req.state = RequestState.FINISHED
        if outputs is not None:
            outputs.append(RequestOutput(req.request_id, (), (), True, reason, error))
        self._release_when_done(req)

    def release_row(self, req: Request, offloaded: bool) -> None:
        """A preempted request's row goes, its pages with it, once no step in flight uses them (an
        offloaded one's are read by the step being planned)."""
        self._release_when_done(req, self.step + 1 if offloaded and self.inflight else None)

    def _release_when_done(self, req: Request, until: int | None = None) -> None:
        if req.row >= 0 and not self.batch.live[req.row]:
            return  # already held: its entry in `retired` releases it
        if until is None and not self.inflight:
            self._release(req)
            return
        self.retired.append((self.inflight[-1].step if until is None else until, req))
        if req.row >= 0:
            self.batch.hold(req.row)

    def _release(self, req: Request) -> None:
        if req.row >= 0:
            self.kv.free_row(req.row)
            self.batch.remove(req.row)
        if req.state is RequestState.FINISHED:
            if req.host is not None:
                self.kv.free_slots(req.host.slots)
                req.host = None
            del self.requests[req.request_id]

    def _release_due(self, step: int, retarget: bool = False) -> None:
        """Release what waited for `step` to end. retarget: that step was aborted, and what it held
        waits for the step still in flight, if there is one."""
        due = [req for until, req in self.retired if until <= step]
        if not due:
            return
        if retarget and self.inflight:
            newest = self.inflight[-1].step
            self.retired = [(min(until, newest), req) for until, req in self.retired]
            return
        self.retired = [(until, req) for until, req in self.retired if until > step]
        for req in due:
            self._release(req)

    # ---------------------------------------------------------------------------------- results

    def _rows_of(self, plan: StepPlan) -> np.ndarray:
        """The plan's rows now (a removal since it was planned may have moved some)."""
        if plan.moves == self.batch.moves:
            return plan.rows
        reqs = self.requests
        return np.array([reqs[rid].row for rid in plan.prepare.seq_ids.tolist()], dtype=_I32)

    def on_result(self, plan: StepPlan, result: Result) -> list[RequestOutput]:
        if not self.inflight or self.inflight[0] is not plan:
            raise SchedulerStateError(f"step {plan.step} is not the step in flight")
        self.inflight.popleft()
        prep = plan.prepare
        sampled = prep.sample.nonzero()[0]
        forwards = result.forwards  # all that were planned, or fewer when the step was cut
        lengths = {len(result.token_ids), len(result.logprobs), len(result.finite)}
        if (
            lengths != {forwards * sampled.shape[0]} or not 1 <= forwards <= prep.decode_steps
            or not np.array_equal(np.asarray(result.seq_ids), prep.seq_ids[sampled])
        ):
            return self._fail_step(plan, "its RESULT rows do not match the sequences it sampled")
        wanted = prep.num_logprobs[sampled]
        alternatives = forwards * int(wanted.sum(dtype=np.int64))
        if {len(result.top_token_ids), len(result.top_logprobs)} != {alternatives}:
            return self._fail_step(plan, "its RESULT does not carry the alternatives its sequences asked for")
        rows = self._rows_of(plan)
        if forwards < prep.decode_steps:  # cut: the pages of the forwards that did not run stay, zeroed
            self.batch.ncomp[rows] -= prep.decode_steps - forwards
        # finite[j, i]: forward j's logits of sampled row i.
        finite = np.asarray(result.finite).astype(bool).reshape(forwards, -1)
        self.kv.free_slots(plan.restore_slots)
        outputs: list[RequestOutput] = []
        tops = _alternatives(wanted, result, forwards) if alternatives else None
        done = self._take_tokens(plan, rows[sampled], result, finite, outputs, tops)
        if self.config.enable_prefix_cache:  # with the tokens just taken: a frame's later forwards fill pages too
            self._register(prep, rows, sampled, finite.all(axis=0), forwards)
        for req, error in done:
            if error is None:
                self.end(req, None, None, None)  # its last output is out already
            else:
                self.end(req, "error", error, outputs)
        self._release_due(plan.step)
        self._ended_whole = plan if forwards == prep.decode_steps else None
        return outputs

    def _register(self, prep: Prepare, rows: np.ndarray, sampled: np.ndarray, finite: np.ndarray, forwards: int) -> None:
        """Full pages the step wrote become prefix snapshots; a row with non-finite logits may
        have written NaN into its KV: none of it is shared."""
        ps = self.config.page_size
        # A row held for a finished request may have written a token it never learned (the sample
        # of a step whose RESULT it no longer took), as may a row that stopped before the last of a
        # step's forwards: only pages of tokens it knows (ntok, with this step's taken) are keyed.
        after = np.minimum(prep.context_lens + (forwards - 1), self.batch.ntok[rows])
        crossed = after // ps > (prep.context_lens - prep.query_lens) // ps
        if not finite.all():
            crossed[sampled[~finite]] = False
        at = crossed.nonzero()[0]
        if at.shape[0] and self.batch.num_live != self.batch.n:
            # A row held for a request that failed on non-finite logits wrote from a NaN context.
            reqs = self.batch.reqs
            at = at[[not reqs[r].kv_suspect for r in rows[at].tolist()]]
        if at.shape[0]:
            self.kv.register(rows[at].tolist(), (after[at] // ps).tolist())

    def _take_tokens(
        self, plan: StepPlan, srows: np.ndarray, result: Result, finite: np.ndarray, outputs: list[RequestOutput],
        tops: list[tuple[Alternatives, ...]] | None,
    ) -> list[tuple[Request, str | None]]:
        """Append each sampled row's tokens, forward by forward, to its request and emit them as
        one output; returns the requests that end. A row that ends (a stop token, its length, a
        non-finite row) keeps none of the tokens its later forwards sampled; a row held for a
        request that ended before the step keeps none at all."""
        batch = self.batch
        reqs = batch.reqs
        forwards = finite.shape[0]
        batch.pending[srows] -= plan.prepare.decode_steps  # every sample it was planned for: none is in flight now
        # Every sampled row's tokens and logprobs as lists in one call each, not two per row.
        tok = np.asarray(result.token_ids, dtype=_I32).reshape(forwards, -1).T.tolist()
        lps = np.asarray(result.logprobs).reshape(forwards, -1).T.tolist()
        done: list[tuple[Request, str | None]] = []
        emit = outputs.append
        all_finite = bool(finite.all())
        for i, (r, n) in enumerate(zip(srows.tolist(), batch.ntok[srows].tolist())):
            req = reqs[r]
            if req.state is RequestState.FINISHED:
                continue  # the sample of a step planned before it ended
            row_tokens = tok[i]
            row_logprobs = lps[i]
            row_tops = tops[i] if tops else ()
            bad = -1 if all_finite or finite[:, i].all() else int((~finite[:, i]).nonzero()[0][0])
            reason = None
            kept = 0
            for t in row_tokens if bad < 0 else row_tokens[:bad]:
                req.tokens[n] = t
                n += 1
                kept += 1
                if t in req.stop_ids:
                    reason = "stop"
                    break
                if n >= req.limit:
                    reason = "length"
                    break
            batch.ntok[r] = n
            if kept:
                batch.last[r] = row_tokens[kept - 1]
                emit(RequestOutput(
                    req.request_id, tuple(row_tokens[:kept]), tuple(row_logprobs[:kept]), reason is not None, reason,
                    None, row_tops[:kept],
                ))  # fmt: skip
            if reason is not None:
                done.append((req, None))
            elif bad >= 0:
                req.kv_suspect = True
                rid = req.request_id
                done.append((req, f"step {plan.step}: the logits of request {rid} were not finite (NaN or inf)"))
        return done

    # ----------------------------------------------------------------------------------- aborts

    def on_abort(self, plan: StepPlan, reason: str, failed: frozenset[int] | None) -> list[RequestOutput]:
        if not self.inflight or self.inflight[-1] is not plan:
            raise SchedulerStateError(f"step {plan.step} is not the newest step in flight")
        self.inflight.pop()
        return self._fail_step(plan, reason, failed, aborted=True)

    def _fail_step(
        self, plan: StepPlan, reason: str, failed: frozenset[int] | None = None, aborted: bool = False
    ) -> list[RequestOutput]:
        """The step's requests fail (those in `failed`, when given; the others are rolled back),
        and what it did to the pool is undone."""
        self.counters.aborted += 1
        self._ended_whole = None
        batch, kv, requests = self.batch, self.kv, self.requests
        # Executors forget every page table at an ABORT (and this one may come from a bad RESULT
        # that they ran): whoever is still running is sent whole next step.
        batch.sent[: batch.n] = 0
        # Some ranks may have zeroed these pages and others not: they must be listed again.
        kv.pool.remark(plan.prepare.cleared_pages)
        keeps = {rid: host for rid, host in plan.restored if failed is not None and rid not in failed}
        # Restore targets die with their requests below; the host slots they read are free again.
        for rid, host in plan.restored:
            if rid not in keeps or requests[rid].state is RequestState.FINISHED:
                kv.free_slots(host.slots)
        # An offload may have run on some ranks only: its host copy is worthless, recompute instead.
        for rid in plan.offloaded:
            req = requests.get(rid)
            if req is not None and req.state is RequestState.OFFLOADED:
                kv.free_slots(req.host.slots)
                req.host = None
                req.state = RequestState.WAITING
        victims = [batch.reqs[r] for r in self._rows_of(plan).tolist()]
        outputs: list[RequestOutput] = []
        error = f"step {plan.step} was aborted: {reason}"
        back: list[Request] = []
        for i, req in enumerate(victims):
            if req.state is RequestState.FINISHED:
                if not self.inflight:
                    self._release_retired(req, plan.step)
            elif failed is None or req.request_id in failed:
                self.end(req, "error", error, outputs)
            elif req.request_id in keeps:
                back.append(req)
            else:
                self._roll_back(plan, i, req)
        self._requeue(back, keeps)
        self._release_due(plan.step, retarget=aborted)
        return outputs

    def _roll_back(self, plan: StepPlan, i: int, req: Request) -> None:
        """Sequence i of an aborted step as it was before the step: its computed tokens, its sample,
        and the pages the step committed back in its reservation (re-marked by the caller)."""
        p, r = plan.prepare, req.row
        self.kv.uncommit(r, int(p.context_lens[i] - p.query_lens[i]))
        self.batch.pending[r] -= int(p.sample[i]) * p.decode_steps

    def _requeue(self, back: list[Request], hosts: dict) -> None:
        """Requests an aborted step restored go back to the head of the queue with their host copy
        (the restore only read it); their new pages go back to the pool."""
        for req in back:
            self._release(req)
            req.host = hosts[req.request_id]
            req.state = RequestState.OFFLOADED
            self.counters.preempted += 1
        self.waiting.extendleft(reversed(back))

    def _release_retired(self, req: Request, step: int) -> None:
        """A request the aborted step held for: released now, in the order of the step's rows."""
        for i, (until, held) in enumerate(self.retired):
            if held is req and until <= step:
                del self.retired[i]
                self._release(req)
                return


def _alternatives(wanted: np.ndarray, result: Result, forwards: int) -> list[tuple[Alternatives, ...]]:
    """Per sampled row, its alternatives for each forward's token (wanted[j] of them each), or none."""
    ids = np.asarray(result.top_token_ids).tolist()
    lps = np.asarray(result.top_logprobs).tolist()
    out: list[list[Alternatives]] = [[] for _ in range(wanted.shape[0])]
    at = 0
    for _ in range(forwards):
        for row, k in zip(out, wanted.tolist()):
            if k:
                row.append(tuple(zip(ids[at : at + k], lps[at : at + k])))
                at += k
    return [tuple(row) for row in out]
