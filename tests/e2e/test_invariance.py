"""The deterministic mode through the real server (docs/invariance.md): TP=2 with the uneven head
split (3 KV groups over 2 ranks), its cache poisoned with NaN and every freed page poisoned again,
gives each request, among 11 concurrent ones, the token ids and logprobs a TP=1 server gives it
alone, bit for bit, greedy and seeded alike, round after round (the later rounds on freed and
poisoned pages, with prefix hits)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import SERVER_OPTIONS, Server

DETERMINISTIC = "--deterministic"
POISON = ("--debug-poison-kv-cache", "--debug-poison-freed-pages")
PROMPTS = (
    "The quick brown fox",
    "The quick brown fox jumps over the lazy dog, and then",
    "Hello",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time in a land far away there lived a king who had three daughters",
)
# Batch mates of other lengths, sent with the prompts above.
MATES = tuple(f"{word} " * (3 + 5 * n) for n, word in enumerate(("alpha", "beta", "gamma", "delta", "epsilon", "zeta")))


def body(prompt: str, seed: int | None) -> dict:
    sampled = {"temperature": 0.9, "top_p": 0.9, "seed": seed} if seed is not None else {"temperature": 0}
    return {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "logprobs": 0, "return_token_ids": True, **sampled}


def answer(server: Server, prompt: str, seed: int | None = None) -> tuple[list[int], list[float]]:
    response = httpx.post(f"{server.url}/v1/completions", json=body(prompt, seed), timeout=180)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def alone_tp1(tiny_model: Path) -> Iterator[Server]:
    server = Server(tiny_model, tp=1, extra=(*SERVER_OPTIONS, DETERMINISTIC))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def poisoned_tp2(tiny_model: Path) -> Iterator[Server]:
    # A small pool, so that pages are freed, poisoned and handed out again within the test.
    options = (*SERVER_OPTIONS[:2], "--num-kv-pages", "40", *SERVER_OPTIONS[4:])
    server = Server(tiny_model, tp=2, extra=(*options, *POISON, DETERMINISTIC))
    try:
        yield server
    finally:
        server.stop()


def test_tp2_among_batch_mates_on_a_poisoned_cache_gives_tp1_alone_bit_for_bit(
    alone_tp1: Server, poisoned_tp2: Server
) -> None:
    cases = [(prompt, None) for prompt in PROMPTS] + [(prompt, 1000 + n) for n, prompt in enumerate(PROMPTS[:3])]
    expected = {case: answer(alone_tp1, *case) for case in cases}
    for _round in range(3):
        with ThreadPoolExecutor(len(cases) + len(MATES)) as pool:
            futures = {case: pool.submit(answer, poisoned_tp2, *case) for case in cases}
            for mate in MATES:
                pool.submit(answer, poisoned_tp2, mate)
            for case, future in futures.items():
                assert future.result() == expected[case], case
    metrics = httpx.get(f"{poisoned_tp2.url}/metrics", timeout=10).text
    assert "tp_runtime_kv_pages_cleared_total 0.0" not in metrics


def test_tp1_among_batch_mates_gives_itself_alone(alone_tp1: Server) -> None:
    expected = {prompt: answer(alone_tp1, prompt) for prompt in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS) + len(MATES)) as pool:
        futures = {prompt: pool.submit(answer, alone_tp1, prompt) for prompt in PROMPTS}
        for mate in MATES:
            pool.submit(answer, alone_tp1, mate)
        for prompt, future in futures.items():
            assert future.result() == expected[prompt], prompt
