"""What the scheduler's conversation reports: the handshake's outcome, each step's answers and end,
and what a rank did wrong."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import RejectCode
from protocol.frames import CacheGeometry, Hello, Result


@dataclass(frozen=True)
class HandshakeComplete:
    """Every rank said HELLO and they agree: call welcome() and send it to every rank."""

    version: int
    geometry: CacheGeometry
    hellos: tuple[Hello, ...]  # by rank


@dataclass(frozen=True)
class HandshakeRefused:
    """A rank cannot join this launch; the message names it and its host. Send shutdown()."""

    rank: int
    host: str
    code: RejectCode
    message: str


@dataclass(frozen=True)
class StepReady:
    """Every rank answered READY for `step`: go(step) may be sent."""

    step: int


@dataclass(frozen=True)
class Rejection:
    rank: int
    host: str
    code: RejectCode
    message: str
    seq_ids: tuple[int, ...]  # empty: the whole frame was refused


@dataclass(frozen=True)
class StepRefused:
    """Every rank answered `step` and at least one refused it: abort(step) is the only way on."""

    step: int
    rejections: tuple[Rejection, ...]

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """The sequences to fail when every refusal named its sequences (the rest of the step may
        be planned again at once); empty when some rank refused the whole frame."""
        if any(not r.seq_ids for r in self.rejections):
            return ()
        return tuple(sorted({s for r in self.rejections for s in r.seq_ids}))

    @property
    def message(self) -> str:
        return "; ".join(
            f"rank {r.rank} on host {r.host} rejected step {self.step}: {r.code.name}: {r.message}"
            for r in self.rejections
        )


@dataclass(frozen=True)
class StepDone:
    """Rank 0's RESULT and every other rank's DONE for `step` are in. Steps finish in order."""

    step: int
    result: Result
    next_ready: bool = False  # the RESULT also said READY for step + 1 (Result.ready_next)


@dataclass(frozen=True)
class StepFailed:
    """A rank refused a step after GO (its forward failed, or GO was not valid there): the other
    ranks may be inside a collective, so the group cannot go on."""

    step: int
    rank: int
    host: str
    code: RejectCode
    message: str


@dataclass(frozen=True)
class RankShutdown:
    rank: int
    host: str
    reason: str


@dataclass(frozen=True)
class ProtocolViolation:
    """A launched rank sent a frame that is undecodable, stamped wrong, or not valid now. `step` is
    the frame's step (None when it did not decode)."""

    rank: int
    host: str
    step: int | None
    code: RejectCode
    message: str


SchedulerEvent = (
    HandshakeComplete | HandshakeRefused | StepReady | StepRefused | StepDone | StepFailed | RankShutdown | ProtocolViolation
)
