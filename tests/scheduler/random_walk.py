"""Seeded random walks of the engine's operations with up to two steps in flight, through the
shadow executors, counting the situations they reached (test_random_walks.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from scheduler import AdmissionError, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.sched_sim import Driver

PREFIXES = [[], [7, 8, 9, 10, 11], [7, 8, 9, 10, 11, 12, 13, 14], [3] * 12]
VOCAB = 40


def config(rng: np.random.Generator) -> SchedulerConfig:
    seqs = int(rng.integers(1, 5))
    page_size = int(rng.choice([2, 4]))
    return SchedulerConfig(
        num_kv_pages=int(rng.integers(8, 17)), page_size=page_size, max_num_seqs=seqs,
        max_num_batched_tokens=seqs + int(rng.integers(0, 13)), max_model_len=32, eos_token_ids=(2,),
        num_host_pages=int(rng.choice([0, 8, 16, 32])), enable_prefix_cache=bool(rng.integers(0, 4)),
        poison_freed_pages=bool(rng.integers(0, 2)), decode_lookahead=int(rng.integers(0, 3)),
        max_inflight_steps=int(rng.choice([1, 2, 2])),
        num_scheduler_steps=int(rng.choice([1, 2, page_size, page_size])),
    )


class Walk:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.d = Driver(Scheduler(config(self.rng)), vocab=VOCAB, seed=seed)
        self.seen: Counter[str] = Counter()
        self.next_id = 0

    def add(self) -> None:
        rng, d = self.rng, self.d
        samples = bool(rng.integers(0, 3) == 0)
        first, prompt = self.next_id, None
        for k in range(int(rng.integers(1, 4))):
            if not (samples and prompt):
                prompt = (PREFIXES[int(rng.integers(0, 4))] + rng.integers(3, VOCAB, size=int(rng.integers(0, 10))).tolist()) or [4]
            params = SamplingParams(
                max_tokens=int(rng.integers(1, 13)), ignore_eos=bool(rng.integers(0, 2)),
                stop_token_ids=(5,) if rng.integers(0, 2) else (),
            )
            try:
                d.add(self.next_id, prompt, params, prompt_leader=first if samples and k else None)
            except AdmissionError:
                pass
            self.next_id += 1

    def plan(self) -> None:
        d = self.d
        ahead, before, continued = bool(d.inflight), d.s.stats(), d.continued
        plan = d.plan()
        if not ahead:
            return
        if plan is None:
            self.seen["nothing can run before the step in flight ends"] += 1
            return
        after = d.s.stats()
        self.seen["planned ahead"] += 1
        if plan.prepare.feedback.any():
            self.seen["feedback rows"] += 1
        if d.continued > continued:
            self.seen["sent as CONTINUE"] += 1
        if plan.prepare.decode_steps > 1:
            self.seen["several forwards ahead"] += 1
        if after.preemptions_total > before.preemptions_total:
            self.seen["preempted by offload ahead" if plan.offloaded else "preempted by recompute ahead"] += 1
        if after.prefix_hit_pages_total > before.prefix_hit_pages_total:
            self.seen["prefix hit ahead"] += 1

    def complete(self) -> None:
        d = self.d
        ahead = len(d.inflight) > 1
        outs = d.complete(frozenset({0}) if self.rng.integers(0, 10) == 0 else frozenset())
        if ahead and any(o.finished and o.token_ids for o in outs):
            self.seen["ended at N with N+1 planned"] += 1

    def abort(self) -> None:
        d = self.d
        ids = d.inflight[-1].plan.prepare.seq_ids.tolist()
        how = int(self.rng.integers(0, 3))
        failed = None if how == 0 else [i for i in ids if self.rng.integers(0, 2)] if how == 1 else []
        ahead = len(d.inflight) > 1
        d.abort(failed=failed)
        self.seen[f"abort ({'all' if failed is None else 'some or none'}){' of N+1' if ahead else ''}"] += 1

    def end(self) -> None:
        d = self.d
        rid = int(self.rng.integers(0, self.next_id))
        (d.s.cancel if self.rng.integers(0, 2) else d.s.finish)(rid)
        d.take(d.s.drain_outputs())
        if d.inflight:
            self.seen["client ended with a step in flight"] += 1
        d.check()

    def run(self, ops: int) -> Counter[str]:
        rng, d = self.rng, self.d
        for _ in range(ops):
            r = int(rng.integers(0, 12))
            if r < 2:
                self.add()
            elif r < 5 and d.can_plan:
                self.plan()
            elif r < 6 and len(d.inflight) > 1 and not d.inflight[0].ran:
                d.run_next()
            elif r < 9 and d.inflight:
                self.complete()
            elif r < 10 and d.inflight and not d.inflight[-1].ran:
                newest = d.inflight[-1].plan.prepare.decode_steps
                if newest > 1 and rng.integers(0, 4):
                    d.cut(int(rng.integers(1, newest)))
                    self.seen["cut"] += 1
                else:
                    self.abort()
            elif r < 11 and self.next_id:
                self.end()
        while d.inflight:
            d.complete()
        d.run_to_end()
        d.check_outputs()
        st = d.s.stats()
        assert st.running == st.waiting == st.preempted == 0, st
        d.s.cache.evict(d.s.cache.evictable_count)
        assert d.s.pool.free_count == d.s.config.num_kv_pages, "pages never came back"
        assert st.host_pages_free == d.s.config.num_host_pages
        return self.seen
