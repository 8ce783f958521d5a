"""tp_runtime.http.validation as plain functions: every field against what the wire and the sampler
carry (protocol/sampling_limits.py), each refusal a 400 naming the field."""

from __future__ import annotations

import pytest

from protocol.sampling_limits import FLOAT32_MAX, SEED_MAX, TEMPERATURE_MIN, TOP_K_MAX, TOP_P_MIN
from tp_runtime.http import validation
from tp_runtime.http.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingRequest,
)
from tp_runtime.http.errors import ApiError

VOCAB = 1000
LIMITS = validation.Limits(vocab_size=VOCAB, max_model_len=64, max_prompt_chars=500, eos_token_ids=(2,))


def sampling(**changes) -> SamplingRequest:
    base = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}
    return SamplingRequest(**{**base, **changes})


def refusal(call, *args) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call(*args)
    assert raised.value.status == 400
    return raised.value


@pytest.mark.parametrize(
    "changes, param",
    [
        ({"temperature": 1e-40}, "temperature"),  # a denormal: logits / t overflow to inf, NaN probabilities
        ({"temperature": TEMPERATURE_MIN / 2}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 3.0, "temperature_max": 2.0}, "temperature"),
        ({"temperature": FLOAT32_MAX * 2}, "temperature"),  # inf in float32: the executor REJECTs the batch
        ({"top_p": 1e-46}, "top_p"),  # 0 in float32
        ({"top_p": TOP_P_MIN / 10}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_k": 2**31}, "top_k"),  # overflowed the scheduler's int32 row and ended the engine loop
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("x" * (validation.MAX_STOP_STRING_CHARS + 1),)}, "stop"),
        ({"stop": tuple("abcdefghijklmnopq")}, "stop"),
        ({"stop": ("\ud800",)}, "stop"),
        ({"stop_token_ids": (VOCAB,)}, "stop_token_ids"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_out_of_range_sampling_is_refused_naming_the_field(changes, param):
    error = refusal(validation.check_sampling, sampling(**changes), VOCAB)
    assert error.param == param
    assert f"'{param}'" in error.message


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0.0},
        {"temperature": TEMPERATURE_MIN},
        {"temperature": FLOAT32_MAX},
        {"top_p": TOP_P_MIN},
        {"top_k": -1},
        {"top_k": TOP_K_MAX},
        {"seed": 0},
        {"seed": SEED_MAX},
        {"stop": ("x" * validation.MAX_STOP_STRING_CHARS,), "stop_token_ids": (0, VOCAB - 1)},
    ],
)
def test_the_edges_of_every_range_are_accepted(changes):
    validation.check_sampling(sampling(**changes), VOCAB)


def test_field_names_are_the_bodys_own():
    generate = GenerateRequest.model_validate({"text": "x", "sampling_params": {"max_completion_tokens": 0}}).sampling()
    assert refusal(validation.check_sampling, generate, VOCAB).param == "sampling_params.max_completion_tokens"
    chat = ChatCompletionRequest.model_validate({"messages": [], "max_completion_tokens": 100})
    prepared_sampling = chat.sampling(*chat.max_tokens_given())
    error = refusal(validation.prepare, [5] * 10, prepared_sampling, LIMITS, "messages")
    assert (error.param, error.code) == ("max_completion_tokens", "context_length_exceeded")


def test_prepare_checks_the_prompt_against_context_and_vocabulary():
    assert refusal(validation.prepare, [], sampling(), LIMITS, "prompt").param == "prompt"
    too_long = refusal(validation.prepare, [5] * 64, sampling(), LIMITS, "prompt")
    assert (too_long.param, too_long.code) == ("prompt", "context_length_exceeded")
    assert refusal(validation.prepare, [5, VOCAB], sampling(), LIMITS, "prompt").param == "prompt"
    assert refusal(validation.prepare, [5, -3], sampling(), LIMITS, "prompt").param == "prompt"
    prepared = validation.prepare([5, 6], sampling(max_tokens=None, stop_token_ids=(9, 2), top_k=-1), LIMITS, "prompt")
    assert prepared.params.max_tokens == 62 and prepared.params.top_k == 0
    assert prepared.params.stop_token_ids == (9, 2)


def test_text_that_is_not_unicode_and_prompts_past_the_cap():
    error = refusal(validation.check_text, "ok \udc80 no", "prompt")
    assert error.param == "prompt" and "surrogate" in error.message
    validation.check_text("émoji 🎉", "prompt")
    cap = refusal(validation.check_prompt_chars, 501, LIMITS, "prompt")
    assert (cap.param, cap.code) == ("prompt", "context_length_exceeded")
    validation.check_prompt_chars(500, LIMITS, "prompt")


@pytest.mark.parametrize(
    "field, value",
    [
        ("echo", True), ("suffix", "tail"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ],
)
def test_unsupported_fields_are_refused_by_name(field, value):
    chat = field.startswith("function")
    request = ChatCompletionRequest if chat else CompletionRequest
    base = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    body = request.model_validate({**base, field: value})
    error = refusal(validation.refuse_unsupported, body)
    assert (error.param, error.code) == (field, "unsupported_parameter")


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_p", 0), ("response_format", {"type": "text"}), ("echo", False), ("suffix", ""),
    ],
)
def test_neutral_values_of_unsupported_fields_pass(field, value):
    validation.refuse_unsupported(CompletionRequest.model_validate({"prompt": "x", field: value}))


def test_best_of_is_taken_only_as_n():
    for body in ({"prompt": "x"}, {"prompt": "x", "best_of": 1}, {"prompt": "x", "n": 3, "best_of": 3}):
        validation.check_best_of(CompletionRequest.model_validate(body))
    for body in ({"prompt": "x", "best_of": 2}, {"prompt": "x", "n": 2, "best_of": 4}):
        error = refusal(validation.check_best_of, CompletionRequest.model_validate(body))
        assert (error.param, error.code) == ("best_of", "unsupported_parameter") and "n choices" in error.message


def test_logprobs_and_how_many_alternatives():
    assert validation.completion_logprobs(CompletionRequest.model_validate({"prompt": "x", "logprobs": 0})) == (True, 0)
    assert validation.completion_logprobs(CompletionRequest.model_validate({"prompt": "x", "logprobs": 20})) == (True, 20)
    assert validation.completion_logprobs(CompletionRequest.model_validate({"prompt": "x"})) == (False, 0)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert validation.chat_logprobs(ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 3})) == (True, 3)
    assert validation.chat_logprobs(ChatCompletionRequest.model_validate({**chat, "logprobs": True})) == (True, 0)
    no_logprobs = ChatCompletionRequest.model_validate({**chat, "top_logprobs": 1})
    assert "needs 'logprobs'" in refusal(validation.chat_logprobs, no_logprobs).message
    for top in (21, -1):
        error = refusal(validation.check_sampling, sampling(top_logprobs=top, top_logprobs_field="logprobs"), VOCAB)
        assert error.param == "logprobs"


@pytest.mark.parametrize(
    "changes, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-6}, "repetition_penalty"),  # dividing by it overflows a logit
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9}, "min_tokens"),  # above max_tokens 8
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),  # the same token twice
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": validation.MAX_N + 1}, "n"),
    ],
)
def test_out_of_range_processing_is_refused_naming_the_field(changes, param):
    assert refusal(validation.check_sampling, sampling(**changes), VOCAB).param == param


def test_the_edges_of_the_processing_ranges_are_taken_and_reach_the_params():
    edges = sampling(
        presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-5, min_tokens=8, n=validation.MAX_N,
        logit_bias={str(VOCAB - 1): 100, "0": -100, "7": 0.5, **{str(i): 1 for i in range(100, 397)}}, top_logprobs=20,
    )
    validation.check_sampling(edges, VOCAB)
    prepared = validation.prepare([5, 6], edges, LIMITS, "prompt")
    params = prepared.params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (-2.0, 2.0, 1e-5)
    assert (params.min_tokens, params.top_logprobs, prepared.n) == (8, 20, validation.MAX_N)
    assert params.logit_bias[:3] == ((0, -100.0), (7, 0.5), (100, 1.0)) and params.logit_bias[-1] == (VOCAB - 1, 100.0)
    assert len(params.logit_bias) == 300


def test_min_tokens_above_what_the_context_leaves_is_refused_after_tokenizing():
    # max_tokens left out: the rest of a 64-token context, 62 after a two-token prompt.
    error = refusal(validation.prepare, [5, 6], sampling(max_tokens=None, min_tokens=63), LIMITS, "prompt")
    assert error.param == "min_tokens" and "62" in error.message


def test_seeds_of_n_samples():
    assert [validation.sample_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert validation.sample_seed(None, 2) is None
    assert validation.sample_seed(2**63 - 1, 1) == 0  # wrapped into [0, 2**63)


def test_model_must_be_one_of_the_served_names():
    validation.check_model(None, ("a", "b"))
    validation.check_model("b", ("a", "b"))
    with pytest.raises(ApiError) as raised:
        validation.check_model("c", ("a", "b"))
    assert (raised.value.status, raised.value.param) == (404, "model")
