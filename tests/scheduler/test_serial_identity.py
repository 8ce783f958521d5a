"""With one step in flight the scheduler plans exactly what it planned before the split and the
pipelining: every PREPARE of 60 seeded scenarios (tight pools, chunked prefill, prefix hits and
evictions, lookahead, offload and recompute preemption, poison, aborted steps, mismatched RESULTs,
non-finite rows, cancel and finish at any time) is byte-identical to the one recorded from commit
afdec79, and every request streams the same tokens and ends the same way (serial_scenarios.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scheduler.serial_scenarios import SEEDS, run

RECORDED = {r["seed"]: r for r in json.loads((Path(__file__).parent / "data" / "serial_prepares.json").read_text())}


@pytest.mark.parametrize("seed", list(SEEDS))
def test_prepares_are_byte_identical_to_the_recorded_ones(seed):
    got, want = run(seed), RECORDED[seed]
    steps, expected = got["steps"].split(), want["steps"].split()
    for i, (a, b) in enumerate(zip(steps, expected)):
        assert a == b, f"seed {seed}: PREPARE {i} differs from the recorded one"
    assert len(steps) == len(expected)
    assert got["transcript"] == want["transcript"]


def test_the_check_can_fail():
    """A scheduler that plans differently (here: one more KV page) fails the comparison."""
    import tests.scheduler.serial_scenarios as scenarios

    original = scenarios.config_for

    def bigger(rng, big):
        cfg = original(rng, big)
        return type(cfg)(**{**cfg.__dict__, "num_kv_pages": cfg.num_kv_pages + 1})

    scenarios.config_for = bigger
    try:
        differs = [run(seed)["steps"] != RECORDED[seed]["steps"] for seed in (0, 3, 4)]
    finally:
        scenarios.config_for = original
    assert any(differs)
