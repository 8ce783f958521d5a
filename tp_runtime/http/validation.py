"""Request validation at the edge, as plain functions: every field against what the wire and the
sampler carry (protocol/sampling_limits.py), so that no request can reach the engine with a value
that would fail a step it shares with others. Each failure is an ApiError (400) naming the field.

The order a route calls them in: the body's own fields (check_sampling, refuse_unsupported,
check_text, check_prompt_chars) before any tokenizing, then `prepare` on the token ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.sampling_limits import SEED_MAX, TEMPERATURE_MIN, TOP_K_MAX, TOP_P_MIN
from scheduler.request import InvalidSamplingParams, SamplingParams
from tp_runtime.http.api_models import ChatCompletionRequest, CompletionRequest, OpenAISampling, SamplingRequest
from tp_runtime.http.errors import context_too_long, invalid_request, model_not_found, unsupported

MAX_STOP_STRINGS = 16
# The stop matcher compares a held-back tail against each stop string's prefixes on every token:
# the cap keeps that work per token small.
MAX_STOP_STRING_CHARS = 256
# OpenAI's ranges: completions' `logprobs` up to 5, chat's `top_logprobs` up to 20.
COMPLETIONS_LOGPROBS_MAX = 5
CHAT_TOP_LOGPROBS_MAX = 20
# How many alternatives per token the executor returns besides the sampled token: none yet. When it
# does, raise this and fill SampledToken.top in tp_runtime.http.generation.
TOP_LOGPROBS_SUPPORTED = 0


@dataclass(frozen=True)
class Limits:
    """What validation needs to know about the model and the server."""

    vocab_size: int
    max_model_len: int
    max_prompt_chars: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to submit."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]


# ---- the body's own fields ---------------------------------------------------------------------


def check_sampling(sampling: SamplingRequest, vocab_size: int) -> None:
    p = sampling.param
    t = sampling.temperature
    if not (t == 0 or (math.isfinite(t) and TEMPERATURE_MIN <= t <= sampling.temperature_max)):
        raise invalid_request(
            f"'{p('temperature')}' must be 0 (greedy) or in [{TEMPERATURE_MIN}, {sampling.temperature_max:g}], "
            f"got {t!r}",
            param=p("temperature"),
        )
    if not TOP_P_MIN <= sampling.top_p <= 1.0:
        raise invalid_request(
            f"'{p('top_p')}' must be in [{TOP_P_MIN}, 1], got {sampling.top_p!r}", param=p("top_p")
        )
    if not -1 <= sampling.top_k <= TOP_K_MAX:
        raise invalid_request(
            f"'{p('top_k')}' must be -1 or 0 (off) or a number of tokens up to {TOP_K_MAX}, got {sampling.top_k}",
            param=p("top_k"),
        )
    if sampling.seed is not None and not 0 <= sampling.seed <= SEED_MAX:
        raise invalid_request(f"'{p('seed')}' must be in [0, {SEED_MAX}], got {sampling.seed}", param=p("seed"))
    if sampling.max_tokens is not None and sampling.max_tokens < 1:
        raise invalid_request(
            f"'{p('max_tokens')}' must be at least 1, got {sampling.max_tokens}", param=p("max_tokens")
        )
    check_stops(sampling.stop, p("stop"))
    check_token_ids(sampling.stop_token_ids, vocab_size, p("stop_token_ids"))


def check_stops(stops: Sequence[str], param: str) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_request(f"'{param}' takes up to {MAX_STOP_STRINGS} strings, got {len(stops)}", param=param)
    for stop in stops:
        if not 1 <= len(stop) <= MAX_STOP_STRING_CHARS:
            raise invalid_request(
                f"'{param}' takes up to {MAX_STOP_STRINGS} non-empty strings of up to {MAX_STOP_STRING_CHARS} "
                "characters",
                param=param,
            )
        check_text(stop, param)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    for token in ids:
        if not 0 <= token < vocab_size:
            message = f"token id {token} in '{param}' is outside the vocabulary [0, {vocab_size})"
            raise invalid_request(message, param=param)


def check_text(text: str, param: str) -> None:
    """Text the tokenizer can take: Unicode that UTF-8 can encode (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_request(
            f"'{param}' holds {exc.object[exc.start:exc.end]!a} at character {exc.start}, which is not text "
            "(a lone UTF-16 surrogate)",
            param=param,
        ) from None


def check_prompt_chars(chars: int, limits: Limits, param: str) -> None:
    """Refuses, before tokenizing, a prompt too long to fit in the context whatever its tokens."""
    if chars > limits.max_prompt_chars:
        raise context_too_long(
            f"the prompt is {chars} characters long; this server takes up to {limits.max_prompt_chars} "
            f"(--max-prompt-chars; a context of {limits.max_model_len} tokens): shorten the prompt",
            param=param,
        )


def check_model(name: str | None, served: Sequence[str]) -> None:
    if name is not None and name not in served:
        raise model_not_found(name, served[0])


def _neutral(value: object, *accepted: object) -> bool:
    """None, or one of `accepted` (a number equal to a numeric one; True is not 1 here)."""
    if value is None:
        return True
    for neutral in accepted:
        if isinstance(value, bool) or isinstance(neutral, bool):
            if value is neutral:
                return True
        elif isinstance(neutral, int | float):
            if isinstance(value, int | float) and value == neutral:
                return True
        elif type(value) is type(neutral) and value == neutral:
            return True
    return False


_PENALTIES = "penalties are not applied by the sampler yet"
_TOOLS = "is not supported: this server does not call tools"
# field -> (neutral values, why any other is refused)
_UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "n": ((1,), "must be 1: one choice per request"),
    "best_of": ((1,), "must be 1: one choice per request"),
    "presence_penalty": ((0,), f"must be 0: {_PENALTIES}"),
    "frequency_penalty": ((0,), f"must be 0: {_PENALTIES}"),
    "repetition_penalty": ((1,), f"must be 1: {_PENALTIES}"),
    "min_tokens": ((0,), "must be 0: a minimum length is not enforced yet"),
    "min_p": ((0,), "must be 0: min-p sampling is not supported"),
    "logit_bias": (({},), "is not supported: the sampler applies no logit bias yet"),
    "response_format": (({"type": "text"},), "is not supported: output is not constrained to a format"),
    "tools": (([],), _TOOLS),
    "tool_choice": (("none",), _TOOLS),
    "functions": (([],), _TOOLS),
    "function_call": (("none",), _TOOLS),
    "parallel_tool_calls": ((True, False), "must be a boolean"),
    "echo": ((False,), "is not supported: the prompt is not returned"),
    "suffix": (("",), "is not supported: no text is inserted after the completion"),
}


def refuse_unsupported(body: OpenAISampling) -> None:
    for name, (accepted, reason) in _UNSUPPORTED.items():
        if name in type(body).model_fields and not _neutral(getattr(body, name), *accepted):
            raise unsupported(name, reason)


def completion_logprobs(body: CompletionRequest) -> bool:
    """Whether to return logprobs; alternatives beyond the sampled token are refused for now."""
    if body.logprobs is None:
        return False
    if not 0 <= body.logprobs <= COMPLETIONS_LOGPROBS_MAX:
        message = f"'logprobs' must be in [0, {COMPLETIONS_LOGPROBS_MAX}], got {body.logprobs}"
        raise invalid_request(message, param="logprobs")
    _check_alternatives("logprobs", body.logprobs)
    return True


def chat_logprobs(body: ChatCompletionRequest) -> bool:
    top = body.top_logprobs
    if top is not None:
        if not 0 <= top <= CHAT_TOP_LOGPROBS_MAX:
            message = f"'top_logprobs' must be in [0, {CHAT_TOP_LOGPROBS_MAX}], got {top}"
            raise invalid_request(message, param="top_logprobs")
        if top and not body.logprobs:
            raise invalid_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        _check_alternatives("top_logprobs", top)
    return body.logprobs


def _check_alternatives(param: str, wanted: int) -> None:
    if wanted > TOP_LOGPROBS_SUPPORTED:
        raise unsupported(
            param,
            f"asks for {wanted} alternatives per token; the executor returns only the sampled token's "
            f"log-probability yet: send {TOP_LOGPROBS_SUPPORTED}",
        )


# ---- after tokenizing --------------------------------------------------------------------------


def prepare(prompt_token_ids: list[int], sampling: SamplingRequest, limits: Limits, prompt_param: str) -> Prepared:
    """The prompt's length against the context, its ids against the vocabulary, and the engine's
    SamplingParams. check_sampling must have passed."""
    limit = limits.max_model_len
    prompt_len = len(prompt_token_ids)
    if prompt_len == 0:
        raise invalid_request("the prompt is empty: it must hold at least one token", param=prompt_param)
    if prompt_len >= limit:
        raise context_too_long(
            f"the prompt is {prompt_len} tokens long, and this model's context is {limit} tokens: shorten the prompt",
            param=prompt_param,
        )
    check_token_ids(prompt_token_ids, limits.vocab_size, prompt_param)
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        max_tokens = limit - prompt_len
    elif prompt_len + max_tokens > limit:
        param = sampling.param("max_tokens")
        raise context_too_long(
            f"this model's context is {limit} tokens, but {prompt_len + max_tokens} were requested "
            f"({prompt_len} in the prompt, {max_tokens} to generate): lower the max tokens ('{param}')",
            param=param,
        )
    ends = sampling.stop_token_ids + (() if sampling.ignore_eos else limits.eos_token_ids)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),  # -1 means "off" in vLLM's API, 0 here
            seed=sampling.seed,
            stop_token_ids=tuple(dict.fromkeys(ends)),
            ignore_eos=sampling.ignore_eos,
        )
    except InvalidSamplingParams as exc:  # check_sampling covers these ranges; this is its backstop
        raise invalid_request(str(exc)) from exc
    return Prepared(list(prompt_token_ids), params, sampling.stop)
