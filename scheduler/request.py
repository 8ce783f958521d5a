"""Requests as the scheduler sees them: sampling parameters, token stream, lifecycle state."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from protocol.errors import TPRuntimeError


class InvalidSamplingParams(TPRuntimeError, ValueError):
    """A SamplingParams field is out of its range."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

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


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced at one step: the new tokens (a delta, stop tokens included)."""

    request_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool
    finish_reason: str | None  # "length", "stop", "cancelled", "error"
    error: str | None = None


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
