"""The app under a real uvicorn server on loopback: the official openai client, and disconnects."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server.fake_engine import MODEL_NAME

from tp_runtime.chat import render_chat


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def openai_client(live_server):
    client = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=10)
    yield client
    client.close()


def echo(tokenizer, prompt_ids, n):
    return tokenizer.decode([prompt_ids[i % len(prompt_ids)] for i in range(n)])


def test_openai_completions(openai_client, tokenizer):
    result = openai_client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=5, temperature=0)
    ids = tokenizer.encode("Once upon a time")
    assert result.choices[0].text == echo(tokenizer, ids, 5)
    assert result.choices[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 5)


def test_openai_completions_stream(openai_client, tokenizer):
    stream = openai_client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == echo(tokenizer, tokenizer.encode("Once upon a time"), 6)
    assert chunks[-1].usage.completion_tokens == 6


def test_openai_chat(openai_client, tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    result = openai_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    ids = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == echo(tokenizer, ids, 4)
    assert result.usage.total_tokens == len(ids) + 4


def test_openai_chat_stream_with_stop(openai_client, live_server):
    stream = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=40, stop=["helpful"], stream=True
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "system\nYou are a "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert live_server.engine.finished == [1]


def test_openai_errors_are_typed(openai_client, live_server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        openai_client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        openai_client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "a " * 400}])
    live_server.engine.fail_after = 2
    with pytest.raises(openai.APIError, match="non-finite"):
        list(openai_client.completions.create(model=MODEL_NAME, prompt="abc def", max_tokens=8, stream=True))
    with pytest.raises(openai.InternalServerError, match="non-finite"):
        openai_client.completions.create(model=MODEL_NAME, prompt="abc def", max_tokens=8)
    assert [m.id for m in openai_client.models.list().data] == [MODEL_NAME]


def test_concurrent_requests_all_answered(live_server, tokenizer):
    async def one(client: httpx.AsyncClient, i: int) -> str:
        response = await client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": f"request number {i}", "max_tokens": 4}
        )
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=live_server.base_url, timeout=20) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    texts = asyncio.run(run())
    assert texts == [echo(tokenizer, tokenizer.encode(f"request number {i}"), 4) for i in range(32)]


def test_stream_disconnect_cancels_the_request(live_server):
    live_server.engine.token_delay_s = 0.05
    with httpx.Client(base_url=live_server.base_url, timeout=10) as client:
        body = {"text": "a long answer " * 5, "sampling_params": {"max_completion_tokens": 200}, "stream": True}
        with client.stream("POST", "/generate", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
    assert wait_for(lambda: live_server.engine.cancelled == [1])
    assert live_server.engine.finished == []
    metrics = httpx.get(f"{live_server.base_url}/metrics").text
    assert "tp_runtime_request_cancels_total 1.0" in metrics


def test_a_whole_stream_of_several_choices_counts_no_cancel(live_server):
    # The body ends with the last choice's chunk while the other choices' pumps still wind down, and
    # the server then answers receive() with a disconnect: that is no hang-up.
    body = {"model": MODEL_NAME, "prompt": "two answers", "max_tokens": 6, "n": 3, "stream": True}
    with httpx.Client(base_url=live_server.base_url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert live_server.engine.cancelled == []
    metrics = httpx.get(f"{live_server.base_url}/metrics").text
    assert "tp_runtime_request_cancels_total 0.0" in metrics


def test_a_stream_hung_up_before_its_first_token_cancels_the_request(live_server):
    # No token comes for 60 s: only the hang-up itself can end the request.
    live_server.engine.token_delay_s = 60.0
    body = {"model": MODEL_NAME, "prompt": "queued behind a long prompt", "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=live_server.base_url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
    assert wait_for(lambda: live_server.engine.cancelled == [1])
    live_server.engine.token_delay_s = 0.0
    metrics = httpx.get(f"{live_server.base_url}/metrics").text
    assert "tp_runtime_request_cancels_total 1.0" in metrics


def test_non_streaming_disconnect_cancels_the_request(live_server):
    live_server.engine.token_delay_s = 0.05
    body = {"model": MODEL_NAME, "prompt": "take your time", "max_tokens": 200}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server.base_url}/v1/completions", json=body, timeout=0.5)
    assert wait_for(lambda: live_server.engine.cancelled == [1])
    # The server goes on serving.
    live_server.engine.token_delay_s = 0.0
    response = httpx.post(f"{live_server.base_url}/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
    assert response.status_code == 200


class ThreadFedEngine:
    """The fake engine's behaviour, but its streams are the runtime's own RequestStream, pushed from
    a separate thread as the engine loop pushes them: the server must read them on its event loop."""

    def __init__(self, fake):
        self._fake = fake
        self.model_name = fake.model_name
        self.max_model_len = fake.max_model_len

    def submit(self, prompt_token_ids, params, *, prompt_leader=None):
        from tp_runtime.engine import RequestStream

        planned = self._fake.submit(prompt_token_ids, params, prompt_leader=prompt_leader)
        stream = RequestStream(planned.request_id, len(prompt_token_ids), asyncio.get_running_loop())

        def feed():
            for event in planned.planned_events():
                time.sleep(0.002)
                stream.push(event)

        threading.Thread(target=feed, daemon=True).start()
        return stream

    def __getattr__(self, name):
        return getattr(self._fake, name)


def test_real_request_stream_fed_from_another_thread(tokenizer):
    import uvicorn

    from server.fake_engine import FakeEngine, free_port
    from tp_runtime.http import ServerSettings, create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(ThreadFedEngine(FakeEngine()), tokenizer, ServerSettings((MODEL_NAME,))), port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started, 10)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=10)
        prompts = [f"thread fed {i} ü🎉" for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: api.completions.create(model=MODEL_NAME, prompt=p, max_tokens=9), prompts))
        for prompt, result in zip(prompts, texts):
            assert result.choices[0].text == echo(tokenizer, tokenizer.encode(prompt), 9)
        chunks = api.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=9, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks)
        assert streamed == echo(tokenizer, tokenizer.encode(prompts[0]), 9)
        api.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
