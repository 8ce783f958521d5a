"""A vLLM user's requests against the app with the fake engine, through the official openai client:
tool calls (auto, required, named, none; histories), structured-output fields reaching the engine
as a grammar, min_p, the Origin rule, /tokenize, /detokenize, /version and /ping."""

from __future__ import annotations

import json

import openai
import pytest
from server.fake_engine import MODEL_NAME, FakeEngine

from protocol.grammar import GrammarKind, GrammarSpec
from tp_runtime.http import ServerSettings, create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def served(tokenizer):
    from fastapi.testclient import TestClient

    engine = FakeEngine(max_model_len=2048)  # tool definitions make long prompts
    app = create_app(engine, tokenizer, ServerSettings((MODEL_NAME,)))
    with TestClient(app) as http:
        yield engine, http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def say(engine: FakeEngine, tokenizer, text: str) -> None:
    engine.reply = tokenizer.encode(text, add_special_tokens=False)


def streamed(api, **kwargs) -> tuple[str, list[dict], str | None]:
    """(content, tool calls, finish reason) of a stream, accumulated as an agent framework does."""
    content, calls, reason = "", {}, None
    for chunk in api.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_in_the_hermes_format(served, tokenizer, stream):
    engine, _, api = served
    say(engine, tokenizer, 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    if stream:
        content, calls, reason = streamed(api, messages=ASK, tools=[WEATHER, TIME])
    else:
        message = api.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME]).choices[0]
        reason, content = message.finish_reason, message.message.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.message.tool_calls]
    assert content == "Let me look." and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")
    prompt = tokenizer.decode(engine.submitted[0][0], skip_special_tokens=False)
    # SmolLM2's template has no tool format: the documented Hermes default lists the tools.
    assert "<tools>" in prompt and '"get_weather"' in prompt and engine.submitted[0][1].grammar is None


@pytest.mark.parametrize("stream", [False, True])
def test_text_without_calls_streams_as_content(served, tokenizer, stream):
    engine, _, api = served
    say(engine, tokenizer, "It is sunny <b>today</b>.")
    if stream:
        content, calls, reason = streamed(api, messages=ASK, tools=[WEATHER])
    else:
        choice = api.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER]).choices[0]
        content, calls, reason = choice.message.content, choice.message.tool_calls or [], choice.finish_reason
    assert (content, calls, reason) == ("It is sunny <b>today</b>.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_required_is_constrained_by_a_schema_and_parses(served, tokenizer, stream):
    engine, _, api = served
    say(engine, tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    kwargs = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    if stream:
        content, calls, reason = streamed(api, **kwargs)
    else:
        choice = api.chat.completions.create(model=MODEL_NAME, **kwargs).choices[0]
        content, reason = choice.message.content, choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert not content and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    grammar = engine.submitted[0][1].grammar
    schema = json.loads(grammar.text)
    assert grammar.kind == GrammarKind.JSON_SCHEMA and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert {item["properties"]["name"]["enum"][0] for item in schema["items"]["anyOf"]} == {"get_weather", "get_time"}


def test_a_named_function_gets_its_parameters_schema(served, tokenizer):
    engine, _, api = served
    say(engine, tokenizer, '{"city": "Paris"}')
    choice = api.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert json.loads(engine.submitted[0][1].grammar.text) == WEATHER["function"]["parameters"]


def test_tool_choice_none_leaves_the_text_alone(served, tokenizer):
    engine, _, api = served
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    say(engine, tokenizer, text)
    choice = api.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="none").choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_history_with_tool_messages_replays(served, tokenizer, stream):
    engine, _, api = served
    say(engine, tokenizer, "It is 21 degrees in Paris.")
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    if stream:
        content = streamed(api, messages=history, tools=[WEATHER])[0]
    else:
        content = api.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER]).choices[0].message.content
    assert content == "It is 21 degrees in Paris."
    prompt = tokenizer.decode(engine.submitted[0][0], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<|im_start|>tool\n<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
            GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        ),
        ({"response_format": {"type": "json_object"}}, GrammarSpec(GrammarKind.JSON_OBJECT)),
        ({"extra_body": {"guided_json": SCHEMA}}, GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))),
        ({"extra_body": {"guided_regex": "[0-9]+"}}, GrammarSpec(GrammarKind.REGEX, "[0-9]+")),
        ({"extra_body": {"guided_choice": ["yes", "no"]}}, GrammarSpec(GrammarKind.CHOICE, '["yes", "no"]')),
        ({"extra_body": {"structured_outputs": {"regex": "a+"}}}, GrammarSpec(GrammarKind.REGEX, "a+")),
        ({"extra_body": {"structured_outputs": {"json": SCHEMA}}}, GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))),
        ({"extra_body": {"guided_grammar": 'start: "yes" | "no"'}}, GrammarSpec(GrammarKind.LARK, 'start: "yes" | "no"')),
    ],
)
def test_every_spelling_of_structured_output_reaches_the_engine(served, kwargs, expected):
    engine, _, api = served
    api.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=2, **kwargs)
    assert engine.submitted[0][1].grammar == expected


def test_min_p_reaches_the_engine(served):
    engine, _, api = served
    api.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, temperature=1, extra_body={"min_p": 0.25})
    assert engine.submitted[0][1].min_p == 0.25


def test_a_grammar_over_the_wire_limit_is_refused(served):
    engine, _, api = served
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(3000)}}
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL_NAME, messages=ASK, extra_body={"guided_json": huge})
    assert refused.value.body["param"] == "guided_json" and "bytes" in refused.value.body["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_a_foreign_origin_may_not_generate(served, path):
    engine, http, _ = served
    body = {"text": "hi"} if path == "/generate" else {"prompt": "hi", "max_tokens": 2}
    if path == "/v1/chat/completions":
        body = {"messages": ASK, "max_tokens": 2}
    # A browser's cross-site "simple request": no Content-Type preflight, the page's Origin.
    refused = http.post(path, content=json.dumps(body), headers={"Origin": "http://evil.example", "Content-Type": ""})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "foreign_origin"
    assert http.post(path, json=body, headers={"Origin": "null"}).status_code == 403
    assert engine.submitted == []
    # curl sends no Origin; a page of this very server would send its own.
    assert http.post(path, json=body).status_code == 200
    assert http.post(path, json=body, headers={"Origin": "http://testserver"}).status_code == 200


def test_tokenize_and_detokenize_in_vllms_shapes(served, tokenizer):
    _, http, _ = served
    answer = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello world")
    assert answer == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": ["Hello", "Ġworld"]}
    chat = http.post("/tokenize", json={"messages": ASK, "model": MODEL_NAME}).json()
    rendered = tokenizer.decode(chat["tokens"], skip_special_tokens=False)
    assert rendered.endswith("<|im_start|>assistant\n") and chat["count"] == len(chat["tokens"])
    assert chat["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
    # /tokenize generates nothing: a web page may call it.
    assert http.post("/tokenize", json={"prompt": "x"}, headers={"Origin": "http://a.example"}).status_code == 200


def test_version_and_ping(served):
    _, http, _ = served
    assert http.get("/version").json()["version"]
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_max_logprobs_caps_the_alternatives(tokenizer):
    from fastapi.testclient import TestClient

    app = create_app(FakeEngine(), tokenizer, ServerSettings((MODEL_NAME,), max_logprobs=2))
    with TestClient(app) as http:
        body = {"messages": ASK, "max_tokens": 2, "logprobs": True}
        assert http.post("/v1/chat/completions", json={**body, "top_logprobs": 2}).status_code == 200
        refused = http.post("/v1/chat/completions", json={**body, "top_logprobs": 3})
        assert refused.status_code == 400 and "--max-logprobs" in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_inside_an_event_of_several_tokens_ends_the_tokens_where_one_per_event_does(served, tokenizer, stream):
    """A step of several forwards hands a request several tokens in one event; a stop string that
    ends inside them leaves the tokens after it out of usage and logprobs, as one token per event
    (one forward per step) never sampled them."""
    engine, http, _ = served
    say(engine, tokenizer, "alpha beta gamma delta epsilon zeta eta theta iota kappa")
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 30, "stop": [" gam"], "logprobs": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    answers = []
    for per_event in (1, 4):
        engine.tokens_per_event = per_event
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            tokens = [t for c in chunks for choice in c["choices"] for t in (choice.get("logprobs") or {}).get("tokens", [])]
            text = "".join(choice["text"] for c in chunks for choice in c["choices"])
            answers.append((text, tokens, chunks[-1]["usage"]["completion_tokens"]))
        else:
            choice = response.json()["choices"][0]
            answers.append((choice["text"], choice["logprobs"]["tokens"], response.json()["usage"]["completion_tokens"]))
    assert answers[1] == answers[0]
    assert answers[0][0] == "alpha beta" and answers[0][2] < 10
