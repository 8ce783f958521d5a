"""A property-based HTTP fuzzer over every route and every field: hypothesis strategies for
requests, and the checks every answer must pass. Used against the app with the fake engine
(tests/server/test_fuzz_http.py), in a short form against the real server (tests/e2e/test_server.py),
and in a long form beside normal streams by scripts/stress.py.

A case is a valid body with mutations (a field dropped, set to any JSON value, an unknown one
added, nested values replaced), or raw bytes, wrong content types, other methods and paths.
Values lean to the edges: int32/int64 bounds, float32 denormals and overflow, NaN and infinities,
lone surrogates, control and special-token text, strings past the prompt cap and the body limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

INT_EDGES = (0, 1, -1, 2, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30)
FLOAT_EDGES = (0.0, -0.0, 1e-46, 1e-40, 5e-324, 1e-6, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 3.5e38, 1e39, 1e308)
TEXT_EDGES = ("", "\ud800", "a\udfffb", "🎉", "\x00", "<|im_end|>", "<|im_start|>user\n", "\r\n", "x" * 25_000, "é" * 3)
HUGE_TEXT = "word " * 400_000  # 2 MB: past the derived body limit of the test app

ROUTES = {
    "/v1/completions": {
        "base": {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
        "fields": (
            "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
            "ignore_eos", "stream", "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias",
            "min_tokens", "repetition_penalty", "min_p", "response_format", "tools", "tool_choice", "user", "logprobs",
            "return_token_ids", "echo", "best_of", "suffix",
        ),
        "wire": (
            "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "n", "presence_penalty",
            "frequency_penalty", "min_tokens", "repetition_penalty",
        ),
        "numeric": ("min_p", "best_of"),
        "id_lists": ("prompt", "stop_token_ids"),
        "bias": True,
    },
    "/v1/chat/completions": {
        "base": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
        "fields": (
            "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
            "stop_token_ids", "ignore_eos", "stream", "stream_options", "n", "presence_penalty", "frequency_penalty",
            "logit_bias", "min_tokens", "repetition_penalty", "min_p", "response_format", "tools", "tool_choice",
            "user", "logprobs", "top_logprobs", "parallel_tool_calls", "functions", "function_call",
        ),
        "wire": (
            "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "top_logprobs", "n",
            "presence_penalty", "frequency_penalty", "min_tokens", "repetition_penalty",
        ),
        "numeric": ("min_p",),
        "id_lists": ("stop_token_ids",),
        "bias": True,
    },
    "/generate": {
        "base": {"text": "Hello", "sampling_params": {"max_completion_tokens": 4}},
        "fields": ("text", "sampling_params", "stream"),
        "wire": ("max_completion_tokens", "temperature", "top_p", "top_k", "seed"),  # in sampling_params
        "numeric": (),
        "id_lists": (),
        "bias": False,
    },
}
GET_ROUTES = ("/health", "/metrics", "/v1/models")


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    content: bytes
    content_type: str | None = "application/json"

    def __repr__(self) -> str:  # hypothesis prints failing cases: keep them readable
        return f"Case({self.method} {self.path} {self.content_type!r} {self.content[:300]!r})"


def _leaves() -> st.SearchStrategy:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(INT_EDGES),
        st.integers(-(2**70), 2**70),
        st.sampled_from(FLOAT_EDGES),
        st.floats(),
        st.sampled_from(TEXT_EDGES),
        st.text(max_size=12),
    )


EDGES = INT_EDGES + FLOAT_EDGES
NUMBERS = st.one_of(st.sampled_from(EDGES), st.sampled_from(EDGES), st.integers(-5, 300), st.floats(-5, 5))
TOKEN_IDS = (0, 1, 2, 100, 49151, 49152, -1, 2**31, 2**63, 10**30)
JSON_VALUES = st.recursive(
    _leaves(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


def _dump(value: object) -> bytes:
    # ensure_ascii writes a lone surrogate as an escape, as a client in another language would;
    # NaN and Infinity become the non-JSON literals some clients send.
    return json.dumps(value, ensure_ascii=True).encode()


@st.composite
def body_cases(draw) -> Case:
    path = draw(st.sampled_from(sorted(ROUTES)))
    route = ROUTES[path]
    body = json.loads(json.dumps(route["base"]))
    actions = ("number",) * 4 + ("ids", "bias", "set", "set", "drop", "unknown", "message")
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(actions))
        field = draw(st.sampled_from(route["fields"]))
        if action == "number":  # well typed, so that what is tested is the range; mostly what the wire carries
            numeric = draw(st.sampled_from(route["wire"] * 3 + route["numeric"]))
            target = body.get("sampling_params") if path == "/generate" else body
            if isinstance(target, dict):
                target[numeric] = draw(NUMBERS)
        elif action == "ids" and route["id_lists"]:
            body[draw(st.sampled_from(route["id_lists"]))] = draw(st.lists(st.sampled_from(TOKEN_IDS), min_size=1, max_size=4))
        elif action == "bias" and route["bias"]:
            ids = st.sampled_from(TOKEN_IDS).map(str) | st.text(max_size=4)
            body["logit_bias"] = draw(st.dictionaries(ids, NUMBERS, max_size=4))
        elif action == "set":
            body[field] = draw(JSON_VALUES)
        elif action == "drop":
            body.pop(field, None)
        elif action == "unknown":
            body[draw(st.text(min_size=1, max_size=8))] = draw(JSON_VALUES)
        elif action == "message" and isinstance(body.get("messages"), list) and body["messages"]:
            message = body["messages"][0]
            if isinstance(message, dict):
                message[draw(st.sampled_from(("role", "content", "name", "tool_calls")))] = draw(JSON_VALUES)
    # Hypothesis favours a range's ends: a middle value keeps the 2 MB case about one in 30.
    if draw(st.integers(0, 30)) == 17:
        body["prompt" if "prompt" in body else "text"] = HUGE_TEXT
    content_type = draw(
        st.sampled_from(("application/json",) * 6 + (None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"))
    )
    return Case("POST", path, _dump(body), content_type)


@st.composite
def raw_cases(draw) -> Case:
    path = draw(st.sampled_from((*sorted(ROUTES), *GET_ROUTES, "/v1/nothing", "/generate/", "/v1")))
    method = draw(st.sampled_from(("POST", "POST", "GET", "PUT", "DELETE")))
    valid = _dump(ROUTES.get(path, {"base": {}})["base"])
    content = draw(
        st.one_of(
            st.binary(max_size=64),
            st.just(b""),
            st.integers(0, len(valid)).map(lambda n: valid[:n]),  # truncated
            JSON_VALUES.map(_dump),  # any JSON, often not an object
            st.just(b'{"prompt": "\xff\xfe"}'),  # not UTF-8
        )
    )
    content_type = draw(st.sampled_from(("application/json", None, "text/plain", "multipart/form-data; boundary=x")))
    return Case(method, path, content, content_type)


CASES = st.one_of(body_cases(), body_cases(), raw_cases())


def edge_grid() -> list[Case]:
    """Every field the wire carries, on every route, at every edge value, one at a time: what the
    random search may miss, checked whole."""
    cases = []
    for path, route in sorted(ROUTES.items()):
        for field in route["wire"]:
            for value in (*EDGES, True, None, "5", [], float("nan"), float("inf")):
                body = json.loads(json.dumps(route["base"]))
                (body["sampling_params"] if path == "/generate" else body)[field] = value
                cases.append(Case("POST", path, _dump(body)))
        for field in route["id_lists"]:
            for token in TOKEN_IDS:
                cases.append(Case("POST", path, _dump({**route["base"], field: [5, token]})))
        if route["bias"]:
            for token in TOKEN_IDS:
                cases.append(Case("POST", path, _dump({**route["base"], "logit_bias": {str(token): 1.0}})))
            for value in (*FLOAT_EDGES, -100.0, 100.0, -100.5, 100.5, True, None, "5"):
                cases.append(Case("POST", path, _dump({**route["base"], "logit_bias": {"5": value}})))
    return cases


def send(client, case: Case):
    headers = {"content-type": case.content_type} if case.content_type else {}
    return client.request(case.method, case.path, content=case.content, headers=headers)


def check_answer(case: Case, response) -> None:
    """No 5xx; every error is the JSON error shape; every stream is well-formed server-sent events."""
    assert response.status_code < 500, f"{response.status_code} for {case!r}: {response.text[:500]}"
    content_type = response.headers.get("content-type", "")
    if response.status_code >= 400:
        assert content_type.startswith("application/json"), f"{response.status_code} {content_type} for {case!r}"
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], case
        return
    if content_type.startswith("text/event-stream") and _streamed(case):
        for block in response.text.split("\n\n"):
            lines = [line for line in block.split("\n") if line]
            assert all(line.startswith(("data: ", "event: ")) for line in lines), f"{block!r} for {case!r}"
            if case.path.startswith("/v1") and lines:
                data = lines[-1][len("data: ") :]
                assert data == "[DONE]" or isinstance(json.loads(data), dict), case


def _streamed(case: Case) -> bool:
    """A streamed answer; /generate's whole answer is one `data:` line holding the text verbatim."""
    try:
        return json.loads(case.content).get("stream") is True
    except (ValueError, AttributeError):
        return False


def greedy_text(client) -> str:
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]
