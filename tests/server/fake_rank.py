"""The real Engine, with one fake rank 0 on its socket: the step protocol without a model.

The rank answers every PREPARE (or CONTINUE, expanded after the PREPARE before) with READY and every GO with a RESULT that samples `token` for each
sampled row (logprob -1), after `step_delay_s`; it answers heartbeats. As the engine's WELCOME tells
a group of one rank (ready_is_go), it runs each step right after its READY: no GO comes. It lets
the tests drive the engine loop, its published stats and its bounds, in one process and in
milliseconds.
"""

from __future__ import annotations

import threading
import time
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
        self.steps = 0
        self.vanish = threading.Event()  # set: the rank closes its socket at its next frame, as a killed process would

    def run(self) -> None:
        peer = self._peer
        try:
            peer.send(Hello(0, 1, SUPPORTED_VERSIONS, LAYOUT_VERSION, "fake", GEOMETRY), 0)
            while (frame := peer.recv(20_000)) is not None:
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
                    peer.send(Ready(0), frame.step)
                    if self._ready_is_go:
                        self._run(frame.step)
                elif isinstance(body, Go) and self._prepared is not None:
                    self._run(frame.step)
        finally:
            peer.close()

    def _run(self, step: int) -> None:
        time.sleep(self._delay)
        rows = self._prepared.seq_ids[self._prepared.sample.astype(bool)]
        n = len(rows)
        result = Result(
            rows.astype(np.int64), np.full(n, self._token, np.int32), np.full(n, -1.0, np.float32), np.ones(n, np.uint8)
        )
        self.steps += 1
        self._peer.send(result, step)


def fake_scheduler(max_inflight_steps: int = 1) -> Scheduler:
    """A scheduler planning for the fake rank's geometry; max_inflight_steps 2 plans each step while
    the one before runs, as the server does by default."""
    return Scheduler(
        SchedulerConfig(
            num_kv_pages=GEOMETRY.num_kv_pages, page_size=GEOMETRY.page_size, max_num_seqs=GEOMETRY.max_num_seqs,
            max_num_batched_tokens=GEOMETRY.max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
            max_inflight_steps=max_inflight_steps,
        )
    )


@contextmanager
def running_engine(
    *, token: int = 7, step_delay_s: float = 0.0, max_num_queued_reqs: int = 0, max_inflight_steps: int = 1
) -> Iterator[Engine]:
    """An Engine whose loop runs against a FakeRank; shut down and joined afterwards."""
    key, run_id = new_key(), "fake-rank-run"
    endpoint = SchedulerEndpoint(ipc_address(), key, run_id)
    scheduler = fake_scheduler(max_inflight_steps)
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
