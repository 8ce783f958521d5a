"""A simulated executor with a shadow model of every KV slot, and the scheduler's invariants.

A slot holds GARBAGE (never written, or poisoned), ZERO (cleared) or the KV a sequence wrote at one
position, named by the whole token prefix up to that position (the KV of a token depends on every
token before it). The simulator applies a PREPARE the way executors do (offload, poison, restore,
clear, then the forward's writes) and checks what attention reads: every slot of every page in a
sequence's page table, past the sequence's length included.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from protocol.frames import Prepare, Result
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
    tokens: dict[int, list[int]] = field(default_factory=dict)  # request id -> known tokens
    # The page tables as the executors hold them: a PREPARE's deltas apply to these.
    tables: HeldPageTables = field(default_factory=HeldPageTables)
    full_table: np.ndarray = field(init=False)  # the last PREPARE's tables, whole

    def __post_init__(self) -> None:
        # Cache memory starts uninitialized.
        self.pages = [[GARBAGE] * self.page_size for _ in range(self.num_kv_pages)]

    def add(self, request_id: int, prompt: list[int]) -> None:
        self.tokens[request_id] = list(prompt)

    def kv(self, request_id: int, pos: int) -> tuple[int, ...]:
        return tuple(self.tokens[request_id][: pos + 1])

    def prepare_effects(self, p: Prepare) -> None:
        """Everything an executor does before READY, in its order."""
        self.full_table = self.tables.apply(p)
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

    def forward(self, p: Prepare) -> None:
        """Check the frame's shape, write each new token's KV, then check every read."""
        ps = self.page_size
        cleared = p.cleared_pages.tolist()
        if cleared != sorted(set(cleared)):
            raise ShadowViolation(f"cleared_pages {cleared} not sorted and unique")
        if set(cleared) & set(p.restore_pages.tolist()):
            raise ShadowViolation("a restore target is listed in cleared_pages")
        n = p.seq_ids.shape[0]
        if len(set(p.seq_ids.tolist())) != n:
            raise ShadowViolation("a sequence appears twice in one step")
        q0 = 0
        t0 = 0
        tables = []
        for i in range(n):
            rid = int(p.seq_ids[i])
            q, ctx, ptl = int(p.query_lens[i]), int(p.context_lens[i]), int(p.page_table_lens[i])
            table = self.full_table[t0 : t0 + ptl].tolist()
            t0 += ptl
            tables.append((rid, ctx, table))
            if ptl != -(-ctx // ps):
                raise ShadowViolation(f"request {rid}: {ptl} pages for {ctx} tokens")
            if q < 1:
                raise ShadowViolation(f"request {rid} scheduled with {q} tokens")
            toks = self.tokens[rid]
            for j in range(q):
                pos = int(p.positions[q0 + j])
                if pos != ctx - q + j:
                    raise ShadowViolation(f"request {rid}: position {pos}, expected {ctx - q + j}")
                if int(p.token_ids[q0 + j]) != toks[pos]:
                    raise ShadowViolation(f"request {rid}: token at {pos} is {int(p.token_ids[q0 + j])}, not {toks[pos]}")
                page = table[pos // ps]
                slot = self.pages[page]
                if slot[pos % ps] != ZERO:
                    raise ShadowViolation(
                        f"request {rid} writes position {pos} into page {page} whose slot holds {slot[pos % ps]!r}"
                    )
                slot[pos % ps] = self.kv(rid, pos)
            q0 += q
            if bool(p.sample[i]) != (ctx == len(toks)):
                raise ShadowViolation(f"request {rid}: sample flag {p.sample[i]} with {ctx} of {len(toks)} tokens")
        for rid, ctx, table in tables:
            for k, page in enumerate(table):
                for j, content in enumerate(self.pages[page]):
                    pos = k * ps + j
                    want = self.kv(rid, pos) if pos < ctx else ZERO
                    if content != want:
                        raise ShadowViolation(
                            f"request {rid} (length {ctx}) reads page {page} slot {j} (position {pos}): "
                            f"{content!r:.60} instead of {want!r:.60}"
                        )

    def result(self, p: Prepare, rng: np.random.Generator, vocab: int, bad_rows: frozenset[int] = frozenset()) -> Result:
        """Sample a token for each sampled row (and record it as the request's next token)."""
        idx = np.flatnonzero(p.sample)
        ids = p.seq_ids[idx]
        toks = rng.integers(0, vocab, size=idx.shape[0]).astype(np.int32)
        finite = np.ones(idx.shape[0], dtype=np.uint8)
        for i in bad_rows:
            if i < finite.shape[0]:
                finite[i] = 0
        for rid, t, ok in zip(ids.tolist(), toks.tolist(), finite.tolist()):
            if ok:
                self.tokens[rid].append(t)
        return Result(
            seq_ids=ids.astype(np.int64),
            token_ids=toks,
            logprobs=np.zeros(idx.shape[0], dtype=np.float32),
            finite=finite,
        )


def check_pool(s: Scheduler, inflight: StepPlan | None = None) -> None:
    """Ownership and refcounts: every page is free, referenced by rows, or an evictable snapshot."""
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
        if len(v.page_table) != -(-v.num_computed // ps):
            raise ShadowViolation(f"request {v.request_id} has {len(v.page_table)} pages for {v.num_computed} tokens")
        if not pool.marked[list(v.reserved_pages)].all():
            raise ShadowViolation(f"request {v.request_id} reserves unmarked pages {v.reserved_pages}")
    if sorted(s.running_requests()) != sorted(v.request_id for v in views if v.live):
        raise ShadowViolation("running_requests() is not the set of live rows")
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
    if inflight is not None:
        slots.extend(inflight.restore_slots)
    if sorted(slots) != list(range(s.config.num_host_pages)):
        raise ShadowViolation(f"host slots leaked or double-owned: {sorted(slots)}")


class Driver:
    """A scheduler, the shadow executor, and the bookkeeping of every request's outputs."""

    def __init__(self, s: Scheduler, vocab: int = 50, seed: int = 0) -> None:
        cfg = s.config
        self.s = s
        self.shadow = Shadow(cfg.num_kv_pages, cfg.page_size, cfg.num_host_pages)
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.inflight: StepPlan | None = None
        self.finished: dict[int, str] = {}
        self.emitted: dict[int, list[int]] = {}
        self.prompt_len: dict[int, int] = {}
        self.max_tokens: dict[int, int] = {}
        self.plans: list[StepPlan] = []
        self.tables: dict[int, list[int]] = {}  # step -> its page tables, whole and concatenated

    def add(self, rid: int, prompt: list[int], params) -> None:
        self.s.add_request(rid, prompt, params)
        self.shadow.add(rid, prompt)
        self.emitted[rid] = []
        self.prompt_len[rid] = len(prompt)
        self.max_tokens[rid] = params.max_tokens

    def take(self, outputs) -> None:
        for out in outputs:
            if out.request_id in self.finished:
                raise ShadowViolation(f"request {out.request_id} reported after it finished")
            self.emitted[out.request_id].extend(out.token_ids)
            if out.finished:
                self.finished[out.request_id] = out.finish_reason

    def plan(self) -> StepPlan | None:
        plan = self.s.plan_step()
        self.take(self.s.drain_outputs())
        if plan is not None:
            self.inflight = plan
            self.plans.append(plan)
            self.shadow.prepare_effects(plan.prepare)
            self.tables[plan.step] = self.shadow.full_table.tolist()
            self.check_tables(plan)
            check_pool(self.s, plan)
        return plan

    def check_tables(self, plan: StepPlan) -> None:
        """The tables the executors rebuild from the deltas are the scheduler's page tables."""
        p, s = plan.prepare, self.s
        rebuilt = np.split(self.shadow.full_table, np.cumsum(p.page_table_lens)[:-1])
        for i, rid in enumerate(p.seq_ids.tolist()):
            want = list(s.request_state(rid).page_table)
            if rebuilt[i].tolist() != want:
                raise ShadowViolation(
                    f"request {int(p.seq_ids[i])}: the executors rebuild page table {rebuilt[i].tolist()} "
                    f"from base {int(p.page_table_base[i])}, the scheduler holds {want}"
                )

    def complete(self, bad_rows: frozenset[int] = frozenset()) -> None:
        plan = self.inflight
        assert plan is not None
        self.shadow.forward(plan.prepare)
        result = self.shadow.result(plan.prepare, self.rng, self.vocab, bad_rows)
        self.inflight = None
        outs = self.s.on_result(plan, result)
        self.take(outs)
        # A request that was cancelled or stopped while its step ran never gets that token.
        got = {o.request_id for o in outs if o.token_ids}
        for rid, ok in zip(result.seq_ids.tolist(), result.finite.tolist()):
            if ok and rid not in got:
                self.shadow.tokens[rid].pop()
        check_pool(self.s)

    def abort(self, reason: str = "rank 1 rejected the frame") -> list:
        plan = self.inflight
        assert plan is not None
        self.inflight = None
        self.shadow.tables.drop()  # what every executor does at ABORT
        outs = self.s.on_abort(plan, reason)
        self.take(outs)
        check_pool(self.s)
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
            if self.step() is None and not self.s.has_work():
                return
        raise ShadowViolation(f"work left after {max_steps} steps: {self.s.stats()}")

    def check_outputs(self) -> None:
        """Each finished request's emitted tokens are exactly what it sampled, within its limits."""
        for rid, reason in self.finished.items():
            out = self.emitted[rid]
            sampled = self.shadow.tokens[rid][self.prompt_len[rid] :]
            if sampled != out:
                raise ShadowViolation(f"request {rid} emitted {out}, sampled {sampled}")
            if reason == "length" and len(out) != self.max_tokens[rid]:
                raise ShadowViolation(f"request {rid} ended by length after {len(out)} tokens")
