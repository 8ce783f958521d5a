"""A minimal executor peer for the multi-process tests and the benchmark: the step protocol only,
no model. Runs in a spawned process, so it imports nothing heavy."""

from __future__ import annotations

import sys

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import (
    LAYOUT_VERSION,
    SUPPORTED_VERSIONS,
    Abort,
    CacheGeometry,
    Done,
    Go,
    Hello,
    Prepare,
    Ready,
    Reject,
    Shutdown,
    Welcome,
)
from protocol.transport import ExecutorEndpoint
from protocol.validate import check_envelope, check_geometry, validate_prepare

IDLE_TIMEOUT_MS = 20_000


def run_executor(address: str, key: bytes, run_id: str, rank: int, world_size: int, geometry: CacheGeometry) -> None:
    """HELLO, then PREPARE -> READY | REJECT, GO -> DONE, ABORT drops the step, SHUTDOWN exits.

    Exits non-zero if the scheduler goes quiet or sends something out of order, so the parent test
    sees it in the exit code.
    """
    with ExecutorEndpoint(address, key, run_id, rank) as endpoint:
        endpoint.send(Hello(rank, world_size, SUPPORTED_VERSIONS, LAYOUT_VERSION, "wire-peer", geometry), step=0)
        last_step = 0
        staged: int | None = None
        while True:
            try:
                frame = endpoint.recv(IDLE_TIMEOUT_MS)
            except ProtocolError as exc:
                endpoint.send(Reject(rank, int(exc.code), exc.message), step=last_step)
                continue
            if frame is None:
                sys.exit(f"rank {rank}: the scheduler went quiet")
            body = frame.body
            if isinstance(body, Welcome):
                check_geometry(geometry, body.geometry, who="WELCOME")
                endpoint.version = body.version
            elif isinstance(body, Prepare):
                try:
                    check_envelope(
                        frame, version=endpoint.version, layout=LAYOUT_VERSION, run_id=run_id, expected_step=last_step + 1
                    )
                    last_step = frame.step
                    validate_prepare(body, geometry)
                except ProtocolError as exc:
                    endpoint.send(Reject(rank, int(exc.code), exc.message), step=frame.step)
                    continue
                staged = frame.step
                endpoint.send(Ready(rank), step=frame.step)
            elif isinstance(body, Go):
                if staged != frame.step:
                    endpoint.send(
                        Reject(rank, int(RejectCode.UNEXPECTED_FRAME), f"GO for step {frame.step}, staged {staged}"),
                        step=frame.step,
                    )
                    continue
                staged = None
                endpoint.send(Done(rank), step=frame.step)
            elif isinstance(body, Abort):
                staged = None
            elif isinstance(body, Shutdown):
                return
