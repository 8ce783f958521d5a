"""Requests as the scheduler sees them: sampling parameters, token stream, lifecycle state."""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from protocol.errors import TPRuntimeError
from protocol.grammar import GRAMMAR_MAX_BYTES, GrammarSpec
from protocol.sampling_limits import (
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MAX_ENTRIES,
    LOGIT_BIAS_MIN,
    PENALTY_MAX,
    PENALTY_MIN,
    REPETITION_PENALTY_MIN,
    TOP_LOGPROBS_MAX,
)


class InvalidSamplingParams(TPRuntimeError, ValueError):
    """A SamplingParams field is out of its range."""


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling choices. The penalties follow vLLM: presence and frequency count the
    output tokens, repetition the prompt's and the output's; min_tokens holds the stop tokens (eos
    unless ignored, and stop_token_ids) back until that many tokens were generated; logit_bias is
    (token id, bias) pairs, ids ascending; top_logprobs is how many alternatives come back with
    each sampled token. min_p drops the tokens less likely than min_p times the most likely one;
    grammar constrains the output to it (rank 0's executor masks every sampled row)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0
    min_p: float = 0.0
    grammar: GrammarSpec | None = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def stateful(self) -> bool:
        """Whether the executors must hold a sampling state for it (a penalty or a logit bias)."""
        return self.penalized or bool(self.logit_bias) or self.grammar is not None

    @functools.cached_property
    def grammar_bytes(self) -> bytes:
        return b"" if self.grammar is None else self.grammar.encode()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParams(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidSamplingParams(f"top_k must be >= 0 (0 is off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidSamplingParams(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_MIN <= getattr(self, name) <= PENALTY_MAX:
                raise InvalidSamplingParams(
                    f"{name} must be in [{PENALTY_MIN:g}, {PENALTY_MAX:g}], got {getattr(self, name)}"
                )
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty >= REPETITION_PENALTY_MIN):
            raise InvalidSamplingParams(
                f"repetition_penalty must be finite and >= {REPETITION_PENALTY_MIN}, got {self.repetition_penalty}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParams(
                f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}"
            )
        if len(self.logit_bias) > LOGIT_BIAS_MAX_ENTRIES:
            raise InvalidSamplingParams(
                f"logit_bias takes up to {LOGIT_BIAS_MAX_ENTRIES} tokens, got {len(self.logit_bias)}"
            )
        previous = -1
        for token, bias in self.logit_bias:
            if token <= previous:
                raise InvalidSamplingParams("logit_bias must list each token id once, in increasing order")
            if not LOGIT_BIAS_MIN <= bias <= LOGIT_BIAS_MAX:
                raise InvalidSamplingParams(
                    f"logit_bias of token {token} must be in [{LOGIT_BIAS_MIN:g}, {LOGIT_BIAS_MAX:g}], got {bias}"
                )
            previous = token
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        if len(self.grammar_bytes) > GRAMMAR_MAX_BYTES:
            raise InvalidSamplingParams(
                f"the grammar takes {len(self.grammar_bytes)} bytes; at most {GRAMMAR_MAX_BYTES} travel with a request"
            )
        if not 0 <= self.top_logprobs <= TOP_LOGPROBS_MAX:
            raise InvalidSamplingParams(f"top_logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {self.top_logprobs}")


class RequestState(enum.Enum):
    WAITING = "waiting"  # never run, or preempted by recompute (its KV is gone)
    RUNNING = "running"  # holds a live row of the running batch and pages in the pool
    OFFLOADED = "preempted-offloaded"  # its KV pages sit in host slots until a restore
    FINISHED = "finished"


@dataclass(frozen=True)
class HostCopy:
    """Where an offloaded request's KV waits: one host slot per page, in page-table order, holding
    the KV of its first num_computed tokens."""

    slots: tuple[int, ...]
    num_computed: int


@dataclass(eq=False)
class Request:
    """One request's token stream, its prefix keys and where its KV lives.

    `tokens` is preallocated to the longest the request can get (prompt + max_tokens), so appending a
    sampled token is one array store and a page's tokens are a view. While the request holds a row
    of the running batch, that row is the one place of its counters (tokens known, tokens computed,
    samples in flight) and `num_tokens` is None; the row hands the count back when it is released.
    """

    request_id: int
    params: SamplingParams
    arrival: int
    tokens: np.ndarray  # int32[prompt_len + max_tokens]
    prompt_len: int
    stop_ids: frozenset[int]  # sampled tokens that end it: eos (unless ignored) and its stop ids
    limit: int  # tokens at which it ends by length: prompt_len + max_tokens
    num_tokens: int | None  # tokens known (prompt + sampled) while it holds no row
    state: RequestState = RequestState.WAITING
    row: int = -1  # its row in the running batch, live or held for a step in flight
    host: HostCopy | None = None  # OFFLOADED: its KV in host slots
    preempted: bool = False  # has been preempted at least once
    num_registered: int = 0  # full pages already offered to the prefix cache
    page_keys: list[tuple[int, int]] = field(default_factory=list)  # prefix keys of full pages
    hash_state: tuple[int, int] = (0, 0)  # running sums after the last keyed page
    leader: Request | None = None  # the request whose prompt pages this one waits to share
    kv_suspect: bool = False  # its logits were not finite: none of its KV is shared

    @classmethod
    def create(
        cls, request_id: int, prompt: Sequence[int] | np.ndarray, params: SamplingParams, arrival: int,
        eos: frozenset[int] = frozenset(),
    ) -> Request:
        prompt_arr = token_array(prompt)
        n = prompt_arr.shape[0]
        tokens = np.empty(n + params.max_tokens, dtype=np.int32)
        tokens[:n] = prompt_arr
        stop_ids = frozenset(params.stop_token_ids) if params.ignore_eos else eos.union(params.stop_token_ids)
        return cls(request_id, params, arrival, tokens, n, stop_ids, n + params.max_tokens, n)

    def max_kv_len(self) -> int:
        return max_kv_len(self.prompt_len, self.params.max_tokens)

    @functools.cached_property
    def stop_array(self) -> np.ndarray:
        """stop_ids, ascending: what its samples may not be before min_tokens."""
        return np.array(sorted(self.stop_ids), dtype=np.int32)

    @functools.cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Its logit bias as (token ids, biases)."""
        bias = self.params.logit_bias
        return np.array([t for t, _ in bias], dtype=np.int32), np.array([b for _, b in bias], dtype=np.float32)


Alternatives = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(slots=True)
class RequestOutput:
    """What one request produced at one step: the new tokens (a delta, stop tokens included), and
    with each one the alternatives it asked for (top_logprobs: one entry per token, or empty). The
    engine hands it to the request's stream as it is. Not frozen: made for every token of every
    stream, a frozen dataclass's construction (0.79 us warm) was five times a plain one's."""

    request_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool
    finish_reason: str | None  # "length", "stop", "cancelled", "error"
    error: str | None = None
    top_logprobs: tuple[Alternatives, ...] = ()
    fault: str | None = None  # with an error: the label it is counted under (tp_runtime.recovery.Fault), set by the engine


def token_array(prompt: Sequence[int] | np.ndarray) -> np.ndarray:
    """A prompt as a flat int32 array: an int32 array as it is, anything else checked and narrowed.

    numpy's own conversion would truncate floats and wrap ids past int32's range without a word;
    those are refused here instead.
    """
    arr = np.asarray(prompt)
    if arr.ndim != 1:
        raise ValueError(f"a prompt is a flat sequence of token ids, got shape {arr.shape}")
    if arr.dtype == np.int32:
        return arr
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype} values")
    narrow = arr.astype(np.int32)
    if not np.array_equal(narrow, arr):
        raise ValueError("a token id is outside the 32-bit range")
    return narrow


def max_kv_len(prompt_len: int, max_tokens: int) -> int:
    """Positions that can ever hold KV: the last sampled token is never fed back."""
    return prompt_len + max_tokens - 1
