"""Several forwards on one frame (--num-scheduler-steps 4) through the real server: what every kind
of request gets is what it gets from one forward per frame (the session's TP=1 server, fp32), each
request alone so that its steady decode runs as frames of several forwards. The ranks feed each
forward's samples to the next themselves: seeded draws, penalties, alternatives, min_tokens, stop
tokens and strings, n, and output grammars must all come out as if a frame had carried each one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import SERVER_OPTIONS, RecordedStream, Server
from tests.e2e.test_vllm_client import GRAMMARS

REQUESTS = (
    {"prompt": "The quick brown fox", "max_tokens": 30, "temperature": 0, "ignore_eos": True},
    {"prompt": "Hello", "max_tokens": 27, "temperature": 0.9, "seed": 11, "ignore_eos": True, "logprobs": 3},
    {"prompt": "1, 2, 3,", "max_tokens": 25, "temperature": 0.8, "top_p": 0.9, "seed": 5, "presence_penalty": 1.2,
     "frequency_penalty": 0.4, "repetition_penalty": 1.3, "ignore_eos": True},
    {"prompt": "Once upon", "max_tokens": 21, "temperature": 1.0, "seed": 3, "n": 2, "min_tokens": 9},
    {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "stop": ["e"], "ignore_eos": True},
    {"prompt": "Hello", "max_tokens": 30, "temperature": 0, "logit_bias": {"7": 5.0}, "return_token_ids": True},
    *({"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "return_token_ids": True, **g} for g in GRAMMARS),
)  # fmt: skip


@pytest.fixture(scope="module")
def several_forwards(tiny_model: Path) -> Iterator[Server]:
    server = Server(tiny_model, tp=1, extra=(*SERVER_OPTIONS, "--num-scheduler-steps", "4"))
    try:
        yield server
    finally:
        server.stop()


def completion(server: Server, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    out.pop("id"), out.pop("created")
    return out


@pytest.mark.parametrize("body", REQUESTS, ids=lambda body: ",".join(k for k in body if k != "prompt"))
def test_every_request_gets_what_one_forward_per_frame_gives(server_tp1: Server, several_forwards: Server, body) -> None:
    before = several_forwards.settled_metrics()
    got, want = completion(several_forwards, body), completion(server_tp1, body)
    assert got == want
    after = several_forwards.settled_metrics(since=before)
    forwards = after["tp_runtime_model_forwards_total"] - before["tp_runtime_model_forwards_total"]
    steps = after["tp_runtime_steps_total"] - before["tp_runtime_steps_total"]
    assert forwards > steps, "the request never ran a frame of several forwards"


def test_a_stream_gets_several_tokens_per_chunk_and_exactly_max_tokens(several_forwards: Server) -> None:
    body = {"prompt": "Hello", "max_tokens": 23, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{several_forwards.url}/v1/completions", json=stream, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(e) for e in events]
    tokens = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or ()]
    assert len(tokens) == 23 == chunks[-1]["usage"]["completion_tokens"]
    with_tokens = [c for c in chunks if any(choice.get("token_ids") for choice in c["choices"])]
    assert len(with_tokens) < len(tokens)  # a frame's tokens reach the client together
    whole = completion(several_forwards, body)
    assert whole["choices"][0]["token_ids"] == tokens


def test_an_arrival_cuts_the_step_in_flight_and_both_requests_get_their_tokens(
    server_tp1: Server, several_forwards: Server
) -> None:
    """A request that arrives while a step of several forwards runs has it cut (CUT) after the
    forward running, rather than wait for all of them; neither request's tokens change."""
    long = {"prompt": "Once upon a time", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    short = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for _attempt in range(10):  # an arrival may fall between two steps, where nothing is cut
        before = several_forwards.settled_metrics()
        stream = RecordedStream(several_forwards.url, long["prompt"], long["max_tokens"], temperature=0)
        second = completion(several_forwards, short)
        stream.join(60)
        after = several_forwards.settled_metrics(since=before)
        if after["tp_runtime_steps_cut_total"] > before["tp_runtime_steps_cut_total"]:
            break
    else:
        pytest.fail("no arrival in ten ever found a step of several forwards in flight")
    assert second == completion(server_tp1, short)
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.lines if line.startswith("data: {"))
    assert text == completion(server_tp1, long)["choices"][0]["text"]
