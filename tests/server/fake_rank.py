"""The real Engine, with one fake rank 0 on its socket: the step protocol without a model.

The rank answers every PREPARE (or CONTINUE, expanded after the PREPARE before) with READY and
every GO with a RESULT that samples `token` for each sampled row in each of the step's forwards
(logprob -1), `step_delay_s` per forward after the step starts (or after the step before it ends);
a CUT ends the step at the end of the forward running. It answers heartbeats, also while a step
runs.
As the engine's WELCOME tells a group of one rank (ready_is_go), it runs each step right after its
READY: no GO comes, and the READY for a step that arrives while another runs rides in that one's
RESULT. It lets the tests drive the engine loop, its published stats and its bounds, in one process
and in milliseconds.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from protocol.auth import new_key
from protocol.continuation import expand
from protocol.frames import (
    LAYOUT_VERSION,
    SUPPORTED_VERSIONS,
    Abort,
    CacheGeometry,
    Continue,
    Cut,
    Go,
    Heartbeat,
    Hello,
    Prepare,
    Ready,
    Result,
    Shutdown,
    Welcome,
)
from protocol.transport import ExecutorEndpoint, SchedulerEndpoint, ipc_address
from scheduler.scheduler import Scheduler, SchedulerConfig
from tp_runtime.engine import Engine, EngineTimeouts

MAX_MODEL_LEN = 256
GEOMETRY = CacheGeometry(
    num_kv_pages=64, page_size=16, num_layers=2, num_kv_heads=3, head_dim=8, kv_dtype="fp32",
    vocab_size=49152, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=256,
)


class FakeRank(threading.Thread):
    def __init__(self, address: str, key: bytes, run_id: str, token: int, step_delay_s: float):
        super().__init__(name="fake-rank-0", daemon=True)
        self._peer = ExecutorEndpoint(address, key, run_id, 0)
        self._token = token
        self._delay = step_delay_s
        self._prepared: Prepare | None = None
        self._ready_is_go = False
        # Steps GOed here, oldest first, each finishing step_delay_s after the one before: as a real
        # rank, this one reads frames while a step runs, and a lone rank's READY for a step that
        # arrives meanwhile rides in the running step's RESULT (Result.ready_next).
        self._running: deque[tuple[int, Prepare]] = deque()
        self._due: float | None = None  # when the oldest running step finishes
        self._cut: tuple[int, int] | None = None  # (step, forwards it runs): the oldest running step was cut
        self._riding: int | None = None
        self.steps = 0
        self.vanish = threading.Event()  # set: the rank closes its socket at its next frame, as a killed process would

    def run(self) -> None:
        peer = self._peer
        try:
            peer.send(Hello(0, 1, SUPPORTED_VERSIONS, LAYOUT_VERSION, "fake", GEOMETRY), 0)
            while True:
                now = time.monotonic()
                if self._due is not None and now >= self._due:
                    self._finish(*self._running.popleft())
                    self._due = time.monotonic() + self._duration(self._running[0][1]) if self._running else None
                    continue
                wait_ms = 20_000 if self._due is None else int((self._due - now) * 1000)
                if wait_ms == 0:  # the poll's whole milliseconds would overshoot the step's end
                    time.sleep(self._due - now)
                    continue
                frame = peer.recv(wait_ms)
                if frame is None:
                    if self._due is None:
                        return
                    continue
                if self.vanish.is_set():
                    return
                body = frame.body
                if isinstance(body, Shutdown):
                    return
                if isinstance(body, Heartbeat):
                    peer.send(Heartbeat(0), 0)
                elif isinstance(body, Welcome):
                    self._ready_is_go = body.ready_is_go
                elif isinstance(body, Abort):
                    self._prepared = None
                elif isinstance(body, (Prepare, Continue)):
                    self._prepared = body if isinstance(body, Prepare) else expand(self._prepared, body)
                    if self._ready_is_go and self._running and self._running[-1][0] == frame.step - 1:
                        self._riding = frame.step
                    else:
                        peer.send(Ready(0), frame.step)
                    if self._ready_is_go:
                        self._start(frame.step)
                elif isinstance(body, Go) and self._prepared is not None:
                    self._start(frame.step)
                elif isinstance(body, Cut) and self._running and self._running[0][0] == frame.step:
                    self._cut_oldest()
        finally:
            peer.close()

    def _start(self, step: int) -> None:
        self._running.append((step, self._prepared))
        if self._due is None:
            self._due = time.monotonic() + self._duration(self._prepared)

    def _duration(self, prepared: Prepare) -> float:
        return self._delay * prepared.decode_steps

    def _cut_oldest(self) -> None:
        """The oldest running step ends with the forward running now."""
        step, prepared = self._running[0]
        started = self._due - self._duration(prepared)
        ran = min(prepared.decode_steps, max(1, math.ceil((time.monotonic() - started) / self._delay))) if self._delay else 1
        self._cut = (step, ran)
        self._due = started + ran * self._delay

    def _finish(self, step: int, prepared: Prepare) -> None:
        rides = self._riding == step + 1
        if rides:
            self._riding = None
        self.steps += 1
        forwards = self._cut[1] if self._cut is not None and self._cut[0] == step else prepared.decode_steps
        self._peer.send(fake_result(prepared, self._token, ready_next=rides, forwards=forwards), step)


def fake_result(prepared: Prepare, token: int, ready_next: bool = False, forwards: int | None = None) -> Result:
    """The RESULT of a step: `token` for each sampled row in each of its forwards (all of them, or
    `forwards` when it was cut), logprob -1."""
    rows = prepared.seq_ids[prepared.sample.astype(bool)]
    n = len(rows) * (prepared.decode_steps if forwards is None else forwards)
    return Result(
        rows.astype(np.int64), np.full(n, token, np.int32), np.full(n, -1.0, np.float32), np.ones(n, np.uint8),
        ready_next=ready_next,
    )


def fake_scheduler(max_inflight_steps: int = 1, num_scheduler_steps: int = 1) -> Scheduler:
    """A scheduler planning for the fake rank's geometry; max_inflight_steps 2 plans each step while
    the one before runs, as the server does by default; num_scheduler_steps as --num-scheduler-steps."""
    return Scheduler(
        SchedulerConfig(
            num_kv_pages=GEOMETRY.num_kv_pages, page_size=GEOMETRY.page_size, max_num_seqs=GEOMETRY.max_num_seqs,
            max_num_batched_tokens=GEOMETRY.max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
            max_inflight_steps=max_inflight_steps, num_scheduler_steps=num_scheduler_steps,
        )
    )


@contextmanager
def running_engine(
    *, token: int = 7, step_delay_s: float = 0.0, max_num_queued_reqs: int = 0, max_inflight_steps: int = 1,
    num_scheduler_steps: int = 1,
) -> Iterator[Engine]:
    """An Engine whose loop runs against a FakeRank; shut down and joined afterwards."""
    key, run_id = new_key(), "fake-rank-run"
    endpoint = SchedulerEndpoint(ipc_address(), key, run_id)
    scheduler = fake_scheduler(max_inflight_steps, num_scheduler_steps)
    engine = Engine(
        scheduler=scheduler, endpoint=endpoint, world_size=1, model_name="fake", max_model_len=MAX_MODEL_LEN,
        timeouts=EngineTimeouts(handshake_s=20), max_num_queued_reqs=max_num_queued_reqs,
    )
    rank = FakeRank(endpoint.address, key, run_id, token, step_delay_s)
    rank.start()
    engine.start()
    try:
        engine.wait_ready(20)
        yield engine
    finally:
        engine.shutdown("test over")
        rank.join(timeout=20)
        endpoint.close()
