"""A vLLM user's application against the real server: the official openai client with no extra
arguments, on the default SmolLM2 started with a vLLM command line (positional model, vLLM's names);
each request whole and streamed. And structured output under the overlapped step loop: the same
greedy tokens as the serial loop (fp32), and a grammar that a mask one token stale would break stays
followed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from scripts.harness.runtime import RuntimeServer, ServerOptions
from tests.e2e.serving import Server

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[RuntimeServer]:
    from executor.model import default_model_path

    # As `vllm serve MODEL ...` is typed: the model positional, vLLM's spellings of the options.
    vllm_line = (
        str(default_model_path()), "--dtype", "float32", "--max-model-len", "2048", "--enable-prefix-caching",
        "--seed", "0", "--trust-remote-code", "--disable-log-requests", "--max-num-seqs", "8",
    )
    server = RuntimeServer(ServerOptions(extra_args=vllm_line))
    server.start(timeout_s=180)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(smollm2: RuntimeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2.url}/v1", api_key="unused")


def stream_of(client: openai.OpenAI, **kwargs) -> tuple[str, list[dict], str | None]:
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=client.models.list().data[0].id, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def whole(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=client.models.list().data[0].id, **kwargs).choices[0]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate(client, stream):
    kwargs = dict(
        messages=[{"role": "user", "content": "Describe the capital of France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
        temperature=0, max_tokens=60,
    )
    content = stream_of(client, **kwargs)[0] if stream else whole(client, **kwargs).message.content
    jsonschema.validate(json.loads(content), CITY)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_parses(client, stream):
    kwargs = dict(
        messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60
    )
    if stream:
        _, calls, reason = stream_of(client, **kwargs)
    else:
        choice = whole(client, **kwargs)
        reason = choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert reason == "tool_calls" and calls and all(c["name"] == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_history_with_tool_messages_replays(client, stream):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{
                "id": "call_abc", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    kwargs = dict(messages=history, tools=[WEATHER], temperature=0, max_tokens=12)
    if stream:
        content, _, reason = stream_of(client, **kwargs)
    else:
        choice = whole(client, **kwargs)
        content, reason = choice.message.content, choice.finish_reason
    assert reason in ("stop", "length", "tool_calls") and (content or reason == "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_store_and_metadata_are_accepted(client, stream):
    kwargs = dict(messages=[{"role": "user", "content": "Say hi."}], store=True, metadata={"trace": "t-1"}, max_tokens=4)
    content = stream_of(client, **kwargs)[0] if stream else whole(client, **kwargs).message.content
    assert content


# ---- structured output under the overlapped loop ------------------------------------------------

ALTERNATING = "([0-9][a-z]){6}"
GRAMMARS = (
    {"guided_regex": ALTERNATING},
    {"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                      "b": {"type": "boolean"}},
                     "required": ["a", "b"], "additionalProperties": False}},
    {"guided_choice": ["alpha", "beta", "gamma"]},
    {"response_format": {"type": "json_object"}},
)
PROMPTS = ("The quick brown fox", "Hello", "1, 2, 3,")


def constrained_tokens(server: Server) -> list[tuple[list[int], str, str]]:
    """Every (prompt, grammar) at once, so that they share steps; (token ids, text, finish reason)."""

    def one(job: tuple[str, dict]) -> tuple[list[int], str, str]:
        prompt, grammar = job
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "return_token_ids": True, **grammar}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=180)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["text"], choice["finish_reason"]

    jobs = [(prompt, grammar) for prompt in PROMPTS for grammar in GRAMMARS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def test_structured_output_is_the_same_with_overlap_on_and_off(server_tp1: Server, serial_tp1: Server):
    overlapped = constrained_tokens(server_tp1)
    assert overlapped == constrained_tokens(serial_tp1)
    for (_, text, reason), (_, grammar) in zip(overlapped, [(p, g) for p in PROMPTS for g in GRAMMARS]):
        # A random tiny model: only the grammar keeps these outputs in shape, token after token.
        if "guided_regex" in grammar:
            assert re.fullmatch(ALTERNATING, text) and reason == "stop", text
        elif "guided_choice" in grammar:
            assert text in grammar["guided_choice"] and reason == "stop"
        elif "guided_json" in grammar:  # bounded: it must close
            assert reason == "stop" and set(json.loads(text)) == {"a", "b"}, text
        elif reason == "stop":  # any object: a random model may write one key for ever
            assert isinstance(json.loads(text), dict), text
