"""scripts/bench_http.py: the HTTP thread's CPU and calls per streamed token, behind the real app
and server against the fake rank, counted right."""

import pytest

from scripts.bench_http import measure


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_every_streamed_token_is_counted_and_the_threads_cpu_is_split_per_token(route: str) -> None:
    level = measure(concurrency=2, tokens=6, step_ms=1.0, route=route, count_calls=False)
    assert level["concurrency"] == 2 and level["tokens"] == 12  # each stream's usage chunk, summed
    assert level["http_cpu_us_per_token"] > 0 and level["engine_cpu_us_per_token"] > 0
    assert level["tokens_per_s"] > 0


def test_the_http_threads_calls_are_counted_in_that_thread_only() -> None:
    level = measure(concurrency=1, tokens=6, step_ms=1.0, route="chat", count_calls=True)
    # A streamed token is tens of calls in the HTTP thread (docs/control_plane.md: 79), not the
    # thousands a request's set-up or another thread would add if they were counted.
    assert 20 < level["http_calls_per_token"] < 400
