"""Request validation at the edge, as plain functions: every field against what the wire and the
sampler carry (protocol/sampling_limits.py), so that no request can reach the engine with a value
that would fail a step it shares with others. Each failure is an ApiError (400) naming the field.

The order a route calls them in: the body's own fields (check_sampling, refuse_unsupported,
check_text, check_prompt_chars) before any tokenizing, then `prepare` on the token ids.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.sampling_limits import (
    FLOAT32_MAX,
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MAX_ENTRIES,
    LOGIT_BIAS_MIN,
    PENALTY_MAX,
    PENALTY_MIN,
    REPETITION_PENALTY_MIN,
    SEED_MAX,
    TEMPERATURE_MIN,
    TOP_K_MAX,
    TOP_LOGPROBS_MAX,
    TOP_P_MIN,
)
from scheduler.request import InvalidSamplingParams, SamplingParams
from tp_runtime.http.api_models import (
    IGNORED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISampling,
    SamplingRequest,
)
from tp_runtime.http.errors import context_too_long, invalid_request, model_not_found, unsupported

log = logging.getLogger("tp_runtime.http")

MAX_STOP_STRINGS = 16
# The stop matcher compares a held-back tail against each stop string's prefixes on every token:
# the cap keeps that work per token small.
MAX_STOP_STRING_CHARS = 256
# OpenAI's limit on choices per request.
MAX_N = 128


@dataclass(frozen=True)
class Limits:
    """What validation needs to know about the model and the server."""

    vocab_size: int
    max_model_len: int
    max_prompt_chars: int
    eos_token_ids: tuple[int, ...]
    max_logprobs: int = TOP_LOGPROBS_MAX


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to submit: n samples of one prompt."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    n: int = 1


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
    check_processing(sampling)
    check_min_p(sampling)
    logit_bias(sampling, vocab_size)
    if not 1 <= sampling.n <= MAX_N:
        raise invalid_request(f"'{p('n')}' must be in [1, {MAX_N}], got {sampling.n}", param=p("n"))


def check_processing(sampling: SamplingRequest) -> None:
    """Penalties, min_tokens and alternatives against protocol/sampling_limits.py."""
    p = sampling.param
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not PENALTY_MIN <= value <= PENALTY_MAX:
            message = f"'{p(name)}' must be in [{PENALTY_MIN:g}, {PENALTY_MAX:g}], got {value!r}"
            raise invalid_request(message, param=p(name))
    repetition = sampling.repetition_penalty
    if not REPETITION_PENALTY_MIN <= repetition <= FLOAT32_MAX:
        raise invalid_request(
            f"'{p('repetition_penalty')}' must be above 0 (1 is off; from {REPETITION_PENALTY_MIN}: a smaller one "
            f"overflows the logits it divides), got {repetition!r}",
            param=p("repetition_penalty"),
        )
    if sampling.min_tokens < 0:
        message = f"'{p('min_tokens')}' must be at least 0, got {sampling.min_tokens}"
        raise invalid_request(message, param=p("min_tokens"))
    if sampling.max_tokens is not None and sampling.min_tokens > sampling.max_tokens:
        raise invalid_request(
            f"'{p('min_tokens')}' ({sampling.min_tokens}) must not exceed '{p('max_tokens')}' ({sampling.max_tokens})",
            param=p("min_tokens"),
        )
    if not 0 <= sampling.top_logprobs <= TOP_LOGPROBS_MAX:
        param = p(sampling.top_logprobs_field)
        raise invalid_request(f"'{param}' must be in [0, {TOP_LOGPROBS_MAX}], got {sampling.top_logprobs}", param=param)


def logit_bias(sampling: SamplingRequest, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The body's logit_bias ({"token id": bias}) as (id, bias) pairs, ids ascending."""
    bias = sampling.logit_bias
    if not bias:
        return ()
    param = sampling.param("logit_bias")
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise invalid_request(f"'{param}' takes up to {LOGIT_BIAS_MAX_ENTRIES} tokens, got {len(bias)}", param=param)
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise invalid_request(
                f"'{param}' maps token ids to biases: {key!r} is not a token id in [0, {vocab_size})", param=param
            )
        if token in pairs:
            raise invalid_request(f"'{param}' names token {token} twice ({key!r})", param=param)
        if not LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX:
            raise invalid_request(
                f"'{param}' biases must be in [{LOGIT_BIAS_MIN:g}, {LOGIT_BIAS_MAX:g}]: token {token} has {value!r}",
                param=param,
            )
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


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


# field -> (neutral values, why any other is refused)
_UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "functions": (([],), "is OpenAI's deprecated form of tools: send 'tools' instead"),
    "function_call": (("none",), "is OpenAI's deprecated form of tool_choice: send 'tool_choice' instead"),
    "echo": ((False,), "is not supported: the prompt is not returned"),
    "suffix": (("",), "is not supported: no text is inserted after the completion"),
}
_logged_ignored: set[str] = set()


def refuse_unsupported(body: OpenAISampling) -> None:
    for name, (accepted, reason) in _UNSUPPORTED.items():
        if name in type(body).model_fields and not _neutral(getattr(body, name), *accepted):
            raise unsupported(name, reason)


def ignored_fields(body: OpenAISampling) -> list[str]:
    """The IGNORED_FIELDS the body set (parallel_tool_calls among them when it sends no tools); each
    is logged the first time a body sets it, as vLLM logs the fields it ignores."""
    names = [name for name in IGNORED_FIELDS if getattr(body, name) is not None]
    if getattr(body, "parallel_tool_calls", None) is not None and not getattr(body, "tools", None):
        names.append("parallel_tool_calls")
    for name in names:
        if name not in _logged_ignored:
            _logged_ignored.add(name)
            log.warning("the request field %r is accepted and changes nothing here (logged once)", name)
    return names


def check_min_p(sampling: SamplingRequest) -> None:
    if not 0.0 <= sampling.min_p <= 1.0:
        param = sampling.param("min_p")
        raise invalid_request(f"'{param}' must be in [0, 1] (0: off), got {sampling.min_p!r}", param=param)


def check_max_logprobs(sampling: SamplingRequest, max_logprobs: int) -> None:
    if sampling.top_logprobs > max_logprobs:
        param = sampling.param(sampling.top_logprobs_field)
        raise invalid_request(
            f"'{param}' asks for {sampling.top_logprobs} alternatives; this server returns up to {max_logprobs} "
            "(--max-logprobs)",
            param=param,
        )


def check_best_of(body: CompletionRequest) -> None:
    """best_of is taken when it is n (or unset): the n samples are then the answer. Ranking more
    samples than are returned would need every sample's summed logprob and is not done."""
    if body.best_of is not None and body.best_of != body.n:
        raise unsupported(
            "best_of",
            f"must equal n ({body.n}) or be left out, got {body.best_of}: returning the best n of more samples "
            "is not supported; ask for n choices instead",
        )


def completion_logprobs(body: CompletionRequest) -> tuple[bool, int]:
    """Whether to return logprobs, and how many alternatives per token (completions' `logprobs: k`)."""
    if body.logprobs is None:
        return False, 0
    return True, body.logprobs


def chat_logprobs(body: ChatCompletionRequest) -> tuple[bool, int]:
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise invalid_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return body.logprobs, top


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
    if sampling.min_tokens > max_tokens:
        param = sampling.param("min_tokens")
        raise invalid_request(
            f"'{param}' ({sampling.min_tokens}) must not exceed the {max_tokens} tokens left to generate", param=param
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
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            min_tokens=sampling.min_tokens,
            logit_bias=logit_bias(sampling, limits.vocab_size),
            top_logprobs=sampling.top_logprobs,
            min_p=sampling.min_p,
            grammar=sampling.grammar,
        )
    except InvalidSamplingParams as exc:  # check_sampling covers these ranges; this is its backstop
        raise invalid_request(str(exc)) from exc
    return Prepared(list(prompt_token_ids), params, sampling.stop, sampling.n)


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of the index-th of n samples: vLLM's seed + index, wrapped into [0, 2**63) so that any
    valid seed works; sample 0 keeps the request's seed, so n = 1 is unchanged."""
    return None if seed is None else (seed + index) % (SEED_MAX + 1)
