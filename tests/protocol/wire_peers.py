"""A minimal executor peer for the multi-process tests and the benchmark: the conversation only, no
model (rank 0's RESULT samples token 0 for every sampled sequence). Runs in a spawned process or a
thread, so it imports nothing heavy."""

from __future__ import annotations

import sys
import time

import numpy as np

from protocol.conversation import (
    AbortReceived,
    ExecutorConversation,
    GoReceived,
    HandshakeComplete,
    PrepareReceived,
    Refused,
    SchedulerConversation,
    SchedulerEvent,
    ShutdownReceived,
    StepDone,
    StepReady,
    StepRefused,
    Welcomed,
    WelcomeRefused,
)
from protocol.curve import ClientCurve
from protocol.errors import ProtocolError
from protocol.frames import CacheGeometry, Prepare, Result
from protocol.transport import ExecutorEndpoint, SchedulerEndpoint

IDLE_TIMEOUT_MS = 20_000


def run_executor(
    address: str,
    key: bytes,
    run_id: str,
    rank: int,
    world_size: int,
    geometry: CacheGeometry,
    curve: ClientCurve | None = None,
) -> None:
    """HELLO, then PREPARE -> READY | REJECT, GO -> RESULT (rank 0) or DONE (with the WELCOME's
    ready_is_go, READY is followed by the RESULT at once), ABORT drops the step, SHUTDOWN exits.

    Exits non-zero if the scheduler goes quiet or its WELCOME is refused, so the parent test sees
    it in the exit code.
    """
    conv = ExecutorConversation(
        rank=rank, world_size=world_size, run_id=run_id, geometry=geometry, model_fingerprint="wire-peer"
    )
    with ExecutorEndpoint(address, key, run_id, rank, curve=curve) as endpoint:
        endpoint.send(*conv.hello())
        staged: dict[int, Prepare] = {}

        def finish(step: int) -> None:
            prepare = staged.pop(step)
            if rank == 0:
                endpoint.send(*conv.result(step, placeholder_result(prepare)))
            else:
                endpoint.send(*conv.done(step))

        while True:
            try:
                got = endpoint.recv(IDLE_TIMEOUT_MS)
            except ProtocolError as exc:
                got = exc
            if got is None:
                sys.exit(f"rank {rank}: the scheduler went quiet")
            for event in conv.receive(got):
                if isinstance(event, Welcomed):
                    endpoint.version = event.version
                elif isinstance(event, WelcomeRefused):
                    sys.exit(f"rank {rank}: {event.message}")
                elif isinstance(event, PrepareReceived):
                    staged[event.step] = event.prepare
                    endpoint.send(*conv.ready(event.step))
                    if conv.ready_is_go:
                        finish(event.step)
                elif isinstance(event, GoReceived):
                    finish(event.step)
                elif isinstance(event, Refused):
                    endpoint.send(*conv.reject(event.step, event.error))
                elif isinstance(event, ShutdownReceived):
                    return
                elif isinstance(event, AbortReceived):
                    staged.pop(event.step, None)


def placeholder_result(p: Prepare) -> Result:
    sampled = p.seq_ids[p.sample.astype(bool)]
    m = len(sampled)
    return Result(sampled, np.zeros(m, np.int32), np.zeros(m, np.float32), np.ones(m, np.uint8))


class SchedulerDriver:
    """The scheduler's side of the conversation over a real endpoint, for the tests and the
    benchmark: a handshake, then whole steps (PREPARE, READY or REJECT from all, GO or ABORT,
    RESULT and DONE). Anything else than what the step calls for raises RuntimeError."""

    def __init__(self, endpoint: SchedulerEndpoint, world_size: int, run_id: str, *, timeout_s: float = 20.0) -> None:
        self.endpoint = endpoint
        self.conv = SchedulerConversation(world_size=world_size, run_id=run_id)
        self.timeout_s = timeout_s

    def events(self) -> list[SchedulerEvent]:
        """The events of the next frame that yields any (heartbeats yield none)."""
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = self.endpoint.recv(int(left * 1000) + 1)
            if got is None:
                closed = self.endpoint.disconnected_ranks()
                if closed:
                    raise RuntimeError(f"the connection of ranks {closed} closed (in flight: {self.conv.in_flight})")
                break
            events = self.conv.receive(got.rank, got.frame if got.error is None else got.error, time.monotonic())
            if events:
                return events
        raise RuntimeError(f"nothing from the ranks within {self.timeout_s} s (in flight: {self.conv.in_flight})")

    def expect(self, *kinds: type) -> SchedulerEvent:
        events = self.events()
        if len(events) != 1 or not isinstance(events[0], kinds):
            raise RuntimeError(f"expected {' or '.join(k.__name__ for k in kinds)}, got {events}")
        return events[0]

    def handshake(self) -> HandshakeComplete:
        welcome = self.expect(HandshakeComplete)
        self.endpoint.version = self.conv.version
        self.endpoint.send_all(self.conv.ranks, *self.conv.welcome())
        return welcome

    def prepare(self, prepare: Prepare) -> int:
        step = self.conv.next_step
        self.endpoint.send_all(self.conv.ranks, *self.conv.prepare(step, prepare))
        return step

    def step(self, prepare: Prepare) -> StepDone | StepRefused:
        """One whole step; a refused step is aborted and returned as its StepRefused."""
        step = self.prepare(prepare)
        answer = self.expect(StepReady, StepRefused)
        if isinstance(answer, StepRefused):
            self.endpoint.send_all(self.conv.ranks, *self.conv.abort(step, answer.message))
            return answer
        self.endpoint.send_all(self.conv.ranks, *self.conv.go(step))
        return self.expect(StepDone)

    def shutdown(self, reason: str) -> None:
        self.endpoint.send_all(self.endpoint.ranks, *self.conv.shutdown(reason))
