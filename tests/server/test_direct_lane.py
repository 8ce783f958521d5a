"""The generating routes' direct lane (tp_runtime/http/direct.py): their POSTs skip FastAPI's layers
and the router, every other request takes them, and a request answers alike on either way: status,
body, headers that matter, and what the metrics count."""

from __future__ import annotations

import json

import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from server.fake_engine import MODEL_NAME, FakeEngine
from starlette.routing import Router

from tp_runtime.http import ServerSettings, create_app
from tp_runtime.http.errors import ApiError

API_KEY = "sk-direct-lane-test"
# HostCheck (a loopback bind) answers only requests addressed to a loopback name.
BASE_URL = "http://127.0.0.1:8000"

# (method, path, headers, body): what each middleware refuses, what a route refuses, and answers.
REQUESTS = [
    ("POST", "/v1/completions", {}, {"prompt": "hello", "max_tokens": 3}),
    ("POST", "/v1/completions", {}, {"prompt": "hello", "max_tokens": 3, "stream": True}),
    ("POST", "/v1/chat/completions", {}, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/generate", {}, {"text": "abc", "sampling_params": {"max_completion_tokens": 2}}),
    ("POST", "/v1/completions", {}, {"prompt": "hello", "max_tokens": -1}),  # the route's ApiError
    ("POST", "/v1/completions", {}, {"prompt": "hello", "model": "no-such-model"}),
    ("POST", "/v1/completions", {}, b"{not json"),
    ("POST", "/v1/completions", {"origin": "http://evil.example"}, {"prompt": "hello"}),  # OriginCheck
    ("POST", "/v1/completions", {"host": "evil.example"}, {"prompt": "hello"}),  # HostCheck
    ("POST", "/v1/completions", {"authorization": "Bearer wrong"}, {"prompt": "hello"}),  # ApiKeyAuth
    ("POST", "/v1/completions", {}, {"prompt": "x" * 200_000}),  # BodyLimits
    ("GET", "/v1/completions", {}, None),  # not the lane's: 405 from the router
    ("POST", "/v1/completions/", {}, {"prompt": "hello"}),  # nor this
    ("GET", "/v1/models", {}, None),
]


def _app(tokenizer, direct: bool, engine: FakeEngine | None = None):
    settings = ServerSettings((MODEL_NAME,), api_key=API_KEY, bind_host="127.0.0.1", max_request_body_size=100_000)
    app = create_app(engine or FakeEngine(), tokenizer, settings)
    app.direct_lane = direct
    return app


def _send(client: TestClient, method: str, path: str, headers: dict, body: object):
    headers = {"authorization": f"Bearer {API_KEY}", **headers}
    if isinstance(body, bytes):
        return client.request(method, path, headers={**headers, "content-type": "application/json"}, content=body)
    return client.request(method, path, headers=headers, json=body)


def _without_ids(value: object) -> object:
    """An answer's JSON without what differs from answer to answer (ids and times), at any depth."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _stream_of(text: str) -> tuple:
    """A stream as (its text, its events but the text's): how its pieces fell depends on timing."""
    said, events = [], []
    for line in text.splitlines():
        if line.startswith("data: ") and not line.startswith(("data: {", "data: [DONE]")):
            said.append(line[6:])  # /generate's plain text
            continue
        if not line.startswith("data: {"):
            events.append(line) if line else None
            continue
        event = _without_ids(json.loads(line[6:]))
        for choice in event.get("choices", ()):
            said.append(choice.pop("text", "") or choice.get("delta", {}).pop("content", "") or "")
            if choice.get("finish_reason") is None and not choice.get("delta"):
                continue
            events.append(choice)
        if not event.get("choices"):
            events.append(event)
    return "".join(said), events


def _answer(response) -> tuple:
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else response.text
    if isinstance(body, dict):
        body = _without_ids(body)
    elif "data: " in body:  # a stream: its text, how it ended, and its other events
        body = _stream_of(body)
    kept = ("content-type", "connection", "retry-after", "www-authenticate")
    return response.status_code, body, {k: response.headers.get(k) for k in kept}


def _counts(client: TestClient) -> list[str]:
    """The answers, refusals, cancels and errors the metrics counted."""
    text = _send(client, "GET", "/metrics", {}, None).text
    counted = ("_http_requests_total{", "_request_rejects_total{", "_request_cancels_total", "_request_errors_total{")
    return sorted(line for line in text.splitlines() if any(name in line for name in counted))


# Sent once the engine fails every request at its second token: a stream's error events and
# [DONE], a whole answer's 5xx, each counted as an error.
FAILING = [
    ("POST", "/v1/completions", {}, {"prompt": "hello", "max_tokens": 4, "stream": True}),
    ("POST", "/v1/completions", {}, {"prompt": "hello", "max_tokens": 4}),
    ("POST", "/generate", {}, {"text": "abc", "sampling_params": {"max_completion_tokens": 4}, "stream": True}),
]


def test_a_request_answers_alike_on_the_direct_lane_and_through_fastapi(tokenizer) -> None:
    answers = {}
    counts = {}
    for direct in (True, False):
        engine = FakeEngine()
        with TestClient(_app(tokenizer, direct, engine), base_url=BASE_URL) as client:
            answers[direct] = [_answer(_send(client, *request)) for request in REQUESTS]
            engine.fail_after = 1
            answers[direct] += [_answer(_send(client, *request)) for request in FAILING]
            counts[direct] = _counts(client)
    for request, on_lane, through in zip(REQUESTS + FAILING, answers[True], answers[False], strict=True):
        assert on_lane == through, request[:3]
    assert counts[True] == counts[False]
    # What the comparison covers: the route's ApiErrors and the failed generations were counted.
    assert any('reason="invalid"} 3.0' in line for line in counts[True])
    assert any("_request_errors_total{" in line and line.endswith(" 3.0") for line in counts[True])


@pytest.fixture
def routed(monkeypatch) -> list[str]:
    """Every HTTP request the router sees, as "METHOD path"."""
    seen: list[str] = []
    route = Router.__call__

    async def counted(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            seen.append(f"{scope['method']} {scope['path']}")
        await route(self, scope, receive, send)

    monkeypatch.setattr(Router, "__call__", counted)
    return seen


def test_only_the_generating_posts_skip_the_router(tokenizer, routed) -> None:
    with TestClient(_app(tokenizer, True), base_url=BASE_URL) as client:
        for request in REQUESTS:
            _send(client, *request)
    # The slash's redirect comes back to the lane.
    assert routed == ["GET /v1/completions", "POST /v1/completions/", "GET /v1/models"]


def test_the_lane_takes_middleware_added_after_the_app_was_made(tokenizer, routed) -> None:
    app = _app(tokenizer, True)

    class Stamp:
        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            async def stamped(message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message["headers"], (b"x-stamp", b"1")]
                await send(message)

            await self.inner(scope, receive, stamped)

    app.add_middleware(Stamp)
    with TestClient(app, base_url=BASE_URL) as client:
        assert _send(client, *REQUESTS[0]).headers.get("x-stamp") == "1"
        assert _send(client, "GET", "/v1/models", {}, None).headers.get("x-stamp") == "1"
    assert routed == ["GET /v1/models"]  # the POST took the lane, and the middleware with it


def test_fastapis_telemetry_switched_on_takes_every_request_through_its_layers(tokenizer, routed, monkeypatch) -> None:
    app = _app(tokenizer, True)
    telemetry = getattr(app, "_native_telemetry", None)
    if telemetry is None:
        pytest.skip("this FastAPI has no telemetry of its own")
    monkeypatch.setattr(type(telemetry), "enabled", lambda self: True)
    monkeypatch.setattr(type(telemetry), "__call__", lambda self, *, app, scope, receive, send, **_: app(scope, receive, send))
    with TestClient(app, base_url=BASE_URL) as client:
        assert _send(client, *REQUESTS[0]).status_code == 200
    assert routed == ["POST /v1/completions"]


def test_a_handler_for_500_takes_the_generating_routes_through_fastapi_too(tokenizer, routed) -> None:
    app = _app(tokenizer, True)

    @app.exception_handler(500)
    async def server_error(request, exc):  # what a deployment may add: its own 500 page
        raise AssertionError("not called here")

    with TestClient(app, base_url=BASE_URL) as client:
        assert _send(client, *REQUESTS[0]).status_code == 200
    assert routed == ["POST /v1/completions"]


def test_a_sync_handler_for_a_subclass_of_apierror_answers_on_the_lane(tokenizer, routed) -> None:
    class Refusal(ApiError):
        pass

    async def refusing(request):
        raise Refusal(400, "no", type="invalid_request_error", code="no")

    app = _app(tokenizer, True)
    app.add_direct_routes({"/refuse": refusing})

    @app.exception_handler(Refusal)
    def refused(request, exc):  # a plain function, as Starlette allows
        return JSONResponse({"refused": exc.message}, status_code=418)

    with TestClient(app, base_url=BASE_URL) as client:
        response = _send(client, "POST", "/refuse", {}, {})
    assert (response.status_code, response.json()) == (418, {"refused": "no"})
    assert routed == []
