"""The HTTP edge against bad input, strangers and overload: each case once took the service down,
answered with a plain-text 500, or let a request through that the engine could not take."""

from __future__ import annotations

import json
import socket
import threading
import time
from email.message import Message

import pytest
from hypothesis import given, settings as examples
from hypothesis import strategies as st
from server.fake_engine import MODEL_NAME, FakeEngine

from tp_runtime.http import ServerSettings, create_app
from tp_runtime.http.body import _is_json


def make_client(tokenizer, engine=None, **settings):
    from fastapi.testclient import TestClient

    engine = engine or FakeEngine()
    app = create_app(engine, tokenizer, ServerSettings((MODEL_NAME,), **settings))
    return TestClient(app), engine


def error_of(response) -> dict:
    assert response.headers["content-type"].startswith("application/json"), response.text
    return response.json()["error"]


# ---- values the wire or the sampler cannot carry --------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "top_k": 2**31}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "temperature": 1e-40}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "temperature": 0.5, "top_p": 1e-46}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "seed": -5}, "seed"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [49152]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": [5, 2**31]}, "prompt"),
        ("/v1/completions", {"prompt": [5, -1]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 1e-7}, "top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": 1e39}}, "sampling_params.temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": 2**40}}, "sampling_params.top_k"),
        ("/generate", {"text": "hi", "sampling_params": {"seed": 2**63}}, "sampling_params.seed"),
    ],
)
def test_values_past_the_wire_are_refused_naming_the_field(client, engine, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and param.rsplit(".", 1)[-1] in error["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_are_refused(client, engine, literal):
    raw = b'{"prompt": "hi", "temperature": ' + literal + b"}"
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert error_of(response)["param"] == "temperature"
    assert engine.submitted == []


@pytest.mark.parametrize(
    "path, raw",
    [
        ("/v1/completions", b'{"prompt": "a \\ud800 b"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
        ("/generate", b'{"text": "\\ud800"}'),
        ("/v1/completions", b'{"prompt": "ok", "stop": ["\\udfff"]}'),
        ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}'),  # a surrogate in raw bytes: not UTF-8
    ],
)
def test_lone_surrogates_get_a_json_400(client, engine, path, raw):
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert error_of(response)["type"] == "invalid_request_error"
    assert engine.submitted == []


# ---- limits -----------------------------------------------------------------------------------------


def test_a_prompt_past_the_character_cap_never_reaches_the_tokenizer(tokenizer, monkeypatch):
    client, engine = make_client(tokenizer)
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    cap = engine.max_model_len * tokenizer.max_token_chars
    for path, body in (
        ("/v1/completions", {"prompt": "x" * (cap + 1)}),
        ("/generate", {"text": "y" * (cap + 1)}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * cap}, {"role": "user", "content": "z"}]}),
    ):
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        error = error_of(response)
        assert error["code"] == "context_length_exceeded" and str(cap) in error["message"]
    assert calls == [] and engine.submitted == []


def test_an_8_mb_prompt_is_refused_and_the_server_goes_on(tokenizer):
    client, engine = make_client(tokenizer)
    response = client.post("/v1/completions", json={"prompt": "word " * ((8 << 20) // 5)})
    assert response.status_code in (400, 413)
    assert engine.submitted == []
    assert client.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_a_body_past_the_size_limit_is_413_before_parsing(tokenizer):
    client, engine = make_client(tokenizer, max_request_body_size=1000)
    big = json.dumps({"prompt": "a" * 2000}).encode()
    response = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413 and error_of(response)["code"] == "request_body_too_large"

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(10):
            yield b"x" * 200

    streamed = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert engine.submitted == []
    assert client.post("/v1/completions", json={"prompt": "small", "max_tokens": 2}).status_code == 200


def test_the_body_limit_is_derived_from_the_prompt_cap(tokenizer):
    settings = ServerSettings((MODEL_NAME,))
    chars = settings.prompt_chars_limit(256, tokenizer)
    assert chars == 256 * tokenizer.max_token_chars
    # An astral character escaped in JSON is 12 bytes: the largest prompt the cap takes still fits.
    assert settings.body_size_limit(chars) >= len(json.dumps({"prompt": "🎉" * chars}))
    assert ServerSettings((MODEL_NAME,), max_prompt_chars=10, max_request_body_size=99).body_size_limit(10) == 99


def test_overload_is_429_with_retry_after(client, engine):
    engine.max_in_flight = 0
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert error_of(response)["code"] == "too_many_requests"
    assert 'tp_runtime_request_rejects_total{reason="overloaded"} 1.0' in client.get("/metrics").text


def test_a_stalled_body_is_closed_within_the_timeout(tokenizer):
    """Half a body, then nothing: the server answers 408 and closes the connection, instead of
    holding it for ever."""
    import uvicorn

    from server.fake_engine import free_port

    port = free_port()
    app = create_app(FakeEngine(), tokenizer, ServerSettings((MODEL_NAME,), request_body_timeout_s=0.5))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"prompt": "'
            )
            started = time.monotonic()
            received = b""
            while chunk := conn.recv(4096):
                received += chunk
            elapsed = time.monotonic() - started
        assert received.startswith(b"HTTP/1.1 408"), received[:200]
        assert b"request_timeout" in received
        assert 0.4 < elapsed < 5, elapsed
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# ---- who may ask ------------------------------------------------------------------------------------


def test_api_key_guards_the_api_and_not_health(tokenizer):
    client, engine = make_client(tokenizer, api_key="s3cret")
    requests = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("POST", "/generate", {"text": "hi"}),
                ("GET", "/v1/models", None)]
    for method, path, body in requests:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert error_of(response)["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        ok = client.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200, ok.text
    assert engine.submitted and len(engine.submitted) == 2
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_metrics_can_require_the_key(tokenizer):
    client, _ = make_client(tokenizer, api_key="k", require_api_key_for_metrics=True)
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    "host, allowed",
    [
        ("localhost", True), ("localhost:8000", True), ("127.0.0.1", True), ("127.0.0.1:1234", True),
        ("[::1]", True), ("[::1]:8000", True), ("LOCALHOST:80", True),
        ("evil.example", False), ("evil.example:8000", False), ("127.0.0.1.evil.example", False), ("", False),
    ],
)
def test_a_loopback_server_refuses_other_host_names(tokenizer, host, allowed):
    client, _ = make_client(tokenizer, bind_host="127.0.0.1")
    response = client.get("/v1/models", headers={"host": host})
    if allowed:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 421
        assert error_of(response)["code"] == "invalid_host"


def test_a_server_on_all_interfaces_takes_any_host(tokenizer):
    client, _ = make_client(tokenizer, bind_host="0.0.0.0")
    assert client.get("/v1/models", headers={"host": "my-server.internal:8000"}).status_code == 200


# ---- bodies -----------------------------------------------------------------------------------------


def test_generate_takes_a_body_without_a_json_content_type(client, engine, tokenizer):
    # The README's `curl .../generate -d '{...}'` sends application/x-www-form-urlencoded.
    raw = b'{"text": "Hello", "sampling_params": {"max_completion_tokens": 3}}'
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": content_type} if content_type else {}
        response = client.post("/generate", content=raw, headers=headers)
        assert response.status_code == 200, (content_type, response.text)
        assert response.text.startswith("data: ")
    assert len(engine.submitted) == 3


def test_openai_routes_want_json(client, engine):
    raw = b'{"prompt": "hi", "max_tokens": 2}'
    response = client.post("/v1/completions", content=raw, headers={"content-type": "text/plain"})
    assert response.status_code == 415 and error_of(response)["code"] == "unsupported_media_type"
    assert client.post("/v1/completions", content=raw).status_code == 200  # no type: read as JSON
    assert client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json; charset=utf-8"}
    ).status_code == 200


def _json_by_email(content_type: str) -> bool:
    """FastAPI's reading of a Content-Type, through email.message, which body._is_json matches."""
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


@examples(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(alphabet=st.sampled_from(list("aAjJ/+;= \t\"sonplic-x")), min_size=1, max_size=30),
        st.sampled_from(
            ["application/json", "Application/JSON ; charset=utf-8", "application/vnd.api+json", "application/json/x",
             "application", "/json", "application/", " application/json", "text/json", "application/jsonx",
             "application/x+json;q=1", "application/json;", ";application/json"]
        ),
    )
)
def test_a_content_type_names_json_exactly_when_email_message_says_so(content_type: str) -> None:
    assert _is_json(content_type) == _json_by_email(content_type)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "temprature": 0.5}, "temprature"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages.0.audio"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text"]}, "modalities"),
        ("/generate", {"text": "hi", "rid": "abc"}, "rid"),
        ("/v1/completions", {"prompt": "hi", "str": 1}, "str"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "list[int]": 0}]}, "messages.0.list[int]"),
    ],
)
def test_unknown_fields_are_refused_naming_them(client, engine, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param and "not a field" in error["message"]
    assert engine.submitted == []


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),  # without tools
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
        ("/v1/chat/completions", {"guided_regex": "[a-"}, "guided_regex"),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ("/v1/completions", {"suffix": "!"}, "suffix"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
    ],
)
def test_unsupported_parameters_are_refused_naming_them(client, engine, path, body, param):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    response = client.post(path, json={**base, **body})
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param
    assert engine.submitted == []


def test_a_message_name_is_refused_not_dropped(client, engine):
    body = {"messages": [{"role": "user", "content": "x", "name": "alice"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and error_of(response)["param"] == "messages.0.name"


def test_tokenizing_runs_off_the_event_loop(tokenizer, monkeypatch):
    client, _ = make_client(tokenizer)
    threads = []
    real_encode = tokenizer.encode

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    client.post("/generate", json={"text": "hi", "sampling_params": {"max_completion_tokens": 1}})
    assert len(threads) == 3 and all(name.startswith("tokenize") for name in threads), threads


def test_encode_lets_other_threads_run(tokenizer):
    """The Rust tokenizer works without the GIL, so the event loop and the engine thread go on while
    a long prompt is tokenized. Counts Python loop turns on this thread while a worker encodes; with
    the GIL held through the encode (tokenizers' own `encode`), there would be none."""
    text = "the quick brown fox jumps over 12345 lazy dogs, é 🎉\n" * 4_000
    span: list[float] = []

    def work() -> None:
        span.append(time.perf_counter())
        tokenizer.encode(text)
        span.append(time.perf_counter())

    worker = threading.Thread(target=work)
    turns: list[float] = []
    worker.start()
    while worker.is_alive():
        turns.append(time.perf_counter())
        sum(range(200))
    worker.join()
    inside = [t for t in turns if span[0] < t < span[1]]
    assert len(inside) > 20, f"{len(inside)} turns of this thread in {span[1] - span[0]:.3f} s of encoding"
