"""Planning ahead changes no token: the same greedy requests, served with --async-scheduling (step
N+1 planned, sent and staged while step N runs) and with --no-async-scheduling, give identical
tokens in fp32 at TP=1 and TP=2. The requests end at different steps, so requests stop while the
step after their last one is already planned, and their extra tokens must be discarded."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from scripts.harness.metrics import parse_metrics
from tests.e2e.serving import SERVER_OPTIONS, Server

PROMPTS = ("The quick brown fox", "Hello", "1, 2, 3, 4, 5, 6, 7, 8,", "The quick brown fox jumps over", "a b c")
LENGTHS = (3, 17, 9, 24, 1, 12, 30, 5)


def tokens_of(server: Server) -> list[list[int]]:
    """Every (prompt, length) pair at once, so they share steps and end at different ones."""

    def one(job: tuple[str, int]) -> list[int]:
        prompt, max_tokens = job
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=180)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert len(choice["token_ids"]) == max_tokens
        return choice["token_ids"]

    jobs = [(prompt, length) for prompt in PROMPTS for length in LENGTHS[:4]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def planned_ahead(server: Server) -> float:
    return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)["tp_runtime_steps_planned_ahead_total"]


@pytest.fixture(scope="module")
def serial_tp2(tiny_model: Path) -> Iterator[Server]:
    server = Server(tiny_model, tp=2, extra=(*SERVER_OPTIONS, "--no-async-scheduling"))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_are_identical_with_and_without_planning_ahead(tp, request) -> None:
    overlapped = request.getfixturevalue(f"server_tp{tp}")
    serial = request.getfixturevalue(f"serial_tp{tp}")
    before = planned_ahead(overlapped)
    assert tokens_of(overlapped) == tokens_of(serial)
    assert planned_ahead(overlapped) > before, "the default server did not plan a step ahead"
    assert planned_ahead(serial) == 0
