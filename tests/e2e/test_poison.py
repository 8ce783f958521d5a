"""The clearing rule, proven through the real server at TP=2 with real HTTP clients.

The cache is poisoned with 0xFF bytes (NaN in every float format) at allocation and every page
that returns to the free pool is poisoned again. With clears on, greedy output is token-identical
to a server without poison; with clears skipped, the damage is detected: the requests fail with a
non-finite-logits error and no text. Both directions are asserted, so the proof can fail.

The poisoned server runs steady decode steps of several forwards on one frame (--num-scheduler-steps):
the pages its later forwards open are cleared before its first, and each forward's tokens reach
the other rank as feedback does, so its text is still the clean one-forward-per-frame server's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scripts.harness.metrics import parse_metrics
from tests.e2e.serving import SERVER_OPTIONS, RecordedStream, Server

POISON = ("--debug-poison-kv-cache", "--debug-poison-freed-pages")
# Prompts that share a prefix (snapshot reuse) and lengths that end mid-page (tail slots are read).
PROMPTS = ("The quick brown fox", "The quick brown fox jumps over", "Hello", "1, 2, 3, 4, 5, 6, 7, 8,", "Hello")


def greedy(server: Server, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def poisoned(tiny_model: Path) -> Iterator[Server]:
    # A small pool so pages are freed, poisoned and handed out again within the test.
    options = (*SERVER_OPTIONS[:2], "--num-kv-pages", "24", *SERVER_OPTIONS[4:], "--num-scheduler-steps", "4")
    server = Server(tiny_model, tp=2, extra=(*options, *POISON))
    try:
        yield server
    finally:
        server.stop()


def test_poisoned_cache_with_clears_matches_an_unpoisoned_server(server_tp2: Server, poisoned: Server) -> None:
    for _round in range(2):  # the second round runs on pages that were freed and poisoned
        for prompt in PROMPTS:
            clean, dirty = greedy(server_tp2, prompt), greedy(poisoned, prompt)
            assert clean.status_code == dirty.status_code == 200, dirty.text
            assert dirty.json()["choices"][0]["text"] == clean.json()["choices"][0]["text"], prompt
    text = httpx.get(f"{poisoned.url}/metrics", timeout=10).text
    assert "tp_runtime_kv_pages_cleared_total 0.0" not in text
    # The proof holds with steps planned ahead (the default): their pages are cleared all the same.
    assert "tp_runtime_steps_planned_ahead_total 0.0" not in text
    # ... and with several forwards on one frame.
    metrics = parse_metrics(text)
    assert metrics["tp_runtime_model_forwards_total"] > metrics["tp_runtime_steps_total"]


def test_skipped_clears_are_detected_and_no_text_is_sent(tiny_model: Path) -> None:
    server = Server(tiny_model, tp=2, extra=(*SERVER_OPTIONS, *POISON, "--debug-skip-clears"))
    try:
        failures = [greedy(server, prompt) for prompt in PROMPTS[:3]]
        for response in failures:
            assert response.status_code >= 500, response.text
            assert "finite" in response.json()["error"]["message"].lower(), response.text
        streamed = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True},
            timeout=120,
        )
        texts = [line for line in streamed.text.splitlines() if line.startswith("data: ") and '"text"' in line]
        assert all('"text":""' in line.replace(" ", "") for line in texts), texts
        assert "finite" in streamed.text.lower()
    finally:
        server.stop()


def test_a_cut_step_keeps_both_ranks_in_step_on_a_poisoned_cache(server_tp2: Server, poisoned: Server) -> None:
    """An arrival cuts a step of several forwards: rank 0 decides after which forward and tells rank
    1 with the tokens it broadcasts, so both run the same collectives; the pages the forwards
    that did not run opened stay zeroed in the tables, and the text stays the clean server's."""
    long_prompt, short_prompt = "1, 2, 3, 4, 5, 6, 7, 8,", "Hello"
    for _attempt in range(10):  # an arrival may fall between two steps, where nothing is cut
        before = poisoned.settled_metrics()
        stream = RecordedStream(poisoned.url, long_prompt, 100, temperature=0)
        short = greedy(poisoned, short_prompt)
        stream.join(120)
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.lines if line.startswith("data: {"))
        after = poisoned.settled_metrics(since=before)
        if after["tp_runtime_steps_cut_total"] > before["tp_runtime_steps_cut_total"]:
            break
    else:
        pytest.fail("no arrival in ten ever found a step of several forwards in flight")
    assert short.status_code == 200, short.text
    assert short.json()["choices"][0]["text"] == greedy(server_tp2, short_prompt).json()["choices"][0]["text"]
    clean = httpx.post(
        f"{server_tp2.url}/v1/completions",
        json={"prompt": long_prompt, "max_tokens": 100, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert text == clean.json()["choices"][0]["text"]
