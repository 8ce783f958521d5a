"""scripts/bench_engine.py: the engine thread's CPU per token against the fake rank, counted right."""

import pytest

from scripts.bench_engine import measure


def test_every_stream_is_counted_and_the_engine_threads_cpu_is_split_per_token_and_per_step():
    level = measure(concurrency=3, tokens=5, step_ms=1.0)
    assert level["concurrency"] == 3 and level["tokens"] == 15
    assert level["steps"] >= 5  # one per token of a stream, at least; prefills may take steps of their own
    assert level["engine_cpu_us_per_token"] > 0 and level["wall_ms_per_step"] >= 1.0
    per_step_total = level["engine_cpu_us_per_step"] * level["steps"]
    assert per_step_total == pytest.approx(level["engine_cpu_us_per_token"] * level["tokens"], rel=0.01, abs=1.0)
