"""The logits-processing parameters, alternatives and n > 1 through the official openai client, streaming
and not, against the app with the fake engine (tests/server/fake_engine.py): what reaches the engine,
what comes back, and what is refused, naming the field, before anything is submitted."""

from __future__ import annotations

import itertools
import time

import httpx
import openai
import pytest
from server.fake_engine import MODEL_NAME, FakeEngine, alternatives_of, logprob_of

from tp_runtime.http import ServerSettings, create_app
from tp_runtime.http.logprobs import token_text

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
def served(tokenizer):
    from fastapi.testclient import TestClient

    engine = FakeEngine()
    app = create_app(engine, tokenizer, ServerSettings((MODEL_NAME,)))
    with TestClient(app) as http:
        yield engine, openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture
def engine(served) -> FakeEngine:
    return served[0]


@pytest.fixture
def api(served) -> openai.OpenAI:
    return served[1]


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT)


def echoed(tokenizer, n: int) -> list[int]:
    ids = prompt_ids(tokenizer)
    return [ids[i % len(ids)] for i in range(n)]


# ---- alternatives ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_k_returns_k_alternatives(api, engine, tokenizer, stream):
    k = 3
    result = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, logprobs=k, stream=stream)
    choices = [c.choices[0] for c in result if c.choices] if stream else result.choices
    tops = list(itertools.chain(*(c.logprobs.top_logprobs for c in choices if c.logprobs)))
    ids = echoed(tokenizer, 5)
    assert tops == [
        {token_text(tokenizer, t): lp for t, lp in alternatives_of(token, i, k)} for i, token in enumerate(ids)
    ]
    assert engine.submitted[-1][1].top_logprobs == k


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_k(api, engine, tokenizer, stream):
    k = 20  # OpenAI's most
    result = api.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=k, stream=stream
    )
    if stream:
        content = [t for c in result if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    else:
        content = result.choices[0].logprobs.content
    assert len(content) == 4
    prompt = engine.submitted[-1][0]  # the fake echoes the templated prompt
    for i, entry in enumerate(content):
        expected = alternatives_of(prompt[i % len(prompt)], i, k)
        assert [(a.token, a.logprob, a.bytes) for a in entry.top_logprobs] == [
            (token_text(tokenizer, t), lp, list(tokenizer.token_bytes(t))) for t, lp in expected
        ]
        assert entry.top_logprobs[0].logprob == entry.logprob == logprob_of(i)
    assert engine.submitted[-1][1].top_logprobs == k


@pytest.mark.parametrize(
    "create, kwargs, param",
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ],
)
def test_alternatives_out_of_range_are_refused(api, engine, create, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        if create == "chat":
            api.chat.completions.create(model=MODEL_NAME, messages=CHAT, **kwargs)
        else:
            api.completions.create(model=MODEL_NAME, prompt=PROMPT, **kwargs)
    assert refused.value.body["param"] == param
    assert engine.submitted == []


# ---- penalties, min_tokens, logit bias --------------------------------------------------------------


PROCESSING = dict(presence_penalty=0.5, frequency_penalty=-1.25, logit_bias={"42": 7, "7": -100, "49151": 0.5})
EXTRA = {"repetition_penalty": 1.3, "min_tokens": 3}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_penalties_min_tokens_and_logit_bias_reach_the_engine(api, engine, endpoint, stream):
    if endpoint == "chat":
        result = api.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=5, stream=stream, extra_body=EXTRA, **PROCESSING
        )
    else:
        result = api.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=5, stream=stream, extra_body=EXTRA, **PROCESSING
        )
    if stream:
        list(result)
    params = engine.submitted[-1][1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.25, 1.3)
    assert params.min_tokens == 3
    assert params.logit_bias == ((7, -100.0), (42, 7.0), (49151, 0.5))  # ascending ids, as the wire wants them


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": 6}}, "min_tokens"),  # above max_tokens 5
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # past SmolLM2's vocabulary
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
    ],
)
def test_out_of_range_values_are_a_400_naming_the_field(api, engine, kwargs, param, stream):
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, stream=stream, **kwargs)
    assert refused.value.body["param"] == param and param in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, stream=stream, **kwargs)
    assert refused.value.body["param"] == param
    assert engine.submitted == []


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_the_stop_token_and_stop_strings_back(api, tokenizer, stream):
    """The fake echoes the prompt; its second token, made a stop token, would end the output at once.
    Before min_tokens the engine samples something else (the fake: the next id), and no stop string
    ends the output either."""
    ids = prompt_ids(tokenizer)
    second = token_text(tokenizer, ids[1])
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, logprobs=0, stream=stream)
    plain = api.completions.create(**body, extra_body={"stop_token_ids": [ids[1]], "return_token_ids": True})
    plain_choices = [c.choices[0] for c in plain if c.choices] if stream else plain.choices
    assert [t for c in plain_choices for t in (c.token_ids or [])] == [ids[0], ids[1]]
    held = api.completions.create(
        **body, extra_body={"stop_token_ids": [ids[1]], "min_tokens": 4, "return_token_ids": True}
    )
    held_choices = [c.choices[0] for c in held if c.choices] if stream else held.choices
    tokens = [t for c in held_choices for t in (c.token_ids or [])]
    assert tokens[:2] == [ids[0], ids[1] + 1] and ids[1] not in tokens[:4]
    # A stop string inside the first min_tokens tokens does not end the output; after them it does.
    first_three = "".join(token_text(tokenizer, t) for t in echoed(tokenizer, 3))
    stopped = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, stop=[second])
    assert stopped.choices[0].text == token_text(tokenizer, ids[0])
    late = api.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, stop=[second], extra_body={"min_tokens": 3}
    )
    assert late.choices[0].text.startswith(first_three) and late.choices[0].finish_reason in ("stop", "length")


# ---- n > 1 ------------------------------------------------------------------------------------------


def test_n_choices_share_the_prompt_through_their_leader_with_derived_seeds(api, engine, tokenizer):
    result = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, n=3, seed=41, logprobs=1)
    assert [c.index for c in result.choices] == [0, 1, 2]
    expected = "".join(token_text(tokenizer, t) for t in echoed(tokenizer, 4))
    assert [c.text for c in result.choices] == [expected] * 3
    assert all(len(c.logprobs.tokens) == 4 for c in result.choices)
    assert result.usage.prompt_tokens == len(prompt_ids(tokenizer))
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == 12 + len(prompt_ids(tokenizer))
    first = len(engine.submitted) - 2  # request ids count submits from 1
    assert engine.leaders[-3:] == [None, first, first]
    assert [params.seed for _, params in engine.submitted[-3:]] == [41, 42, 43]
    assert len({tuple(prompt) for prompt, _ in engine.submitted[-3:]}) == 1


def test_best_of_equal_to_n_is_taken(api):
    result = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=2, best_of=2)
    assert len(result.choices) == 2


def test_chat_n_choices(api, engine):
    result = api.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, n=2, logprobs=True)
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.message.role == "assistant" and len(c.logprobs.content) == 3 for c in result.choices)
    assert result.usage.completion_tokens == 6
    assert engine.leaders[-2:] == [None, len(engine.submitted) - 1]
    assert [params.seed for _, params in engine.submitted[-2:]] == [None, None]  # unseeded stays unseeded


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_stream_interleaved_by_index(served, endpoint):
    engine, api = served
    engine.token_delay_s = 0.002
    if endpoint == "chat":
        stream = api.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=5, n=3, stream=True, stream_options={"include_usage": True}
        )
    else:
        stream = api.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=3, stream=True, stream_options={"include_usage": True}
        )
    chunks = list(stream)
    indexes = [c.choices[0].index for c in chunks if c.choices]
    assert set(indexes) == {0, 1, 2}
    # Interleaved: choice 0 does not stream all of itself before the others begin.
    assert indexes.index(1) < len(indexes) - 1 - indexes[::-1].index(0)
    for index in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert sum(1 for c in mine if c.finish_reason is not None) == 1 and mine[-1].finish_reason == "length"
        if endpoint == "chat":
            assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
    assert chunks[-1].usage.completion_tokens == 15


def test_a_failed_choice_fails_the_request_and_cancels_the_others(served):
    engine, api = served
    engine.fail_after = 2
    with pytest.raises(openai.InternalServerError):
        api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=3)
    assert not engine.active


def test_an_overloaded_sibling_cancels_the_choices_already_submitted(served):
    engine, api = served

    submit = engine.submit

    def two_then_overloaded(prompt, params, *, prompt_leader=None):
        from tp_runtime.engine import EngineOverloaded

        if len(engine.submitted) == 2:
            raise EngineOverloaded("the queue is full", retry_after_s=1.0)
        return submit(prompt, params, prompt_leader=prompt_leader)

    engine.submit = two_then_overloaded
    with pytest.raises(openai.RateLimitError):
        api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=4)
    assert engine.cancelled == [1, 2]


def test_a_client_that_leaves_cancels_all_n(live_server):

    engine = live_server.engine
    engine.token_delay_s = 0.05
    body = {"prompt": PROMPT, "max_tokens": 200, "n": 3, "stream": True}
    with httpx.stream("POST", f"{live_server.base_url}/v1/completions", json=body, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 5
    while len(engine.cancelled) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(engine.cancelled) == [1, 2, 3]


def test_completion_alternatives_that_read_alike_keep_the_sampled_tokens_logprob(tokenizer):
    """Legacy top_logprobs is keyed by text: two byte tokens that are each part of a character both
    read U+FFFD, and the sampled token's own logprob must not be overwritten by a likelier one."""
    from tp_runtime.http import logprobs
    from tp_runtime.http.generation import SampledToken

    alike = [t for t in range(tokenizer.vocab_size) if token_text(tokenizer, t) == "\ufffd"][:2]
    assert len(alike) == 2
    sampled = SampledToken(alike[0], -2.0, 0, ((alike[1], -0.5), (alike[0], -2.0), (42, -3.0)))
    shaped = logprobs.for_completion(tokenizer, [sampled], 1)
    assert shaped.token_logprobs == [-2.0]
    assert shaped.top_logprobs == [{"\ufffd": -2.0, token_text(tokenizer, 42): -3.0}]


@pytest.mark.parametrize("max_logprobs", [20, 0])  # logprobs: 0 still reads it, as an unfinished character does
def test_the_token_byte_table_is_built_as_the_app_starts(max_logprobs):
    # ~85 ms for this vocabulary: not in the first request that asks for logprobs or streams.
    from server.fake_engine import FakeEngine

    from executor.default_model import default_model_path
    from tp_runtime.tokenizer import Tokenizer

    fresh = Tokenizer.from_model_path(default_model_path())
    assert "_byte_table" not in vars(fresh) and "text_bytes_by_id" not in vars(fresh)
    create_app(FakeEngine(), fresh, ServerSettings((MODEL_NAME,), max_logprobs=max_logprobs))
    assert "_byte_table" in vars(fresh) and "text_bytes_by_id" in vars(fresh)
