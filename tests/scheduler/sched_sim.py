"""A simulated executor with a shadow model of every KV slot, and the scheduler's invariants.

A slot holds GARBAGE (never written, or poisoned), ZERO (cleared) or the KV a sequence wrote at one
position, named by the whole token prefix up to that position (the KV of a token depends on every
token before it). The simulator applies PREPAREs the way executors do: the page-table deltas when
a PREPARE arrives (in order, on the tables the previous PREPARE left; an ABORT drops them all);
then, when a step runs (steps run in order, an aborted one never), its offloads, poison, restores
and clears, its feedback rows resolved to the tokens the step run before sampled, and the forward's
writes. It checks what attention reads: every slot of every page in a sequence's page table, past
the sequence's length included. The Driver plays the engine: up to max_inflight_steps planned, the
oldest completed, the newest aborted before it runs. It receives each step as the ranks do: a step
sent as a CONTINUE is the PREPARE the executors expand it to after the one they hold, and that must
be the PREPARE the scheduler keeps.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from protocol.continuation import expand
from protocol.frames import ARRAY_DTYPES, Prepare, Result
from protocol.page_tables import HeldPageTables
from scheduler import RequestState, Scheduler, StepPlan

GARBAGE = "garbage"
ZERO = "zero"


class ShadowViolation(AssertionError):
    """The scheduler planned something that would read or destroy the wrong bytes."""


@dataclass
class Shadow:
    num_kv_pages: int
    page_size: int
    num_host_pages: int
    pages: list[list[object]] = field(init=False)
    host: dict[int, list[object]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)  # request id -> tokens as the executors know them
    # The page tables as the executors hold them: a PREPARE's deltas apply to these.
    tables: HeldPageTables = field(default_factory=HeldPageTables)
    last_samples: dict[int, int] = field(default_factory=dict)  # what the last step run sampled
    # Requests that ran a step of several forwards that was cut: the page its later forwards opened
    # stays in its table, zeroed, one more than its context needs until the context reaches it.
    spare: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        # Cache memory starts uninitialized.
        self.pages = [[GARBAGE] * self.page_size for _ in range(self.num_kv_pages)]

    def add(self, request_id: int, prompt: list[int]) -> None:
        self.tokens[request_id] = list(prompt)

    def kv(self, request_id: int, pos: int) -> tuple[int, ...]:
        return tuple(self.tokens[request_id][: pos + 1])

    def receive(self, p: Prepare) -> np.ndarray:
        """A PREPARE arrives: its tables, whole, from the deltas (they become what is held)."""
        return self.tables.apply(p)

    def prepare_effects(self, p: Prepare) -> None:
        """What an executor does to the cache before the step's forward, in its order."""
        for page, slot in zip(p.offload_pages.tolist(), p.offload_slots.tolist()):
            self.host[slot] = list(self.pages[page])
        for page in p.poison_pages.tolist():
            self.pages[page] = [GARBAGE] * self.page_size
        for page, slot in zip(p.restore_pages.tolist(), p.restore_slots.tolist()):
            if slot not in self.host:
                raise ShadowViolation(f"restore of page {page} reads host slot {slot} that holds nothing")
            self.pages[page] = list(self.host[slot])
        for page in p.cleared_pages.tolist():
            self.pages[page] = [ZERO] * self.page_size

    def feed(self, p: Prepare, forward: int) -> np.ndarray:
        """The step's token ids with feedback rows resolved to the previous run's samples; in a
        forward after a step's first, every row's sample of the forward before."""
        if forward:
            return np.array([self.last_samples[rid] for rid in p.seq_ids.tolist()], dtype=np.int32)
        tokens = p.token_ids.copy()
        starts = np.cumsum(p.query_lens) - p.query_lens
        for i in np.flatnonzero(p.feedback).tolist():
            rid = int(p.seq_ids[i])
            if p.query_lens[i] != 1 or rid not in self.last_samples:
                raise ShadowViolation(f"request {rid}: feedback without a sample of the step run before")
            if tokens[starts[i]] != 0:
                raise ShadowViolation(f"request {rid}: a feedback row's placeholder is {tokens[starts[i]]}, not 0")
            tokens[starts[i]] = self.last_samples[rid]
        return tokens

    def forward(self, p: Prepare, table: np.ndarray, forward: int = 0) -> None:
        """Check the frame's shape, write each new token's KV, then check every read. `forward`:
        which of the step's decode_steps forwards runs (each one position on, the table the same)."""
        ps = self.page_size
        cleared = p.cleared_pages.tolist()
        if cleared != sorted(set(cleared)):
            raise ShadowViolation(f"cleared_pages {cleared} not sorted and unique")
        if set(cleared) & set(p.restore_pages.tolist()):
            raise ShadowViolation("a restore target is listed in cleared_pages")
        n = p.seq_ids.shape[0]
        if len(set(p.seq_ids.tolist())) != n:
            raise ShadowViolation("a sequence appears twice in one step")
        token_ids = self.feed(p, forward)
        final = p.final_context_lens
        q0 = t0 = 0
        tables = []
        for i in range(n):
            rid = int(p.seq_ids[i])
            q, ctx, ptl = int(p.query_lens[i]), int(p.context_lens[i]) + forward, int(p.page_table_lens[i])
            pages = table[t0 : t0 + ptl].tolist()
            t0 += ptl
            tables.append((rid, ctx, pages))
            need = -(-int(final[i]) // ps)
            if not need <= ptl <= need + (rid in self.spare):
                raise ShadowViolation(f"request {rid}: {ptl} pages for {int(final[i])} tokens")
            if q < 1:
                raise ShadowViolation(f"request {rid} scheduled with {q} tokens")
            toks = self.tokens[rid]
            for j in range(q):
                pos = int(p.positions[q0 + j]) + forward
                if pos != ctx - q + j:
                    raise ShadowViolation(f"request {rid}: position {pos}, expected {ctx - q + j}")
                if int(token_ids[q0 + j]) != toks[pos]:
                    raise ShadowViolation(f"request {rid}: token at {pos} is {int(token_ids[q0 + j])}, not {toks[pos]}")
                page = pages[pos // ps]
                slot = self.pages[page]
                if slot[pos % ps] != ZERO:
                    raise ShadowViolation(
                        f"request {rid} writes position {pos} into page {page} whose slot holds {slot[pos % ps]!r:.60}"
                    )
                slot[pos % ps] = self.kv(rid, pos)
            q0 += q
            if bool(p.sample[i]) != (ctx == len(toks)):
                raise ShadowViolation(f"request {rid}: sample flag {p.sample[i]} with {ctx} of {len(toks)} tokens")
        for rid, ctx, pages in tables:
            for k, page in enumerate(pages):
                for j, content in enumerate(self.pages[page]):
                    pos = k * ps + j
                    want = self.kv(rid, pos) if pos < ctx else ZERO
                    if content != want:
                        raise ShadowViolation(
                            f"request {rid} (length {ctx}) reads page {page} slot {j} (position {pos}): "
                            f"{content!r:.60} instead of {want!r:.60}"
                        )

    def sample(self, p: Prepare, rng: np.random.Generator | None, vocab: int, forced: dict[int, int]) -> Result:
        """A token for each sampled row: random, or (rng None) a function of the request's seed and
        of the KV it attends to, as a seeded model would give; `forced` overrides (and is consumed).
        Each becomes the request's next token."""
        idx = np.flatnonzero(p.sample)
        ids = p.seq_ids[idx]
        if rng is not None:
            toks = rng.integers(0, vocab, size=idx.shape[0]).astype(np.int32)
        else:
            toks = np.array([model_token(int(p.seeds[i]), self.tokens[int(p.seq_ids[i])], vocab) for i in idx], dtype=np.int32)
        for j, rid in enumerate(ids.tolist()):
            if rid in forced:
                toks[j] = forced.pop(rid)
        self.last_samples = dict(zip(ids.tolist(), toks.tolist()))
        for rid, t in self.last_samples.items():
            self.tokens[rid].append(t)
        return Result(
            seq_ids=ids.astype(np.int64),
            token_ids=toks,
            logprobs=np.zeros(idx.shape[0], dtype=np.float32),
            finite=np.ones(idx.shape[0], dtype=np.uint8),
        )


def model_token(seed: int, context: list[int], vocab: int) -> int:
    digest = hashlib.blake2b(repr((seed, context)).encode(), digest_size=8).digest()
    return 3 + int.from_bytes(digest, "little") % (vocab - 3)


def check_pool(s: Scheduler, inflight: list[StepPlan] | StepPlan | None = None, spare: set[int] = frozenset()) -> None:
    """Ownership and refcounts: every page is free, referenced by rows, or an evictable snapshot;
    every page a step in flight reads or writes is held. `spare`: requests whose table may hold one
    page past their context (Shadow.spare)."""
    plans = [] if inflight is None else [inflight] if isinstance(inflight, StepPlan) else list(inflight)
    pool, cache, ps = s.pool, s.cache, s.config.page_size
    held: Counter[int] = Counter()
    committed: set[int] = set()
    views = [s.request_state(rid) for rid in s.request_ids()]
    for v in views:
        pages = list(v.page_table + v.reserved_pages)
        if len(set(pages)) != len(pages):
            raise ShadowViolation(f"request {v.request_id} holds a page twice: {pages}")
        held.update(pages)
        if not v.live:
            continue
        if v.state is not RequestState.RUNNING:
            raise ShadowViolation(f"request {v.request_id} has a live row but is {v.state}")
        committed.update(v.page_table)
        need = -(-v.num_computed // ps)
        if not need <= len(v.page_table) <= need + (v.request_id in spare):
            raise ShadowViolation(f"request {v.request_id} has {len(v.page_table)} pages for {v.num_computed} tokens")
        if not pool.marked[list(v.reserved_pages)].all():
            raise ShadowViolation(f"request {v.request_id} reserves unmarked pages {v.reserved_pages}")
    if sorted(s.running_requests()) != sorted(v.request_id for v in views if v.live):
        raise ShadowViolation("running_requests() is not the set of live rows")
    st = s.stats()  # counted as things happen: they must agree with the state
    counted = (st.running, st.waiting + st.preempted, st.pages_reserved, st.pages_marked)
    actual = (
        len(s.running_requests()), len(s.waiting_requests()), sum(len(v.reserved_pages) for v in views),
        int(np.count_nonzero(pool.marked)),
    )
    if counted != actual:
        raise ShadowViolation(f"stats() counts (running, waiting, reserved, marked) {counted}, the state holds {actual}")
    free = pool.free_pages().tolist()
    if len(set(free)) != len(free):
        raise ShadowViolation("the free list holds a page twice")
    free_set = set(free)
    lru = set(cache.evictable_pages())
    for page in range(pool.num_kv_pages):
        rc = int(pool.refcount[page])
        if rc != held[page]:
            raise ShadowViolation(f"page {page}: refcount {rc}, held by {held[page]} rows")
        in_lru = page in lru
        if page in free_set:
            if rc or cache.is_cached(page) or not pool.marked[page]:
                raise ShadowViolation(f"free page {page} is referenced, cached or unmarked")
        elif rc == 0 and not in_lru:
            raise ShadowViolation(f"page {page} is leaked: not free, not referenced, not evictable")
        if in_lru and (rc or not cache.is_cached(page)):
            raise ShadowViolation(f"evictable page {page} is referenced or not a snapshot")
        if cache.is_cached(page) and pool.marked[page]:
            raise ShadowViolation(f"snapshot page {page} is marked")
        if page in committed and pool.marked[page]:
            raise ShadowViolation(f"page {page} is in a page table but still marked")
    slots = list(s.kv.host_free)
    for v in views:
        slots.extend(v.host_slots)
    for plan in plans:
        slots.extend(plan.restore_slots)
    if sorted(slots) != list(range(s.config.num_host_pages)):
        raise ShadowViolation(f"host slots leaked or double-owned: {sorted(slots)}")


@dataclass
class InFlight:
    plan: StepPlan
    table: np.ndarray  # its page tables, whole, as the executors rebuilt them
    alone: bool  # planned with no other step in flight
    forwards: int | None = None  # the forwards it runs, when it was cut (Driver.cut)
    ran: bool = False
    result: Result | None = None


class Driver:
    """A scheduler, the shadow executors, and the bookkeeping of every request's outputs."""

    def __init__(self, s: Scheduler, vocab: int = 50, seed: int = 0, seeded_model: bool = False) -> None:
        cfg = s.config
        self.s = s
        self.shadow = Shadow(cfg.num_kv_pages, cfg.page_size, cfg.num_host_pages)
        self.rng = np.random.default_rng(seed)
        self.seeded_model = seeded_model
        self.vocab = vocab
        self.inflight: list[InFlight] = []
        self.finished: dict[int, str] = {}
        self.emitted: dict[int, list[int]] = {}
        self.prompt_len: dict[int, int] = {}
        self.max_tokens: dict[int, int] = {}
        self.stops: dict[int, frozenset[int]] = {}
        self.plans: list[StepPlan] = []
        self.tables: dict[int, list[int]] = {}  # step -> its page tables, whole and concatenated
        self.forced: dict[int, int] = {}  # request id -> the token its next sample will be
        self.held: StepPlan | None = None  # the step whose PREPARE the executors hold (CONTINUE's base)
        self.continued = 0  # steps that went out as a CONTINUE
        self.ran_forwards: list[tuple[StepPlan, int]] = []  # each step run, and the forwards it ran

    def add(self, rid: int, prompt: list[int], params, **kw) -> None:
        self.s.add_request(rid, prompt, params, **kw)
        self.shadow.add(rid, prompt)
        self.emitted[rid] = []
        self.prompt_len[rid] = len(prompt)
        self.max_tokens[rid] = params.max_tokens
        eos = () if params.ignore_eos else self.s.config.eos_token_ids
        self.stops[rid] = frozenset(eos) | frozenset(params.stop_token_ids)

    def take(self, outputs) -> None:
        for out in outputs:
            if out.request_id in self.finished:
                raise ShadowViolation(f"request {out.request_id} reported after it finished")
            self.emitted[out.request_id].extend(out.token_ids)
            if out.finished:
                self.finished[out.request_id] = out.finish_reason

    @property
    def can_plan(self) -> bool:
        return len(self.inflight) < self.s.config.max_inflight_steps

    def plan(self) -> StepPlan | None:
        alone = not self.inflight
        plan = self.s.plan_step()
        self.take(self.s.drain_outputs())
        if plan is not None:
            self.plans.append(plan)
            table = self.shadow.receive(self.wire(plan))
            self.tables[plan.step] = table.tolist()
            self.inflight.append(InFlight(plan, table, alone))
            self.check_tables(plan, table)
        self.check()
        return plan

    def wire(self, plan: StepPlan) -> Prepare:
        """The PREPARE the executors run for the plan: its own, or the expansion of its CONTINUE
        when they hold the step before's (the engine's conversation sends it only then)."""
        held, self.held = self.held, plan
        if plan.brief is None or held is None or held.step != plan.step - 1:
            return plan.prepare
        self.continued += 1
        got = expand(held.prepare, plan.brief)
        for name in ARRAY_DTYPES[Prepare]:
            a, b = getattr(got, name), getattr(plan.prepare, name)
            if a.dtype != b.dtype or not np.array_equal(a, b):
                raise ShadowViolation(f"step {plan.step}: the CONTINUE expands {name} to {a}, the scheduler's is {b}")
        return got

    def check_tables(self, plan: StepPlan, table: np.ndarray) -> None:
        """The tables the executors rebuild from the deltas are the scheduler's page tables."""
        p, s = plan.prepare, self.s
        rebuilt = np.split(table, np.cumsum(p.page_table_lens)[:-1])
        for i, rid in enumerate(p.seq_ids.tolist()):
            want = list(s.request_state(rid).page_table)
            if rebuilt[i].tolist() != want:
                raise ShadowViolation(
                    f"request {int(p.seq_ids[i])}: the executors rebuild page table {rebuilt[i].tolist()} "
                    f"from base {int(p.page_table_base[i])}, the scheduler holds {want}"
                )

    def check(self) -> None:
        """The pool's invariants, and every page a step in flight uses is held (none is free or
        evictable, so none can be handed out or cleared before that step has run). A step planned
        alone may reuse the pages it offloads: the executors copy them out before its clears."""
        check_pool(self.s, [f.plan for f in self.inflight], self.shadow.spare)
        pool, lru = self.s.pool, set(self.s.cache.evictable_pages())
        for f in self.inflight:
            p = f.plan.prepare
            used = set(f.table.tolist()) | set(p.restore_pages.tolist())
            if not f.alone:
                used |= set(p.offload_pages.tolist())
            loose = [page for page in sorted(used) if pool.refcount[page] == 0 or page in lru]
            if loose:
                raise ShadowViolation(f"step {f.plan.step} in flight uses pages {loose} that nobody holds")

    def run_next(self) -> None:
        """The oldest step that has not run runs (the engine sent GO for it)."""
        f = next(f for f in self.inflight if not f.ran)
        p = f.plan.prepare
        self.shadow.prepare_effects(p)
        forwards = p.decode_steps if f.forwards is None else f.forwards
        self.ran_forwards.append((f.plan, forwards))
        results = [self.run_forward(p, f.table, forward) for forward in range(forwards)]
        f.ran = True
        f.result = results[0] if len(results) == 1 else Result(
            results[0].seq_ids, *(np.concatenate([getattr(r, name) for r in results]) for name in ("token_ids", "logprobs", "finite"))
        )  # fmt: skip

    def run_forward(self, p: Prepare, table: np.ndarray, forward: int) -> Result:
        """One of the step's forwards (Prepare.decode_steps) and its sample."""
        self.shadow.forward(p, table, forward)
        return self.shadow.sample(p, None if self.seeded_model else self.rng, self.vocab, self.forced)

    def cut(self, forwards: int) -> None:
        """The newest step in flight, of several forwards and not run yet, is cut after `forwards`."""
        f = self.inflight[-1]
        assert not f.ran and 1 <= forwards <= f.plan.prepare.decode_steps
        f.forwards = forwards
        if forwards < f.plan.prepare.decode_steps:
            self.shadow.spare.update(f.plan.prepare.seq_ids.tolist())

    def complete(self, bad_rows: frozenset[int] = frozenset()) -> list:
        """The oldest step in flight runs (if it has not yet) and its RESULT comes back; bad_rows
        are indices of its sampled rows whose logits were not finite."""
        f = self.inflight[0]
        if not f.ran:
            self.run_next()
        self.inflight.pop(0)
        result = f.result
        if bad_rows:
            finite = result.finite.copy()
            finite[[i for i in bad_rows if i < finite.shape[0]]] = 0
            result = Result(result.seq_ids, result.token_ids, result.logprobs, finite)
        outs = self.s.on_result(f.plan, result)
        self.take(outs)
        self.check()
        return outs

    def abort(self, reason: str = "rank 1 rejected the frame", failed=None) -> list:
        """The newest step in flight, which has not run, is aborted (the engine sent ABORT)."""
        f = self.inflight[-1]
        assert not f.ran
        self.inflight.pop()
        self.shadow.tables.drop()  # what every executor does at ABORT
        self.held = None
        outs = self.s.on_abort(f.plan, reason, failed)
        self.take(outs)
        self.check()
        return outs

    def step(self) -> StepPlan | None:
        plan = self.plan()
        if plan is not None:
            self.complete()
        return plan

    def run_to_end(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.s.has_work():
                return
            if self.can_plan and self.plan() is not None and self.can_plan:
                continue
            if self.inflight:
                self.complete()
                continue
            self.take(self.s.drain_outputs())
            if self.s.has_work():
                raise ShadowViolation(f"nothing planned, nothing in flight, work left: {self.s.stats()}")
        raise ShadowViolation(f"work left after {max_steps} steps: {self.s.stats()}")

    def check_outputs(self) -> None:
        """Each finished request emitted exactly the tokens the executors sampled for it, in order
        (a token sampled after it ended excepted), and ended for the reason its tokens give."""
        for rid, reason in self.finished.items():
            out = self.emitted[rid]
            sampled = self.shadow.tokens[rid][self.prompt_len[rid] :]
            if sampled[: len(out)] != out:
                raise ShadowViolation(f"request {rid} emitted {out}, sampled {sampled}")
            if reason == "length" and len(out) != self.max_tokens[rid]:
                raise ShadowViolation(f"request {rid} ended by length after {len(out)} tokens")
            if any(t in self.stops[rid] for t in out[:-1]):
                raise ShadowViolation(f"request {rid} went on after a stop token: {out}")
