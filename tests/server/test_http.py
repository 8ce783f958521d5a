"""HTTP semantics of tp_runtime.server against the fake engine (conftest.py), in-process."""

from __future__ import annotations

import json

import pytest
from server.fake_engine import MODEL_NAME

from tp_runtime.chat import ChatMessage, render_chat
from tp_runtime.engine import Health


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) per server-sent event, data lines joined with newlines as SSE defines."""
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        events.append((name, "\n".join(data)))
    return events


def echo(tokenizer, prompt_ids: list[int], n: int) -> str:
    """What the fake engine generates for n tokens: the prompt's ids, cycling."""
    return tokenizer.decode([prompt_ids[i % len(prompt_ids)] for i in range(n)])


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "code"} <= set(body["error"])
    return body["error"]


# ---- /generate ------------------------------------------------------------------------------------


def test_generate_returns_shortfin_data_line(client, engine, tokenizer):
    text = "Name the capital of the United States."
    response = client.post("/generate", json={"text": text, "sampling_params": {"max_completion_tokens": 5}})
    assert response.status_code == 200
    ids = tokenizer.encode(text)
    assert response.text == f"data: {echo(tokenizer, ids, 5)}\n\n"
    prompt, params = engine.submitted[0]
    assert prompt == ids
    assert params.max_tokens == 5 and params.temperature == 0.0
    assert tokenizer.eos_token_ids[0] in params.stop_token_ids


def test_generate_passes_sampling_params(client, engine):
    body = {
        "text": "hello there",
        "sampling_params": {"max_completion_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 11},
    }
    assert client.post("/generate", json=body).status_code == 200
    _, params = engine.submitted[0]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (3, 0.7, 0.9, 40, 11)


def test_generate_streams_deltas_that_add_up(client, tokenizer):
    text = "one\ntwo three 🎉 four"
    with client.stream(
        "POST", "/generate", json={"text": text, "sampling_params": {"max_completion_tokens": 12}, "stream": True}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = sse_events(body)
    assert len(events) > 3 and all(name is None for name, _ in events)
    deltas = [data for _, data in events]
    assert "".join(deltas) == echo(tokenizer, tokenizer.encode(text), 12)
    assert not any("\ufffd" in d for d in deltas)


def test_generate_stream_error_event_then_end(client, engine):
    engine.fail_after = 2
    with client.stream(
        "POST",
        "/generate",
        json={"text": "abc def ghi", "sampling_params": {"max_completion_tokens": 8}, "stream": True},
    ) as response:
        body = response.read().decode()
    events = sse_events(body)
    name, data = events[-1]
    assert name == "error"
    assert "non-finite" in json.loads(data)["error"]["message"]
    assert all(name is None for name, _ in events[:-1])


def test_generate_error_without_stream_is_500(client, engine):
    engine.fail_after = 1
    response = client.post("/generate", json={"text": "abc", "sampling_params": {"max_completion_tokens": 8}})
    assert response.status_code == 500
    assert "non-finite" in error_of(response)["message"]


def test_error_while_unhealthy_is_503(client, engine):
    engine.fail_after = 1
    engine.failure_message = "rank 1 stopped answering"
    engine.health_state = Health(False, "rank 1 stopped answering")
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "abc", "max_tokens": 4})
    assert response.status_code == 503
    assert error_of(response)["message"] == "rank 1 stopped answering"


def test_request_cancelled_by_the_runtime_is_503(client, engine):
    # e.g. a drain that ran out of time: not a client error, and not a normal end either.
    engine.fail_after, engine.failure_reason, engine.failure_message = 2, "cancelled", None
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 503
    assert "ended the request early (cancelled)" in error_of(response)["message"]
    with client.stream(
        "POST", "/generate", json={"text": "abc", "sampling_params": {"max_completion_tokens": 8}, "stream": True}
    ) as streamed:
        events = sse_events(streamed.read().decode())
    assert events[-1][0] == "error" and "cancelled" in events[-1][1]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"sampling_params": {}}, "'text'"),
        ({"text": 5}, "'text'"),
        ({"text": "hi", "sampling_params": {"max_completion_tokens": 0}}, "max_completion_tokens"),
        ({"text": "hi", "sampling_params": {"max_completion_tokens": "5"}}, "max_completion_tokens"),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "hi", "sampling_params": {"max_tokens": 5}}, "max_tokens"),
        ({"text": "hi", "stream": "yes"}, "stream"),
    ],
)
def test_generate_bad_input_is_400(client, engine, body, fragment):
    response = client.post("/generate", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]
    assert engine.submitted == []


def test_malformed_json_is_400(client):
    response = client.post(
        "/v1/completions", content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "not valid JSON" in error_of(response)["message"]


# ---- /v1/completions ------------------------------------------------------------------------------


def test_completion_with_usage(client, tokenizer):
    prompt = "The quick brown fox"
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6})
    assert response.status_code == 200
    body = response.json()
    ids = tokenizer.encode(prompt)
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert body["choices"][0]["text"] == echo(tokenizer, ids, 6)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6}


def test_null_options_mean_their_defaults(client, engine):
    body = {"model": MODEL_NAME, "prompt": "nulls", "max_tokens": None, "temperature": None, "top_p": None, "n": None,
            "stop": None, "seed": None, "stream": None, "presence_penalty": None}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    _, params = engine.submitted[0]
    assert (params.max_tokens, params.temperature, params.top_p) == (16, 1.0, 1.0)


def test_model_may_be_omitted(client):
    response = client.post("/v1/completions", json={"prompt": "no model named", "max_tokens": 2})
    assert response.status_code == 200
    assert response.json()["model"] == MODEL_NAME


def test_completion_accepts_token_ids(client, engine, tokenizer):
    ids = tokenizer.encode("token ids in")
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 2})
    assert response.status_code == 200
    assert engine.submitted[0][0] == ids
    assert response.json()["choices"][0]["text"] == echo(tokenizer, ids, 2)


def test_completion_stop_string_cuts_text_and_finishes(client, engine, tokenizer):
    prompt = "alpha beta gamma delta"
    response = client.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 20, "stop": [" gam", "zzz"]}
    )
    body = response.json()
    assert body["choices"][0]["text"] == "alpha beta"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.finished == [1]


def test_completion_eos_token_finishes_with_stop(client, tokenizer):
    # The fake engine stops on a stop token id, as the scheduler does; the server passes EOS as one.
    prompt = "hi<|im_end|>there"
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 10})
    body = response.json()
    assert body["choices"][0] == {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 2


def test_completion_stream_chunks_usage_and_done(client, tokenizer):
    prompt = "streaming completions work"
    with client.stream(
        "POST",
        "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        body = response.read().decode()
    events = sse_events(body)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    text_chunks = chunks[:-1]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == echo(tokenizer, tokenizer.encode(prompt), 5)
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_completion_stream_error_is_error_data_event_then_done(client, engine):
    # As vLLM ends a failed stream: the error as a data event, then [DONE], never a cut stream.
    engine.fail_after = 3
    with client.stream(
        "POST", "/v1/completions", json={"model": MODEL_NAME, "prompt": "a b c d e f", "max_tokens": 9, "stream": True}
    ) as response:
        events = sse_events(response.read().decode())
    assert events[-1] == (None, "[DONE]")
    error = json.loads(events[-2][1])
    assert "non-finite" in error["error"]["message"]
    assert events.count((None, "[DONE]")) == 1


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"model": "gpt-4", "prompt": "hi"}, 404, "gpt-4"),
        ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "prompt": {"text": "hi"}}, 400, "prompt"),
        ({"model": MODEL_NAME, "prompt": []}, 400, "empty"),
        ({"model": MODEL_NAME, "prompt": [1, 99999999]}, 400, "99999999"),
        ({"model": MODEL_NAME, "prompt": ["a", "b"]}, 400, "one prompt"),
        ({"model": MODEL_NAME, "prompt": "hi", "n": 129}, 400, "'n'"),
        ({"model": MODEL_NAME, "prompt": "hi", "n": 0}, 400, "'n'"),
        ({"model": MODEL_NAME, "prompt": "hi", "temperature": 3}, 400, "temperature"),
        ({"model": MODEL_NAME, "prompt": "hi", "stop": [""]}, 400, "stop"),
        ({"model": MODEL_NAME, "prompt": "hi", "echo": True}, 400, "echo"),
        ({"model": MODEL_NAME, "prompt": "word " * 300}, 400, "context is 256 tokens"),
        ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 300}, 400, "lower the max tokens"),
    ],
)
def test_completion_bad_input(client, engine, body, status, fragment):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    assert fragment in error_of(response)["message"]
    assert engine.submitted == []


def test_admission_error_is_400(client, engine):
    engine.admission_limit = 3
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "one two three four five"})
    assert response.status_code == 400
    assert "KV cache" in error_of(response)["message"]
    assert 'tp_runtime_request_rejects_total{reason="admission"} 1.0' in client.get("/metrics").text


def test_unavailable_engine_is_503(client, engine):
    engine.unavailable = "the runtime is shutting down and takes no new requests"
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    assert response.status_code == 503
    assert error_of(response)["message"] == engine.unavailable


def test_server_keeps_serving_after_bad_requests(client):
    for _ in range(3):
        assert client.post("/v1/completions", content=b"nonsense").status_code == 400
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "still here", "max_tokens": 2})
    assert response.status_code == 200


# ---- /v1/chat/completions -------------------------------------------------------------------------


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    text = render_chat(tokenizer, [ChatMessage("user", content)])
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_completion_renders_template(client, engine, tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    response = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 4})
    assert response.status_code == 200
    ids = chat_prompt_ids(tokenizer, "What is 2+2?")
    assert engine.submitted[0][0] == ids
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nYou are a helpful")
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": echo(tokenizer, ids, 4)}
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_chat_default_max_tokens_fills_the_context(client, engine, tokenizer):
    response = client.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    )
    assert response.status_code == 200
    prompt, params = engine.submitted[0]
    assert params.max_tokens == engine.max_model_len - len(prompt)
    # The echo reaches the system turn's <|im_end|>, which is EOS: a natural stop.
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    system_prompt = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert choice["message"]["content"] == f"system\n{system_prompt}"


def test_chat_stream_role_first_then_content(client, tokenizer):
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "yo"}], "max_tokens": 6, "stream": True},
    ) as response:
        events = sse_events(response.read().decode())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == echo(tokenizer, chat_prompt_ids(tokenizer, "yo"), 6)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "empty"),
        ("hello", "messages"),
        ([{"role": "wizard", "content": "hi"}], "wizard"),
        ([{"content": "hi"}], "role"),
        ([{"role": "user"}], "content is missing"),
        ([{"role": "user", "content": 7}], "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text"),
    ],
)
def test_chat_bad_messages_are_400(client, engine, messages, fragment):
    response = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages})
    assert response.status_code == 400, response.text
    assert fragment in error_of(response)["message"]
    assert engine.submitted == []


# ---- health, models, metrics, unknown routes ----------------------------------------------------


def test_health(client, engine):
    assert client.get("/health").json() == {"status": "ok"}
    engine.health_state = Health(False, "rank 1 is gone")
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "reason": "rank 1 is gone"}


def test_models_lists_the_served_model(client, engine):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    listed = [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]]
    assert listed == [(MODEL_NAME, "model", engine.max_model_len)]


def test_unknown_route_is_json_404(client):
    response = client.get("/v2/nothing")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def test_engine_stats_are_exposed_as_prometheus_metrics(client, engine):
    client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "count these tokens", "max_tokens": 7})
    client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("tp_runtime_requests_waiting") == 2
    assert value("tp_runtime_kv_pages_used") == 6
    assert value("tp_runtime_kv_pages_free") == 90
    assert value("tp_runtime_kv_pages_cached") == 3
    assert value("tp_runtime_kv_pages_marked") == 4
    assert value("tp_runtime_kv_pages_cleared_total") == 17
    assert value("tp_runtime_preemptions_total") == 5
    assert value("tp_runtime_step_rejects_total") == 3
    assert value("tp_runtime_step_aborts_total") == 1
    assert value("tp_runtime_generation_tokens_total") == 7
    assert value("tp_runtime_peer_longest_silence_seconds") == 0.75
    assert value("tp_runtime_step_latency_seconds_count") == 7
    # The fake's latencies cycle 3, 6, 9, 12 ms.
    assert value("tp_runtime_step_latency_seconds_bucket", le="0.005") == 2
    assert value("tp_runtime_step_latency_seconds_bucket", le="0.01") == 6
    assert value("tp_runtime_http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert value("tp_runtime_http_requests_total", endpoint="/v1/completions", status="404") == 1
    assert value("tp_runtime_request_rejects_total", reason="invalid") == 1
    # Latencies are drained per scrape; the histogram keeps what it has seen.
    again = client.get("/metrics").text
    assert "tp_runtime_step_latency_seconds_count 7.0" in again


def test_completions_return_token_ids_on_request(client, engine) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "return_token_ids": True}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["token_ids"] == [5, 6, 7]
    streamed = client.post("/v1/completions", json={**body, "stream": True}).text
    chunks = [json.loads(line[len("data: "):]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == [5, 6, 7]
    assert "token_ids" not in client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).json()["choices"][0]
