"""Every OpenAI parameter this server takes or refuses, through the official openai client, streaming
and not, against the app with the fake engine (in-process; one case under a real uvicorn)."""

from __future__ import annotations

import itertools
import json

import openai
import pytest
from server.fake_engine import MODEL_NAME, FakeEngine, logprob_of

from tp_runtime.http import ServerSettings, create_app
from tp_runtime.http.logprobs import token_text

ALIAS = "the-alias"
PROMPT = "Once upon a time"


@pytest.fixture
def served(tokenizer):
    from fastapi.testclient import TestClient

    engine = FakeEngine()
    app = create_app(engine, tokenizer, ServerSettings((MODEL_NAME, ALIAS), model_path="/models/smollm2.gguf", api_key="key"))
    with TestClient(app) as http:
        yield engine, http, openai.OpenAI(base_url="http://testserver/v1", api_key="key", http_client=http, max_retries=0)


@pytest.fixture
def engine(served):
    return served[0]


@pytest.fixture
def api(served) -> openai.OpenAI:
    return served[2]


def echo_ids(tokenizer, prompt_ids, n):
    return [prompt_ids[i % len(prompt_ids)] for i in range(n)]


# ---- logprobs --------------------------------------------------------------------------------------


def test_completion_logprobs(api, tokenizer):
    result = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, logprobs=0)
    lp = result.choices[0].logprobs
    ids = echo_ids(tokenizer, tokenizer.encode(PROMPT), 6)
    assert lp.tokens == [token_text(tokenizer, t) for t in ids]
    assert "".join(lp.tokens) == result.choices[0].text
    assert lp.token_logprobs == [logprob_of(i) for i in range(6)]
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    assert lp.top_logprobs == [{token: logprob} for token, logprob in zip(lp.tokens, lp.token_logprobs)]


def test_an_invalid_byte_s_replacement_character_is_its_own_token_s_text(api, tokenizer):
    # The byte-level detokenizer reads each token's bytes as they come: a stray continuation byte
    # is U+FFFD at once, at its own token's offset (vLLM's detokenizer holds it to the next token).
    stray = next(t for t in range(tokenizer.vocab_size) if tokenizer.token_bytes(t) == b"\x80")
    prompt = [stray, *tokenizer.encode(" ok")]
    result = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=len(prompt), logprobs=0)
    lp = result.choices[0].logprobs
    assert result.choices[0].text == "\ufffd ok"
    assert lp.text_offset == [0, *(1 + len(tokenizer.decode(prompt[1:i])) for i in range(1, len(prompt)))]


def test_completion_logprobs_stream_add_up_to_the_whole(api):
    whole = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, logprobs=0).choices[0].logprobs
    chunks = [c for c in api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, logprobs=0, stream=True)]
    parts = [c.choices[0].logprobs for c in chunks if c.choices]
    assert list(itertools.chain(*(p.tokens for p in parts))) == whole.tokens
    assert list(itertools.chain(*(p.token_logprobs for p in parts))) == whole.token_logprobs
    assert list(itertools.chain(*(p.text_offset for p in parts))) == whole.text_offset


def test_completion_without_logprobs_has_none(api):
    assert api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs(api, tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    result = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, logprobs=True)
    content = result.choices[0].logprobs.content
    assert len(content) == 12 == result.usage.completion_tokens
    assert [c.logprob for c in content] == [logprob_of(i) for i in range(12)]
    assert all(c.top_logprobs == [] for c in content)
    # The bytes are exact (a token may hold part of a character); the text is the reply's.
    text = b"".join(bytes(c.bytes) for c in content).decode()
    assert result.choices[0].message.content in text


def test_chat_logprobs_stream(api):
    messages = [{"role": "user", "content": "héllo 🎉"}]
    whole = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9, logprobs=True, top_logprobs=0)
    stream = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9, logprobs=True, stream=True)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob, t.bytes) for t in streamed] == [
        (t.token, t.logprob, t.bytes) for t in whole.choices[0].logprobs.content
    ]


# ---- what is refused -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tool_choice": "auto"}, "tool_choice"),  # without tools
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_json": {}}}, "guided_json"),
    ],
)
def test_chat_refuses_what_it_cannot_honour(api, engine, kwargs, param, stream):
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], stream=stream, **kwargs
        )
    assert refused.value.body["param"] == param and param in refused.value.body["message"]
    assert engine.submitted == []


@pytest.mark.parametrize(
    "kwargs, param",
    [({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of"), ({"echo": True}, "echo"), ({"n": 2, "best_of": 3}, "best_of")],
)
def test_completions_refuse_what_they_cannot_honour(api, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=MODEL_NAME, prompt="x", **kwargs)
    assert refused.value.body["param"] == param


def test_neutral_values_pass(api):
    result = api.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2, n=1, presence_penalty=0,
        frequency_penalty=0, logit_bias={}, response_format={"type": "text"}, user="u-1", seed=3,
    )
    assert result.usage.completion_tokens == 2


def test_fields_that_change_nothing_are_accepted(api, engine):
    # What the official client and agent frameworks send: vLLM logs such fields and goes on.
    result = api.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2, store=True,
        metadata={"run": "7"}, service_tier="auto", reasoning_effort="low", parallel_tool_calls=False,
    )
    assert result.usage.completion_tokens == 2 and len(engine.submitted) == 1


# ---- names, roles, keys, overload ------------------------------------------------------------------


def test_served_model_names(api):
    cards = api.models.list().data
    assert [c.id for c in cards] == [MODEL_NAME, ALIAS]
    assert {c.root for c in cards} == {"/models/smollm2.gguf"}
    # vLLM's semantics: any served name is taken, the first one is reported.
    assert api.completions.create(model=ALIAS, prompt="x", max_tokens=1).model == MODEL_NAME
    stream = api.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True)
    assert {c.model for c in stream} == {MODEL_NAME}
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="smollm2", prompt="x")


def test_role_only_in_the_first_chat_delta(served):
    _, http, _ = served
    body = {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 5, "stream": True}
    text = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer key"}).text
    chunks = [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("role" not in d and None not in d.values() for d in deltas[1:])
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_api_key_through_the_client(served):
    _, http, _ = served
    wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL_NAME, prompt="x")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_overload_through_the_client(api, engine):
    engine.max_in_flight = 0
    with pytest.raises(openai.RateLimitError) as limited:
        api.completions.create(model=MODEL_NAME, prompt="x")
    assert limited.value.response.headers["retry-after"] == "2"


def test_logprobs_stream_under_a_real_server(live_server, tokenizer):
    api = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=10)
    stream = api.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, logprobs=True, stream=True
    )
    chunks = list(stream)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in tokens] == [logprob_of(i) for i in range(6)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    api.close()
