"""scripts/bench_engine.py: the engine thread's CPU per token against the fake rank, counted right."""

import pytest

from scripts.bench_engine import counting_engine_calls, measure
from tp_runtime.engine import Engine


def test_every_stream_is_counted_and_the_engine_threads_cpu_is_split_per_token_and_per_step():
    level = measure(concurrency=3, tokens=5, step_ms=1.0)
    assert level["concurrency"] == 3 and level["tokens"] == 15
    assert level["steps"] >= 5  # one per token of a stream, at least; prefills may take steps of their own
    assert level["engine_cpu_us_per_token"] > 0 and level["wall_ms_per_step"] >= 1.0
    per_step_total = level["engine_cpu_us_per_step"] * level["steps"]
    assert per_step_total == pytest.approx(level["engine_cpu_us_per_token"] * level["tokens"], rel=0.01, abs=1.0)


def test_calls_are_counted_in_the_engine_thread_only_and_the_engine_is_restored_after():
    run = Engine._run
    with counting_engine_calls() as counter:
        level = measure(concurrency=1, tokens=5, step_ms=1.0, counter=counter)
        counted = counter.calls
    assert Engine._run is run
    assert level["steps"] >= 5 and level["engine_calls_per_step"] > 50  # a step is hundreds of calls
    assert counted >= level["engine_calls_per_step"] * level["steps"]  # the window is part of the thread's life


def test_several_forwards_per_frame_are_fewer_steps_for_the_same_tokens():
    level = measure(concurrency=1, tokens=17, step_ms=1.0, forwards=8)
    assert level["tokens"] == 17
    # The prompt's step samples one token; the other 16 come in two frames of 8.
    assert level["steps"] == 3
