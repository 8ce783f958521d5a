"""One rank's half of the conversation: HELLO, WELCOME, then the steps the scheduler sends."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from protocol.conversation.common import (
    Outgoing,
    Phase,
    check_handshake_envelope,
    not_valid_now,
)
from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import (
    LAYOUT_VERSION,
    SUPPORTED_VERSIONS,
    Abort,
    CacheGeometry,
    Continue,
    Cut,
    Done,
    Frame,
    Go,
    Heartbeat,
    Hello,
    Prepare,
    Ready,
    Reject,
    Result,
    Shutdown,
    Welcome,
)
from protocol.continuation import expand
from protocol.validate import check_envelope, check_geometry, validate_continued, validate_prepare

# ---- an executor's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class Welcomed:
    """WELCOME agreed with this rank: stamp every frame from now on with `version`."""

    version: int


@dataclass(frozen=True)
class WelcomeRefused:
    """WELCOME describes something this rank cannot run: it must exit."""

    message: str


@dataclass(frozen=True)
class PrepareReceived:
    """A PREPARE in sequence and valid against the geometry: answer ready(step) or reject(step, ...).
    A CONTINUE arrives as the PREPARE it stands for."""

    step: int
    prepare: Prepare


@dataclass(frozen=True)
class GoReceived:
    """Run the step; answer result(step, ...) on rank 0, done(step) elsewhere."""

    step: int


@dataclass(frozen=True)
class CutReceived:
    """The running step of several forwards ends after the forward running now (rank 0 decides)."""

    step: int


@dataclass(frozen=True)
class AbortReceived:
    """`step` is used up. `dropped`: it was staged here (READY sent or due) and is dropped. Either
    way the scheduler sends whole page tables next: forget the held ones."""

    step: int
    reason: str
    dropped: bool


@dataclass(frozen=True)
class ShutdownReceived:
    reason: str


@dataclass(frozen=True)
class Refused:
    """A frame this rank refuses: answer reject(step, error). `error.seq_ids` names the sequences
    at fault when only they are."""

    step: int
    error: ProtocolError


@dataclass(frozen=True)
class Ignored:
    """A frame dropped without an answer (before WELCOME there is nobody to answer); for the log."""

    reason: str


ExecutorEvent = (
    Welcomed | WelcomeRefused | PrepareReceived | GoReceived | CutReceived | AbortReceived | ShutdownReceived | Refused
    | Ignored
)


class ExecutorConversation:
    """One rank's half: HELLO, WELCOME, then steps.

    A PREPARE must carry last step + 1 and arrive while no other step waits for GO here (one may be
    running: the pipelined PREPARE for N+1 arrives while N runs); GO must be for the staged step, so
    GO N+1 always follows GO N; ABORT names a step and uses it up (dropping it if staged). RESULT or
    DONE go out in the order the steps were GOed. When the WELCOME says ready_is_go (a group of one
    rank), READY itself GOes the step: nothing is ever staged, and a GO is refused like any other
    GO with nothing staged. A CONTINUE is answered as the PREPARE it expands to, after the PREPARE
    this rank accepted for the step before; without one (none yet, or it was refused or aborted)
    it is refused with STEP_NOT_HELD. A CUT is for a running step; any other changes nothing.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        run_id: str,
        geometry: CacheGeometry,
        model_fingerprint: str,
        config_fingerprint: str = "",
        host: str = "",
        supported_versions: Iterable[int] = SUPPORTED_VERSIONS,
        layout: int = LAYOUT_VERSION,
    ) -> None:
        if not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.geometry = geometry
        self.supported_versions = tuple(supported_versions)
        self.layout = layout
        self._hello = Hello(
            rank, world_size, self.supported_versions, layout, model_fingerprint, geometry, config_fingerprint, host
        )
        self.phase = Phase.HANDSHAKE
        self.version: int | None = None
        self._hello_sent = False
        self.last_step = 0  # the highest step number used up
        self._pending: int | None = None  # PREPARE received, READY/REJECT not sent yet
        self._staged: int | None = None  # READY sent, waiting for GO or ABORT
        self._refused: int | None = None  # the last PREPARE this rank refused (its ABORT is expected)
        self._running: deque[int] = deque()  # GOed, RESULT/DONE not sent yet, oldest first
        self.ready_is_go = False  # the WELCOME's: a step runs once READY is sent, no GO comes
        self._held: tuple[int, Prepare] | None = None  # the last PREPARE accepted: what CONTINUE expands
        self._riding: int | None = None  # a step whose READY goes out in the RESULT of the one before

    @property
    def staged(self) -> int | None:
        """The step waiting for GO (or for this rank's answer)."""
        return self._pending if self._pending is not None else self._staged

    @property
    def running(self) -> tuple[int, ...]:
        return tuple(self._running)

    # -- what the caller sends --

    def hello(self) -> Outgoing:
        if self._hello_sent:
            raise UsageError("HELLO is sent once")
        self._hello_sent = True
        return Outgoing(self._hello, 0)

    def ready(self, step: int) -> Outgoing:
        """READY for the step just received. With ready_is_go the step runs from here, as if GOed."""
        if step != self._pending:
            raise UsageError(f"READY for step {step}, but the PREPARE waiting for an answer is {self._pending}")
        self._pending = None
        if self.ready_is_go:
            self._running.append(step)
        else:
            self._staged = step
        return Outgoing(Ready(self.rank), step)

    def ready_or_ride(self, step: int) -> Outgoing | None:
        """`ready(step)`, or None where the READY can ride in the RESULT of the step running here:
        on a lone rank (ready_is_go) whose step just before this one (step - 1, not one before a
        refused step) has not finished. Its RESULT then says ready_next: the scheduler (at most
        two steps in flight) plans the step after this one only once it has both, and hears them
        in one frame."""
        riding = self.ready_is_go and self.rank == 0 and bool(self._running) and self._running[-1] == step - 1
        ready = self.ready(step)
        if not riding:
            return ready
        self._riding = step
        return None

    def reject(self, step: int, error: ProtocolError) -> Outgoing:
        """The REJECT for a Refused event, for a received PREPARE this rank cannot stage (it is
        dropped), or for a running step whose forward failed (it is dropped from the running ones)."""
        if not isinstance(error, ProtocolError):
            raise UsageError(f"reject takes a ProtocolError, not {type(error).__name__}")
        if step == self._pending:
            self._pending, self._refused, self._held = None, step, None
        elif step == self._staged:
            self._staged, self._refused, self._held = None, step, None
        elif step in self._running:
            self._running.remove(step)
        if step == self._riding:
            self._riding = None
        return Outgoing(
            Reject(self.rank, int(error.code), error.message, np.asarray(error.seq_ids, dtype=np.int64)), step
        )

    def result(self, step: int, result: Result) -> Outgoing:
        if self.rank != 0:
            raise UsageError(f"rank {self.rank} sends DONE, not RESULT")
        self._finish(step, "RESULT")
        if self._riding == step + 1:
            self._riding = None
            result = dataclasses.replace(result, ready_next=True)
        return Outgoing(result, step)

    def done(self, step: int) -> Outgoing:
        if self.rank == 0:
            raise UsageError("rank 0 sends RESULT, not DONE")
        self._finish(step, "DONE")
        return Outgoing(Done(self.rank), step)

    def heartbeat(self) -> Outgoing:
        if not self._hello_sent or self.phase is Phase.CLOSED:
            raise UsageError(f"HEARTBEAT is not legal before HELLO or after SHUTDOWN (phase {self.phase.value})")
        return Outgoing(Heartbeat(self.rank), self.last_step)

    def _finish(self, step: int, what: str) -> None:
        if not self._running or self._running[0] != step:
            raise UsageError(f"{what} for step {step}, but the oldest running step is {self._running[0] if self._running else None}")
        self._running.popleft()

    # -- what the caller receives --

    def receive(self, frame: Frame | ProtocolError) -> list[ExecutorEvent]:
        """One frame from the scheduler, or the ProtocolError the endpoint raised for it."""
        if not isinstance(frame, (Frame, ProtocolError)):
            raise UsageError(f"receive takes a Frame or a ProtocolError, not {type(frame).__name__}")
        if self.phase is Phase.CLOSED:
            return [Ignored("the conversation is over")]
        if self.phase is Phase.HANDSHAKE:
            return self._receive_handshake(frame)
        if isinstance(frame, ProtocolError):
            return [Refused(self._refusal_step(), frame)]
        try:
            check_envelope(frame, version=self.version, layout=self.layout, run_id=self.run_id)
        except ProtocolError as exc:
            return [Refused(frame.step, exc)]
        body = frame.body
        if isinstance(body, Heartbeat):
            return []
        if isinstance(body, (Prepare, Continue)):
            return [self._on_prepare(frame, body)]
        if isinstance(body, Go):
            return [self._on_go(frame)]
        if isinstance(body, Cut):
            # Late (the step's RESULT crossed it) or early (not GOed here yet): nothing to cut.
            return [CutReceived(frame.step)] if frame.step in self._running else []
        if isinstance(body, Abort):
            return [self._on_abort(frame, body)]
        if isinstance(body, Shutdown):
            self.phase = Phase.CLOSED
            return [ShutdownReceived(body.reason)]
        return [Refused(frame.step, not_valid_now(frame, "is not valid after WELCOME"))]

    def _receive_handshake(self, frame: Frame | ProtocolError) -> list[ExecutorEvent]:
        if isinstance(frame, ProtocolError):
            return [Ignored(f"dropped a bad frame while waiting for WELCOME: {frame}")]
        body = frame.body
        if isinstance(body, Heartbeat):
            return []
        if frame.run_id != self.run_id:
            return [Ignored(f"dropped a {frame.type.name} of run {frame.run_id!r} while waiting for WELCOME")]
        if isinstance(body, Shutdown):
            self.phase = Phase.CLOSED
            return [ShutdownReceived(body.reason)]
        if not isinstance(body, Welcome):
            return [Ignored(f"ignored {frame.type.name} while waiting for WELCOME")]
        try:
            check_handshake_envelope(frame, self.supported_versions, self.layout, self.run_id)
            self._check_welcome(frame, body)
        except ProtocolError as exc:
            self.phase = Phase.CLOSED
            return [WelcomeRefused(exc.message)]
        self.phase = Phase.RUNNING
        self.version = body.version
        self.ready_is_go = body.ready_is_go
        self.last_step = frame.step
        return [Welcomed(body.version)]

    def _check_welcome(self, frame: Frame, welcome: Welcome) -> None:
        if welcome.version not in self.supported_versions or frame.version != welcome.version:
            raise ProtocolError(
                RejectCode.BAD_VERSION,
                f"WELCOME chose protocol version {welcome.version} (stamped {frame.version}); this rank supports "
                f"{', '.join(map(str, self.supported_versions))}",
            )
        if welcome.layout != self.layout:
            raise ProtocolError(
                RejectCode.BAD_LAYOUT, f"WELCOME chose cache layout {welcome.layout}; this rank uses layout {self.layout}"
            )
        if welcome.world_size != self.world_size:
            raise ProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                f"WELCOME says world size {welcome.world_size}; this rank was started in a world of {self.world_size}",
            )
        if welcome.ready_is_go and self.world_size != 1:
            raise ProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                f"WELCOME says READY is GO, which only a group of one rank can do; this one has {self.world_size}",
            )
        try:
            check_geometry(self.geometry, welcome.geometry, who="WELCOME")
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{exc.message}; this rank cannot run it") from None

    def _refusal_step(self) -> int:
        staged = self.staged
        return staged if staged is not None else self.last_step + 1

    def _on_prepare(self, frame: Frame, body: Prepare | Continue) -> ExecutorEvent:
        if self.staged is not None:
            return Refused(frame.step, not_valid_now(frame, f"while step {self.staged} is staged (it needs GO or ABORT)"))
        try:
            check_envelope(frame, version=self.version, layout=self.layout, run_id=self.run_id, expected_step=self.last_step + 1)
        except ProtocolError as exc:
            return Refused(frame.step, exc)
        self.last_step = frame.step
        held, self._held = self._held, None
        try:
            if isinstance(body, Prepare):
                prepare = body
                validate_prepare(prepare, self.geometry)
            else:
                prepare = _expand(frame.step, held, body)
                validate_continued(prepare, self.geometry)
        except ProtocolError as exc:
            self._refused = frame.step
            return Refused(frame.step, exc)
        self._pending = frame.step
        self._held = (frame.step, prepare)
        return PrepareReceived(frame.step, prepare)

    def _on_go(self, frame: Frame) -> ExecutorEvent:
        if self._staged is None or frame.step != self._staged:
            have = "nothing" if self.staged is None else f"step {self.staged}"
            return Refused(frame.step, not_valid_now(frame, f"but {have} is staged"))
        self._staged = None
        self._running.append(frame.step)
        return GoReceived(frame.step)

    def _on_abort(self, frame: Frame, abort: Abort) -> ExecutorEvent:
        step = frame.step
        if step == self.staged:
            self._pending = self._staged = self._held = None
            return AbortReceived(step, abort.reason, dropped=True)
        if step > self.last_step:
            # Its PREPARE never reached this rank intact, or this rank refused it as out of sequence
            # (BAD_STEP uses no number): every number up to it is used up, and the two sides agree
            # on the next one again.
            self.last_step = step
            return AbortReceived(step, abort.reason, dropped=False)
        if step == self._refused and step == self.last_step:
            return AbortReceived(step, abort.reason, dropped=False)
        when = "which is running" if step in self._running else f"(the last step used up here is {self.last_step})"
        return Refused(step, not_valid_now(frame, when))


def _expand(step: int, held: tuple[int, Prepare] | None, c: Continue) -> Prepare:
    if held is None or held[0] != step - 1:
        had = "none" if held is None else f"step {held[0]}'s"
        raise ProtocolError(
            RejectCode.STEP_NOT_HELD,
            f"CONTINUE for step {step} needs the PREPARE of step {step - 1}; this rank holds {had}",
        )
    return expand(held[1], c)
