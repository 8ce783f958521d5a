"""The scheduler: admission, continuous batching, chunked prefill, preemption, step plans.

Running requests live in rows of preallocated numpy arrays (token counts, page tables, sampling
parameters), so a decode step is planned with a fixed number of array operations whatever the batch
size; only requests that prefill, cross a page boundary in an unusual way, finish, or get preempted
cost Python work. Rows are kept dense (a removed row is filled by the last one): the PREPARE order
is row order, not arrival order; arrival order decides who gets budget and who is preempted.

Every step, every running request takes at least one token (max_num_batched_tokens >= max_num_seqs is
required), so no running request can starve; when the pool cannot give each of them the page its
next token needs, the newest running request is preempted (offloaded to host slots when enough are
free, else dropped for recompute) until it can. Admission is first come, first served: the head of
the waiting queue is admitted when the pages for all its known tokens are available (free or
evictable), and nothing behind it jumps ahead. No request that passed `add_request` is ever dropped:
a request that fits the pool alone always progresses once it is the oldest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from protocol.frames import Prepare, Result
from protocol.page_tables import delta_index
from scheduler.pages import PagePool
from scheduler.prefix import PrefixCache, PrefixHasher
from scheduler.request import Request, RequestState, SamplingParams, max_kv_len


class SchedulerConfigError(ValueError):
    """A SchedulerConfig field is out of range or inconsistent with another."""


class AdmissionError(Exception):
    """A request that could never run: refused at add_request, nothing else is affected."""


class SchedulerStateError(RuntimeError):
    """The scheduler was driven out of order (e.g. plan_step with a step still in flight)."""


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_pages: int
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    num_host_pages: int = 0  # pages of host offload buffer; 0 means preempt by recompute only
    enable_prefix_cache: bool = True
    poison_freed_pages: bool = False  # debug: list pages freed since the last step in poison_pages
    decode_lookahead: int = 0  # pages reserved ahead of a decoding request's committed pages

    def __post_init__(self) -> None:
        for name in ("num_kv_pages", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise SchedulerConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SchedulerConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running sequence takes a token every step"
            )
        if self.num_host_pages < 0 or self.decode_lookahead < 0:
            raise SchedulerConfigError("num_host_pages and decode_lookahead must be >= 0")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced at one step: the new tokens (a delta, stop tokens included)."""

    request_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool
    finish_reason: str | None  # "length", "stop", "cancelled", "error"
    error: str | None = None


_new_object = object.__new__


def _running_output(request_id: int, token_ids: tuple[int, ...], logprobs: tuple[float, ...]) -> RequestOutput:
    """RequestOutput(request_id, token_ids, logprobs, False, None) at half the cost: a frozen
    dataclass's __init__ sets each field through object.__setattr__, once per row per step."""
    out = _new_object(RequestOutput)
    out.__dict__.update(
        request_id=request_id, token_ids=token_ids, logprobs=logprobs, finished=False, finish_reason=None, error=None
    )
    return out


@dataclass(frozen=True)
class StepPlan:
    step: int
    prepare: Prepare
    rows: np.ndarray  # int32[n]: batch row of each PREPARE sequence (rows do not move in flight)
    restore_slots: tuple[int, ...]  # host slots this step reads; free again once it has ended
    offloaded: tuple[int, ...]  # request ids whose KV this step copies out to host slots


@dataclass(frozen=True)
class SchedulerStats:
    """Counts for /metrics. pages_used = pages off the free list (request pages, reservations and
    snapshots); pages_cached = snapshot pages, referenced or not; pages_evictable = snapshots nobody
    references; waiting excludes preempted requests, which preempted counts."""

    running: int
    waiting: int
    preempted: int
    pages_free: int
    pages_used: int
    pages_cached: int
    pages_marked: int
    pages_cleared_total: int
    preemptions_total: int
    offloads_total: int
    restores_total: int
    evictions_total: int
    steps_total: int
    aborted_steps_total: int
    pages_evictable: int = 0
    pages_reserved: int = 0
    host_pages_free: int = 0
    prefix_hit_pages_total: int = 0


class _StepBuilder:
    """What a plan collects before it becomes a PREPARE (a plain slots class: one per step)."""

    __slots__ = (
        "cleared", "offload_pages", "offload_slots", "offloaded", "restore_pages", "restore_slots",
        "preempted", "rows", "chunks",
    )

    def __init__(self) -> None:
        self.cleared: list[np.ndarray] = []
        self.offload_pages: list[np.ndarray] = []
        self.offload_slots: list[int] = []
        self.offloaded: list[int] = []
        self.restore_pages: list[np.ndarray] = []
        self.restore_slots: list[int] = []
        self.preempted = 0
        self.rows: list[int] = []  # rows that are not plain decodes, in order
        self.chunks: list[int] = []


@dataclass(frozen=True)
class _BatchConstants:
    version: int
    rows: np.ndarray
    seq_ids: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seeds: np.ndarray
    ones: np.ndarray
    sample: np.ndarray


_I32 = np.int32
_min = np.minimum.reduce  # ndarray.min without its Python-level wrapper


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only copy: shared by every PREPARE of a batch whose rows did not change."""
    out = a.copy()
    out.setflags(write=False)
    return out


_EMPTY_I32 = _frozen(np.empty(0, dtype=_I32))


def _scatter(table: np.ndarray, rows: np.ndarray, start: np.ndarray, counts: np.ndarray, values: np.ndarray) -> None:
    """table[rows[i], start[i] : start[i] + counts[i]] = the next counts[i] values, for every i."""
    total = values.shape[0]
    if not total:
        return
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    table[np.repeat(rows, counts), np.repeat(start, counts) + offsets] = values


class _Staged:
    """Admissions whose pool and row updates wait for Scheduler._flush_admissions."""

    __slots__ = ("reqs", "hits", "extra", "pages", "runs")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.reqs: list[Request] = []
        self.hits: list[int] = []  # pages of each request's prefix hit
        self.extra: list[int] = []  # fresh pages each request commits
        self.pages = 0  # their sum
        # Consecutive requests whose hits are the same pages (a shared system prompt):
        # [hit, references the first of them still has to take on the hit's head, how many].
        self.runs: list[list] = []

    def add(self, req: Request, matched: np.ndarray, known: int, extra: int) -> None:
        m = matched.shape[0]
        self.reqs.append(req)
        self.hits.append(m)
        self.extra.append(extra)
        self.pages += extra
        runs = self.runs
        # known == m: the hit is the previous request's hit cut to m pages, and all of it if m is
        # that hit's length.
        if m and known == m and runs and runs[-1][0].shape[0] == m:
            runs[-1][2] += 1
        else:
            runs.append([matched, known, 1])


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return _EMPTY_I32
    if len(arrays) == 1:
        return arrays[0].astype(_I32, copy=False)
    return np.concatenate(arrays).astype(_I32, copy=False)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = PagePool(config.num_kv_pages, track_freed=config.poison_freed_pages)
        self.cache = PrefixCache(self.pool)
        self.hasher = PrefixHasher(config.page_size, config.max_model_len)
        self._eos = frozenset(config.eos_token_ids)
        s, p = config.max_num_seqs, config.max_pages_per_seq
        self._row_req = np.zeros(s, dtype=np.int64)
        self._row_arrival = np.zeros(s, dtype=np.int64)
        self._row_ncomp = np.zeros(s, dtype=_I32)  # tokens whose KV is written
        self._row_ntok = np.zeros(s, dtype=_I32)  # tokens known (prompt + sampled)
        self._row_npages = np.zeros(s, dtype=_I32)  # committed pages: the page table
        self._row_nres = np.zeros(s, dtype=_I32)  # reserved pages after the committed ones
        self._row_sent = np.zeros(s, dtype=_I32)  # pages of the page table the executors hold
        self._row_maxpages = np.zeros(s, dtype=_I32)
        self._row_last = np.zeros(s, dtype=_I32)  # the last known token, fed by a decode
        self._row_temp = np.zeros(s, dtype=np.float32)
        self._row_top_p = np.zeros(s, dtype=np.float32)
        self._row_top_k = np.zeros(s, dtype=_I32)
        self._row_seed = np.zeros(s, dtype=np.int64)
        self._row_pages = np.zeros((s, p), dtype=_I32)
        self._rows: list[Request | None] = [None] * s
        self._rows_version = 0  # bumped whenever a row is added or removed
        self._constants: _BatchConstants | None = None
        self._last_keyed: Request | None = None  # see _reuse_keys
        self._n = 0
        self._requests: dict[int, Request] = {}
        self._waiting: deque[Request] = deque()
        self._host_free: list[int] = list(range(config.num_host_pages - 1, -1, -1))
        self._inflight: StepPlan | None = None
        self._pending_end: dict[int, str] = {}
        self._outputs: list[RequestOutput] = []
        self._step = 0
        self._arrivals = 0
        self._preemptions = 0
        self._offloads = 0
        self._restores = 0
        self._aborted = 0
        self._prefix_hits = 0
        # Admissions staged before their updates are applied together; 0 admits one by one (tests
        # compare the two).
        self._admit_batch = config.max_num_seqs

    # ----------------------------------------------------------------------------------- requests

    def add_request(self, request_id: int, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise AdmissionError(f"request id {request_id} is already in use")
        if not 0 <= request_id < 2**63:
            raise AdmissionError(f"request id {request_id} is outside [0, 2**63)")
        try:
            req = Request.create(request_id, prompt_token_ids, params, self._arrivals, self._eos)
        except (OverflowError, ValueError, TypeError) as exc:
            raise AdmissionError(f"request {request_id} has an invalid prompt: {exc}") from exc
        n = req.prompt_len
        if n and _min(req.tokens[:n]) < 0:
            raise AdmissionError(f"request {request_id} has a negative token id in its prompt")
        self.check_admission(n, params)
        self._arrivals += 1
        self._requests[request_id] = req
        self._waiting.append(req)

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
        """End a request with "cancelled" now, or when its step ends if one is in flight.

        Unknown or already finished ids are ignored: a client may go away after its last token.
        """
        self._request_end(request_id, "cancelled")

    def finish(self, request_id: int) -> None:
        """The frontend saw a stop string: end the request with "stop"."""
        self._request_end(request_id, "stop")

    def _request_end(self, request_id: int, reason: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        if self._inflight is not None:
            self._pending_end.setdefault(request_id, reason)
            return
        self._end(req, reason, None, self._outputs)

    def drain_outputs(self) -> list[RequestOutput]:
        """Outputs made outside on_result/on_abort (cancel or finish while no step was in flight)."""
        out, self._outputs = self._outputs, []
        return out

    def has_work(self) -> bool:
        """Requests to run, or outputs waiting in drain_outputs."""
        return bool(self._n or self._waiting or self._outputs)

    # --------------------------------------------------------------------------------------- rows

    def _add_row(self, req: Request, num_computed: int) -> int:
        r = self._n
        self._n += 1
        p = req.params
        self._rows[r] = req
        self._row_req[r] = req.request_id
        self._row_arrival[r] = req.arrival
        self._row_ncomp[r] = num_computed
        self._row_ntok[r] = req.num_tokens
        self._row_npages[r] = 0
        self._row_nres[r] = 0
        self._row_sent[r] = 0
        self._row_maxpages[r] = -(-req.max_kv_len() // self.config.page_size)
        self._row_last[r] = req.tokens[req.num_tokens - 1]
        self._row_temp[r] = p.temperature
        self._row_top_p[r] = p.top_p
        self._row_top_k[r] = p.top_k
        self._row_seed[r] = -1 if p.seed is None else p.seed
        req.row = r
        req.state = RequestState.RUNNING
        self._rows_version += 1
        return r

    def _remove_row(self, req: Request) -> None:
        """Release the row's pages and fill the hole with the last row."""
        r = req.row
        req.num_computed = int(self._row_ncomp[r])
        held = int(self._row_npages[r] + self._row_nres[r])
        self.cache.release(self._row_pages[r, :held].copy())
        last = self._n - 1
        if r != last:
            for arr in (
                self._row_req, self._row_arrival, self._row_ncomp, self._row_ntok, self._row_npages,
                self._row_nres, self._row_sent, self._row_maxpages, self._row_last, self._row_temp, self._row_top_p,
                self._row_top_k, self._row_seed,
            ):
                arr[r] = arr[last]
            k = int(self._row_npages[last] + self._row_nres[last])
            self._row_pages[r, :k] = self._row_pages[last, :k]
            moved = self._rows[last]
            assert moved is not None
            self._rows[r] = moved
            moved.row = r
        self._rows[last] = None
        self._n -= 1
        self._rows_version += 1
        req.row = -1

    def _end(self, req: Request, reason: str, error: str | None, outputs: list[RequestOutput] | None) -> None:
        """Take a request out of every structure; report it in outputs when given."""
        if req.state is RequestState.RUNNING:
            self._remove_row(req)
        else:
            if req.state is RequestState.OFFLOADED:
                self._host_free.extend(req.slot_ids)
                req.slot_ids = []
            self._waiting.remove(req)
        req.state = RequestState.FINISHED
        del self._requests[req.request_id]
        if outputs is not None:
            outputs.append(RequestOutput(req.request_id, (), (), True, reason, error))

    # ----------------------------------------------------------------------------------- planning

    def plan_step(self) -> StepPlan | None:
        if self._inflight is not None:
            raise SchedulerStateError(
                f"plan_step called while step {self._inflight.step} is still in flight: call "
                "on_result or on_abort first"
            )
        b = _StepBuilder()
        ps = self.config.page_size
        n = self._n
        ncomp = self._row_ncomp[:n]
        # Rows whose next position starts a page commit one: from the reservation, else fresh.
        opens = ncomp >= self._row_npages[:n] * ps
        if self.config.decode_lookahead or int(np.count_nonzero(opens)) > self._evictable():
            self._relieve_pressure(b)
            n = self._n
            ncomp = self._row_ncomp[:n]
            opens = ncomp >= self._row_npages[:n] * ps
        dec_mask = ncomp == self._row_ntok[:n] - 1
        all_decode = bool(dec_mask.all())
        if all_decode:
            dec_rows = _EMPTY_I32
            need = np.flatnonzero(opens)
        else:
            dec_rows = np.flatnonzero(dec_mask)
            need = np.flatnonzero(opens & dec_mask)
        if need.shape[0]:
            cols = self._row_npages[need]
            if self.config.decode_lookahead:
                bare = need[self._row_nres[need] == 0]
                if bare.shape[0]:
                    self._make_free(bare.shape[0])
                    self._row_pages[bare, self._row_npages[bare]] = self.pool.allocate(bare.shape[0])
                    self._row_nres[bare] = 1
                self._row_nres[need] -= 1
                opened = self._row_pages[need, cols]
            else:
                self._make_free(need.shape[0])
                opened = self.pool.allocate(need.shape[0])
                self._row_pages[need, cols] = opened
            b.cleared.append(self.pool.commit(opened))
            self._row_npages[need] = cols + 1
        budget = self.config.max_num_batched_tokens - (n if all_decode else dec_rows.shape[0])
        if not all_decode:
            budget = self._plan_prefills(np.flatnonzero(~dec_mask), budget, b)
        if not b.preempted:
            self._admit(budget, b)
        if self.config.decode_lookahead and need.shape[0]:
            self._reserve_lookahead(need)
        if self._n == 0:
            return None
        if all_decode and b.rows:
            dec_rows = np.arange(n, dtype=_I32)
        self._step += 1
        plan = self._build_plan(dec_rows, all_decode and not b.rows, b)
        self._inflight = plan
        return plan

    def _evictable(self) -> int:
        return self.pool.free_count + self.cache.evictable_count

    def _can_get(self, k: int) -> bool:
        """Whether k pages can be had, taking back lookahead reservations if that is what it takes."""
        if k > self._evictable() and self._row_nres[: self._n].any():
            self._drop_reservations()
        return k <= self._evictable()

    def _make_free(self, k: int) -> None:
        short = k - self.pool.free_count
        if short > 0:
            self.cache.evict(short)

    def _relieve_pressure(self, b: _StepBuilder) -> None:
        """Make sure every running row can get the page its next token needs, preempting if not."""
        ps = self.config.page_size
        lookahead = self.config.decode_lookahead
        while self._n:
            n = self._n
            held = self._row_npages[:n] + self._row_nres[:n] if lookahead else self._row_npages[:n]
            need = int(np.count_nonzero(self._row_ncomp[:n] >= held * ps))
            if need <= self._evictable():
                return
            if lookahead and self._row_nres[:n].any():
                self._drop_reservations()
                continue
            self._preempt(self._rows[int(np.argmax(self._row_arrival[:n]))], b)

    def _drop_reservations(self) -> None:
        n = self._n
        for r in np.flatnonzero(self._row_nres[:n]).tolist():
            np_, nr = int(self._row_npages[r]), int(self._row_nres[r])
            self.cache.release(self._row_pages[r, np_ : np_ + nr].copy())
            self._row_nres[r] = 0

    def _preempt(self, req: Request | None, b: _StepBuilder) -> None:
        assert req is not None
        r = req.row
        npages = int(self._row_npages[r])
        if 0 < npages <= len(self._host_free):
            slots = [self._host_free.pop() for _ in range(npages)]
            b.offload_pages.append(self._row_pages[r, :npages].copy())
            b.offload_slots.extend(slots)
            b.offloaded.append(req.request_id)
            self._remove_row(req)
            req.slot_ids = slots
            req.state = RequestState.OFFLOADED
            self._offloads += 1
        else:
            self._remove_row(req)
            req.num_computed = 0
            req.state = RequestState.WAITING
        req.preempted = True
        self._waiting.appendleft(req)
        self._preemptions += 1
        b.preempted += 1

    def _plan_prefills(self, rows: np.ndarray, budget: int, b: _StepBuilder) -> int:
        """Chunks for running rows that are still prefilling, oldest first; returns the budget left."""
        ps = self.config.page_size
        rows = rows[np.argsort(self._row_arrival[rows], kind="stable")]
        held = self._row_npages[rows] + self._row_nres[rows]
        first_page = (self._row_ncomp[rows] >= held * ps).astype(np.int64)
        later_need = (np.cumsum(first_page[::-1])[::-1] - first_page).tolist()
        count = rows.shape[0]
        for i, r in enumerate(rows.tolist()):
            chunk = self._grow(r, budget - (count - i - 1), later_need[i], b)
            b.rows.append(r)
            b.chunks.append(chunk)
            budget -= chunk
        return budget

    def _grow(self, r: int, max_chunk: int, keep: int, b: _StepBuilder) -> int:
        """Size row r's next chunk to the budget and the pages available beyond `keep`, then commit
        the pages it writes. The caller guarantees the first token fits."""
        ps = self.config.page_size
        ncomp = int(self._row_ncomp[r])
        npages = int(self._row_npages[r])
        held = npages + int(self._row_nres[r])
        chunk = min(int(self._row_ntok[r]) - ncomp, max_chunk)
        extra = -(-(ncomp + chunk) // ps) - held
        if extra > 0:
            avail = self._evictable() - keep
            if extra > avail:
                extra = avail
                chunk = (held + avail) * ps - ncomp
            if chunk <= 0:
                raise SchedulerStateError(f"row {r} cannot take a token: the pressure check is wrong")
            self._make_free(extra)
            self._row_pages[r, held : held + extra] = self.pool.allocate(extra)
            self._row_nres[r] += extra
        new_npages = -(-(ncomp + chunk) // ps)
        if new_npages > npages:
            b.cleared.append(self.pool.commit(self._row_pages[r, npages:new_npages]))
            self._row_nres[r] -= new_npages - npages
            self._row_npages[r] = new_npages
        return chunk

    def _admit(self, budget: int, b: _StepBuilder) -> None:
        """Admit waiting requests first come, first served while seats, budget and pages allow.

        A request that needs nothing but free pages is staged: its pool and row updates wait for
        `_flush_admissions`, which applies a whole run of them in a few array operations (a round
        of requests sharing a system prompt would otherwise pay a dozen numpy calls each). Anything
        that may evict, drop reservations or restore flushes first and goes one by one, so the pool
        sees the same operations in the same order either way.
        """
        ps = self.config.page_size
        seats = self.config.max_num_seqs
        prefix_cache = self.config.enable_prefix_cache
        last_hit: tuple[Request, np.ndarray] | None = None  # the previous prefix hit of this call
        staged = _Staged()
        waiting, pool, cache, rows = self._waiting, self.pool, self.cache, self._rows
        while waiting and self._n + len(staged.reqs) < seats and budget > 0:
            req = waiting[0]
            if req.state is RequestState.OFFLOADED:
                self._flush_admissions(staged, b)
                k = len(req.slot_ids)
                ncomp = req.num_computed
                if not self._can_get(-(-req.num_tokens // ps)):
                    return
                self._make_free(k)
                targets = pool.allocate(k)
                pool.overwrite(targets)
                b.restore_pages.append(targets)
                b.restore_slots.extend(req.slot_ids)
                req.slot_ids = []
                waiting.popleft()
                r = self._add_row(req, ncomp)
                self._row_pages[r, :k] = targets
                self._row_npages[r] = k
                self._restores += 1
                chunk = self._grow(r, budget, 0, b)
            else:
                matched, known = _EMPTY_I32, 0
                if prefix_cache:
                    matched, known = self._match(req, last_hit)
                    last_hit = (req, matched)
                m = matched.shape[0]
                ntok = req.num_tokens
                need = -(-ntok // ps) - m
                ncomp = m * ps
                chunk = min(ntok - ncomp, budget)
                extra = -(-(ncomp + chunk) // ps) - m
                free = pool.free_count - staged.pages
                if need <= free + cache.evictable_count and extra <= free and len(staged.reqs) < self._admit_batch:
                    waiting.popleft()
                    r = self._n + len(staged.reqs)
                    staged.add(req, matched, known, extra)
                    self._prefix_hits += m
                    req.num_registered = m
                    req.row = r
                    req.state = RequestState.RUNNING
                    rows[r] = req
                else:
                    self._flush_admissions(staged, b)
                    if known:
                        pool.share(matched[:known])
                    if not self._can_get(need):
                        cache.release(matched)
                        return
                    waiting.popleft()
                    self._prefix_hits += m
                    req.num_registered = m
                    r = self._add_row(req, ncomp)
                    self._row_pages[r, :m] = matched
                    self._row_npages[r] = m
                    chunk = self._grow(r, budget, 0, b)
            b.rows.append(r)
            b.chunks.append(chunk)
            budget -= chunk
        self._flush_admissions(staged, b)

    def _flush_admissions(self, st: _Staged, b: _StepBuilder) -> None:
        """Apply the staged admissions: what `_add_row`, the prefix hit's references and `_grow`
        would have done for each, as one operation per array and a few per run of requests that
        share a hit."""
        reqs = st.reqs
        k = len(reqs)
        if not k:
            return
        ps = self.config.page_size
        r0 = self._n
        rows = np.arange(r0, r0 + k, dtype=_I32)
        m = np.array(st.hits, dtype=_I32)
        extra = np.array(st.extra, dtype=_I32)
        pool = self.pool
        r = r0
        for hit, known, count in st.runs:
            m_run = hit.shape[0]
            if m_run:
                if known:
                    pool.share(hit[:known])
                if count > 1:
                    pool.share(hit, count - 1)
                self._row_pages[r : r + count, :m_run] = hit
            r += count
        fresh = pool.allocate(st.pages)
        b.cleared.append(pool.commit(fresh))
        _scatter(self._row_pages, rows, m, extra, fresh)
        params = [req.params for req in reqs]
        sl = slice(r0, r0 + k)
        self._row_req[sl] = [req.request_id for req in reqs]
        self._row_arrival[sl] = [req.arrival for req in reqs]
        self._row_ncomp[sl] = m * ps
        self._row_ntok[sl] = [req.num_tokens for req in reqs]
        self._row_npages[sl] = m + extra
        self._row_nres[sl] = 0
        self._row_sent[sl] = 0
        self._row_maxpages[sl] = [-(-req.max_kv_len() // ps) for req in reqs]
        self._row_last[sl] = [req.tokens[req.num_tokens - 1] for req in reqs]
        self._row_temp[sl] = [p.temperature for p in params]
        self._row_top_p[sl] = [p.top_p for p in params]
        self._row_top_k[sl] = [p.top_k for p in params]
        self._row_seed[sl] = [-1 if p.seed is None else p.seed for p in params]
        self._n += k
        self._rows_version += 1
        st.clear()

    def _match(self, req: Request, last_hit: tuple[Request, np.ndarray] | None) -> tuple[np.ndarray, int]:
        """The request's prefix hit (at least one token is always left to compute) and how many of
        its first pages come from the previous hit of the same admission round. Those are still
        referenced by that request, so the full pages both prompts share are known without a
        lookup; the caller takes their references (see PrefixCache.match)."""
        n_pages = (req.num_tokens - 1) // self.config.page_size
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
        """How many of the first `limit` full pages hold the same tokens in both requests."""
        n = min(limit * self.config.page_size, req.num_tokens, other.num_tokens)
        mine, theirs = req.tokens[:n], other.tokens[:n]
        if mine.tobytes() == theirs.tobytes():  # the common case, at memcmp speed
            return n // self.config.page_size
        diff = np.flatnonzero(mine != theirs)
        return (int(diff[0]) if diff.shape[0] else n) // self.config.page_size

    def _keys(self, req: Request, n_pages: int) -> list[tuple[int, int]]:
        """Prefix keys of the request's first n_pages full pages (computed once, extended lazily)."""
        keys = req.page_keys
        if not keys and n_pages:
            self._reuse_keys(req)
            self._last_keyed = req
        if len(keys) < n_pages:
            ps = self.config.page_size
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

    def _reserve_lookahead(self, rows: np.ndarray) -> None:
        """Reserve pages ahead for decodes that just used up their reservation, from free pages only."""
        rows = rows[self._row_nres[rows] == 0]
        counts = np.minimum(self.config.decode_lookahead, self._row_maxpages[rows] - self._row_npages[rows])
        counts = np.maximum(counts, 0)
        total = int(counts.sum())
        if total == 0 or total > self.pool.free_count:
            return
        _scatter(self._row_pages, rows, self._row_npages[rows], counts, self.pool.allocate(total))
        self._row_nres[rows] += counts.astype(_I32)

    def _batch_constants(self) -> _BatchConstants:
        """The per-row arrays that only change when the set of rows does, copied once per change."""
        c = self._constants
        if c is None or c.version != self._rows_version:
            n = self._n
            c = _BatchConstants(
                self._rows_version,
                _frozen(np.arange(n, dtype=_I32)),
                _frozen(self._row_req[:n]),
                _frozen(self._row_temp[:n]),
                _frozen(self._row_top_p[:n]),
                _frozen(self._row_top_k[:n]),
                _frozen(self._row_seed[:n]),
                _frozen(np.ones(n, dtype=_I32)),
                _frozen(np.ones(n, dtype=np.uint8)),
            )
            self._constants = c
        return c

    def _new_pages(self, rows: np.ndarray, base: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """The pages of each row's table from base to lens, concatenated: the PREPARE's page_table."""
        grown = lens - base
        at = np.flatnonzero(grown)
        if at.shape[0] == int(grown.sum()):  # a decode step: each table grew by one page at most
            return self._row_pages[rows[at], base[at]]
        at, cols = delta_index(base, lens)
        return self._row_pages[rows[at], cols]

    def _build_plan(self, dec_rows: np.ndarray, all_decode: bool, b: _StepBuilder) -> StepPlan:
        n = self._n
        if all_decode:
            c = self._batch_constants()
            rows = c.rows
            start = self._row_ncomp[:n].copy()
            pt_lens = self._row_npages[:n].copy()
            base = self._row_sent[:n].copy()
            page_table = self._new_pages(np.arange(n), base, pt_lens)
            self._row_sent[:n] = pt_lens
            seq_ids, temperature, top_p, top_k, seeds = c.seq_ids, c.temperature, c.top_p, c.top_k, c.seeds
            qlens, sample = c.ones, c.sample
            token_ids = self._row_last[:n].copy()
            positions = start
            context_lens = start + 1
        else:
            rows = np.concatenate((dec_rows.astype(_I32), np.array(b.rows, dtype=_I32)))
            start = self._row_ncomp[rows]
            qlens = np.concatenate((np.ones(dec_rows.shape[0], dtype=_I32), np.array(b.chunks, dtype=_I32)))
            token_parts = [self._row_last[dec_rows]]
            reqs = self._rows
            for s0, r, chunk in zip(start[dec_rows.shape[0] :].tolist(), b.rows, b.chunks):
                token_parts.append(reqs[r].tokens[s0 : s0 + chunk])
            token_ids = np.concatenate(token_parts).astype(_I32, copy=False)
            # Each row's positions run from its start: one arange for the step, shifted per row.
            ends = np.cumsum(qlens)
            positions = (np.arange(int(ends[-1]), dtype=_I32) + np.repeat(start - (ends - qlens), qlens)).astype(
                _I32, copy=False
            )
            context_lens = start + qlens
            sample = (context_lens == self._row_ntok[rows]).astype(np.uint8)
            pt_lens = self._row_npages[rows]
            base = self._row_sent[rows]
            page_table = self._new_pages(rows, base, pt_lens)
            # Executors forget a sequence absent from a step (every running row is in every step).
            self._row_sent[:n] = 0
            self._row_sent[rows] = pt_lens
            seq_ids, temperature = self._row_req[rows], self._row_temp[rows]
            top_p, top_k, seeds = self._row_top_p[rows], self._row_top_k[rows], self._row_seed[rows]
        cleared = _cat(b.cleared)
        if cleared.shape[0] > 1:
            cleared.sort()
        poison = np.unique(self.pool.take_freed()).astype(_I32) if self.config.poison_freed_pages else _EMPTY_I32
        prepare = Prepare(
            seq_ids=seq_ids,
            query_lens=qlens,
            context_lens=context_lens,
            token_ids=token_ids,
            positions=positions,
            page_table_lens=pt_lens,
            page_table_base=base,
            page_table=page_table,
            sample=sample,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seeds=seeds,
            cleared_pages=cleared,
            restore_pages=_cat(b.restore_pages),
            restore_slots=np.array(b.restore_slots, dtype=_I32) if b.restore_slots else _EMPTY_I32,
            offload_pages=_cat(b.offload_pages),
            offload_slots=np.array(b.offload_slots, dtype=_I32) if b.offload_slots else _EMPTY_I32,
            poison_pages=poison,
            feedback=np.zeros(seq_ids.shape[0], dtype=np.uint8),
        )
        return StepPlan(self._step, prepare, rows, tuple(b.restore_slots), tuple(b.offloaded))

    # ------------------------------------------------------------------------------------ results

    def _check_inflight(self, plan: StepPlan) -> None:
        if self._inflight is not plan:
            raise SchedulerStateError(f"step {plan.step} is not the step in flight")
        self._inflight = None

    def on_result(self, plan: StepPlan, result: Result) -> list[RequestOutput]:
        self._check_inflight(plan)
        prep = plan.prepare
        sampled = np.flatnonzero(prep.sample)
        lengths = {len(result.token_ids), len(result.logprobs), len(result.finite)}
        if lengths != {sampled.shape[0]} or not np.array_equal(np.asarray(result.seq_ids), prep.seq_ids[sampled]):
            return self._fail_step(plan, "its RESULT rows do not match the sequences it sampled")
        ps = self.config.page_size
        rows = plan.rows
        before = self._row_ncomp[rows]
        after = before + prep.query_lens
        self._row_ncomp[rows] = after
        if self.config.enable_prefix_cache:
            crossed = after // ps > before // ps
            if not np.all(result.finite):
                # A row with non-finite logits may have written NaN into its KV: share none of it.
                crossed[sampled[np.asarray(result.finite) == 0]] = False
            at = np.flatnonzero(crossed)
            if at.shape[0]:
                self._register_rows(rows[at].tolist(), (after[at] // ps).tolist())
        self._host_free.extend(plan.restore_slots)
        outputs: list[RequestOutput] = []
        done: list[tuple[Request, str | None]] = []
        pending = self._pending_end
        srows_arr = rows[sampled]
        tok_arr = np.asarray(result.token_ids, dtype=_I32)
        good = np.asarray(result.finite).astype(bool)
        if pending:
            good &= np.array([rid not in pending for rid in prep.seq_ids[sampled].tolist()], dtype=bool)
        if good.all():
            self._row_ntok[srows_arr] += 1
            self._row_last[srows_arr] = tok_arr
        else:
            self._row_ntok[srows_arr[good]] += 1
            self._row_last[srows_arr[good]] = tok_arr[good]
        reqs = self._rows
        emit = outputs.append
        for r, t, lp, ok in zip(srows_arr.tolist(), tok_arr.tolist(), np.asarray(result.logprobs).tolist(), good.tolist()):
            req = reqs[r]
            if not ok:
                rid = req.request_id
                if rid not in pending:
                    done.append((req, f"step {plan.step}: the logits of request {rid} were not finite (NaN or inf)"))
                continue
            n = req.num_tokens
            req.tokens[n] = t
            req.num_tokens = n = n + 1
            if t in req.stop_ids:
                emit(RequestOutput(req.request_id, (t,), (lp,), True, "stop"))
                done.append((req, None))
            elif n >= req.limit:
                emit(RequestOutput(req.request_id, (t,), (lp,), True, "length"))
                done.append((req, None))
            else:
                emit(_running_output(req.request_id, (t,), (lp,)))
        for req, error in done:
            if error is None:
                self._remove_row(req)
                req.state = RequestState.FINISHED
                del self._requests[req.request_id]
            else:
                self._end(req, "error", error, outputs)
        self._flush_pending(outputs)
        return outputs

    def _register_rows(self, rows: list[int], fulls: list[int]) -> None:
        """_register for each row in order. A decoding row that just filled one page past the keys
        it has needs one page hashed: those are hashed together in one vectorized call."""
        ps = self.config.page_size
        reqs = [self._rows[r] for r in rows]
        one = [
            i for i, (req, f) in enumerate(zip(reqs, fulls)) if 1 < f == len(req.page_keys) + 1 == req.num_registered + 1
        ]
        keys = {}
        if one:
            starts = np.array([(fulls[i] - 1) * ps for i in one], dtype=np.int64)
            tokens = np.stack([reqs[i].tokens[s : s + ps] for i, s in zip(one, starts.tolist())])
            new = self.hasher.next_pages([reqs[i].hash_state for i in one], tokens, starts)
            pages = self._row_pages[[rows[i] for i in one], [fulls[i] - 1 for i in one]].tolist()
            keys = dict(zip(one, zip(new, pages)))
        insert = self.cache.insert
        for i, (r, req, full) in enumerate(zip(rows, reqs, fulls)):
            hit = keys.get(i)
            if hit is None:
                self._register(r, full)
                continue
            key, page = hit
            req.page_keys.append(key)
            req.hash_state = key
            insert(key, page)
            req.num_registered = full

    def _register(self, r: int, full: int) -> None:
        req = self._rows[r]
        assert req is not None
        if full <= req.num_registered:
            return
        keys = self._keys(req, full)
        pages = self._row_pages[r, req.num_registered : full].tolist()
        for key, page in zip(keys[req.num_registered : full], pages):
            self.cache.insert(key, page)
        req.num_registered = full

    def on_abort(self, plan: StepPlan, reason: str) -> list[RequestOutput]:
        """The step never ran: fail exactly its requests and undo what it did to the pool."""
        self._check_inflight(plan)
        return self._fail_step(plan, reason)

    def _fail_step(self, plan: StepPlan, reason: str) -> list[RequestOutput]:
        self._aborted += 1
        # Executors forget every page table at an ABORT (and this one may come from a bad RESULT
        # that they ran): whoever is still running is sent whole next step.
        self._row_sent[: self._n] = 0
        # Some ranks may have zeroed these pages and others not: they must be listed again.
        self.pool.remark(plan.prepare.cleared_pages)
        # Restore targets die with their requests below; the host slots they read are free again.
        self._host_free.extend(plan.restore_slots)
        # An offload may have run on some ranks only: its host copy is worthless, recompute instead.
        for rid in plan.offloaded:
            req = self._requests.get(rid)
            if req is not None and req.state is RequestState.OFFLOADED:
                self._host_free.extend(req.slot_ids)
                req.slot_ids = []
                req.num_computed = 0
                req.state = RequestState.WAITING
        victims = [self._rows[r] for r in plan.rows.tolist()]
        outputs: list[RequestOutput] = []
        error = f"step {plan.step} was aborted: {reason}"
        for req in victims:
            assert req is not None
            self._end(req, "error", error, outputs)
        self._flush_pending(outputs)
        return outputs

    def _flush_pending(self, outputs: list[RequestOutput]) -> None:
        pending, self._pending_end = self._pending_end, {}
        for rid, reason in pending.items():
            req = self._requests.get(rid)
            if req is not None:
                self._end(req, reason, None, outputs)

    # -------------------------------------------------------------------------------------- stats

    def stats(self) -> SchedulerStats:
        pool, cache = self.pool, self.cache
        preempted = sum(1 for r in self._waiting if r.preempted)
        return SchedulerStats(
            running=self._n,
            waiting=len(self._waiting) - preempted,
            preempted=preempted,
            pages_free=pool.free_count,
            pages_used=pool.num_kv_pages - pool.free_count,
            pages_cached=cache.cached_count,
            pages_marked=pool.marked_count,
            pages_cleared_total=pool.cleared_total,
            preemptions_total=self._preemptions,
            offloads_total=self._offloads,
            restores_total=self._restores,
            evictions_total=cache.evictions_total,
            steps_total=self._step,
            aborted_steps_total=self._aborted,
            pages_evictable=cache.evictable_count,
            pages_reserved=int(self._row_nres[: self._n].sum()),
            host_pages_free=len(self._host_free),
            prefix_hit_pages_total=self._prefix_hits,
        )
