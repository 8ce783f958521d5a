"""Seeded random walks with up to two steps in flight (random_walk.py) against the shadow model,
and proof that they reach every situation planning ahead must survive."""

from __future__ import annotations

import os
from collections import Counter

from tests.scheduler.random_walk import Walk

SEEDS = range(400 if os.environ.get("SCHED_SLOW") == "1" else 60)
MUST_SEE = (
    "planned ahead", "feedback rows", "ended at N with N+1 planned", "client ended with a step in flight",
    "abort (all) of N+1", "abort (some or none) of N+1", "preempted by recompute ahead", "preempted by offload ahead",
    "prefix hit ahead", "nothing can run before the step in flight ends", "sent as CONTINUE",
    "several forwards ahead", "cut",
)


def test_random_walks_keep_every_invariant_and_reach_every_case():
    seen: Counter[str] = Counter()
    for seed in SEEDS:
        seen += Walk(seed).run(120)
    missing = [case for case in MUST_SEE if not seen[case]]
    assert not missing, f"the walks never reached {missing}: {dict(seen)}"
