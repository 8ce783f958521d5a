"""The real server at TP=2 on the CPU: real processes, real sockets, real HTTP clients."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.e2e.serving import Server

FUZZ_CLIENTS = 8

PROMPTS = ("Hello there", "The quick brown fox", "1, 2, 3, 4,", "Name the capital of France.")


def metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def model_id(server: Server) -> str:
    return client(server).models.list().data[0].id


def test_generate_endpoint(server_tp2: Server) -> None:
    body = {"text": "Hello", "sampling_params": {"max_completion_tokens": 6, "ignore_eos": True}}
    whole = httpx.post(f"{server_tp2.url}/generate", json=body, timeout=60)
    assert whole.status_code == 200
    assert whole.text.startswith("data: ")
    with httpx.stream("POST", f"{server_tp2.url}/generate", json={**body, "stream": True}, timeout=60) as streamed:
        assert streamed.status_code == 200
        raw = streamed.read().decode()
    # One SSE event per piece; a piece with newlines is split over several data lines.
    events = ["\n".join(line[len("data: "):] for line in event.splitlines() if line.startswith("data: ")) for event in raw.split("\n\n")]
    pieces = [e for e in events if e]
    assert pieces, "a streamed /generate sent no data events"
    assert "".join(pieces) == whole.text[len("data: "):].rstrip("\n")


def test_openai_client_completions_and_chat(server_tp2: Server) -> None:
    api = client(server_tp2)
    name = model_id(server_tp2)
    completion = api.completions.create(model=name, prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens > 0
    streamed = "".join(
        chunk.choices[0].text
        for chunk in api.completions.create(
            model=name, prompt="Hello", max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        if chunk.choices
    )
    assert streamed == completion.choices[0].text
    chat = api.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 4
    deltas = [
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        if chunk.choices
    ]
    assert "".join(deltas) == chat.choices[0].message.content


def test_32_concurrent_requests_are_all_answered(server_tp2: Server) -> None:
    async def one(http: httpx.AsyncClient, i: int) -> dict:
        response = await http.post(
            "/v1/completions",
            json={"prompt": f"request {i}: " + "x" * (i % 7), "max_tokens": 8, "ignore_eos": True, "seed": i, "temperature": 0.8},
        )
        assert response.status_code == 200, response.text
        return response.json()

    async def all_of_them() -> list[dict]:
        async with httpx.AsyncClient(base_url=server_tp2.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    answers = asyncio.run(all_of_them())
    assert len({a["id"] for a in answers}) == 32
    assert all(a["usage"]["completion_tokens"] == 8 for a in answers)


def test_client_that_disconnects_is_cancelled(server_tp2: Server) -> None:
    cancels_before = metric(server_tp2, "tp_runtime_request_cancels_total")
    body = {"prompt": "go on and on", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server_tp2.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(server_tp2, "tp_runtime_requests_running") == 0 and metric(server_tp2, "tp_runtime_request_cancels_total") > cancels_before:
            break
        time.sleep(0.1)
    assert metric(server_tp2, "tp_runtime_request_cancels_total") > cancels_before
    assert metric(server_tp2, "tp_runtime_requests_running") == 0, "the cancelled request still runs"


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/v1/completions", b"{not json", "JSON"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "word " * 400, "max_tokens": 4}, "context"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, "no-such-model"),
        ("/v1/chat/completions", {"messages": "not a list"}, "messages"),
        ("/generate", {"text": 42}, "text"),
    ],
)
def test_bad_input_gets_a_4xx_json_error_and_the_server_goes_on(server_tp2: Server, path: str, body, needle: str) -> None:
    if isinstance(body, bytes):
        response = httpx.post(f"{server_tp2.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        response = httpx.post(f"{server_tp2.url}{path}", json=body, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    message = response.json()["error"]["message"]
    assert needle.lower() in message.lower(), message
    ok = httpx.post(f"{server_tp2.url}/v1/completions", json={"prompt": "still there?", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_greedy_output_at_tp2_equals_tp1(server_tp1: Server, server_tp2: Server) -> None:
    def greedy(server: Server, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    for prompt in PROMPTS:
        assert greedy(server_tp2, prompt) == greedy(server_tp1, prompt), prompt


def test_health_and_metrics(server_tp2: Server) -> None:
    assert httpx.get(f"{server_tp2.url}/health", timeout=10).json() == {"status": "ok"}
    for name in ("tp_runtime_kv_pages_free", "tp_runtime_kv_pages_marked", "tp_runtime_kv_pages_cleared_total", "tp_runtime_steps_total"):
        metric(server_tp2, name)
    assert metric(server_tp2, "tp_runtime_step_aborts_total") == 0


def test_seeded_sampling_is_reproducible_across_tp(server_tp1: Server, server_tp2: Server) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    texts = {httpx.post(f"{s.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] for s in (server_tp1, server_tp2, server_tp2)}
    assert len(texts) == 1, texts


def test_fuzzed_requests_leave_the_server_healthy_and_greedy_unchanged(server_tp2: Server) -> None:
    """The short live form of tests/server/test_fuzz_http.py: random requests and every wire field
    at every edge, against the real runtime. No 5xx, and the runtime is unharmed afterwards. The
    edge grid (about a thousand requests) goes eight at a time: the runtime batches the ones it
    admits, and the fuzz meets concurrency too."""
    from hypothesis import HealthCheck, given, settings
    from scripts.harness.http_fuzz import CASES, check_answer, edge_grid, greedy_text, send

    # A client of its own for each thread: one pool shared by eight threads once read a socket
    # another thread had closed (EBADF in httpcore, a client-side race), as a server error cannot.
    own = threading.local()
    clients: list[httpx.Client] = []

    def send_own(case):
        if not hasattr(own, "client"):
            own.client = httpx.Client(base_url=server_tp2.url, timeout=60)
            clients.append(own.client)
        return send(own.client, case)

    with httpx.Client(base_url=server_tp2.url, timeout=60) as http:
        before = greedy_text(http)
        grid = edge_grid()
        try:
            with ThreadPoolExecutor(FUZZ_CLIENTS) as pool:
                for case, response in zip(grid, pool.map(send_own, grid), strict=True):
                    check_answer(case, response)
        finally:
            for each in clients:
                each.close()

        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=CASES)
        def one(case) -> None:
            check_answer(case, send(http, case))

        one()
        assert http.get("/health").json() == {"status": "ok"}
        assert greedy_text(http) == before
    assert metric(server_tp2, "tp_runtime_step_aborts_total") == 0


def test_logprobs_through_the_openai_client(server_tp2: Server) -> None:
    api = client(server_tp2)
    name = model_id(server_tp2)
    completion = api.completions.create(
        model=name, prompt="Hello", max_tokens=6, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 == completion.usage.completion_tokens
    assert all(value <= 0 for value in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    messages = [{"role": "user", "content": "Hi"}]
    chat = api.chat.completions.create(
        model=name, messages=messages, max_tokens=5, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    whole = [(t.token, t.logprob) for t in chat.choices[0].logprobs.content]
    streamed = [
        (t.token, t.logprob)
        for chunk in api.chat.completions.create(
            model=name, messages=messages, max_tokens=5, temperature=0, logprobs=True, stream=True,
            extra_body={"ignore_eos": True},
        )
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert len(whole) == 5 and streamed == whole


def test_models_are_named_as_vllm_names_them(server_tp2: Server, tiny_model) -> None:
    # vLLM reports a local model by the --model argument as given, and labels its metrics with it.
    cards = client(server_tp2).models.list().data
    assert [(card.id, card.root) for card in cards] == [(str(tiny_model), str(tiny_model))]
    assert f'vllm:num_requests_running{{model_name="{tiny_model}"}}' in httpx.get(f"{server_tp2.url}/metrics", timeout=10).text
