"""The protocol's conversation, as two pure state machines: one for the scheduler, one per executor.

Sans-IO, in the manner of h11: no sockets and no clocks. The caller hands each decoded frame (or the
ProtocolError the codec raised for it) to `receive` and gets typed events back; it asks the machine
for every frame it sends (`prepare`, `go`, `ready`, ...), which raises UsageError when the call is not
legal now, and hands the returned `Outgoing` to its endpoint unchanged. Timeouts are the caller's: it
reads `unanswered(step)`, `unfinished(step)` and `last_heard` and decides. A peer's mistake is never
an exception here, only an event (ProtocolViolation, Refused, ...).

This module is the one place that knows the order of frames, the step numbering, the READY sets,
version negotiation and the handshake's checks, and the one caller of the envelope check.

The conversation (docs/protocol.md, "The step"):

    executor                                   scheduler
    HELLO ------------------------------------>  every rank's HELLO agrees: WELCOME to all
          <------------------------------------  WELCOME (negotiated version, geometry)
          <------------------------------------  PREPARE(N)            N = last step + 1
    READY(N) | REJECT(N) --------------------->  all READY: GO(N); else ABORT(N) (N is used up)
          <------------------------------------  GO(N) | ABORT(N)
          <------------------------------------  PREPARE(N+1)  (pipelined: once GO(N) is out,
                                                  when max_inflight > 1)
    RESULT(N) from rank 0, DONE(N) from the others, in step order
    HEARTBEAT either way at any time; SHUTDOWN from the scheduler ends it

The scheduler's loop (the engine), in outline:

    conv = SchedulerConversation(world_size=2, run_id=run_id, planned=scheduler.config, max_inflight=2)
    while conv.phase is Phase.HANDSHAKE:             # and the handshake deadline has not passed
        got = endpoint.recv(200)
        for event in conv.receive(got.rank, got.frame or got.error, time.monotonic()) if got else ():
            if isinstance(event, HandshakeRefused):
                endpoint.send_all(conv.ranks, *conv.shutdown(event.message))   # then fail
    endpoint.version = conv.version
    endpoint.send_all(conv.ranks, *conv.welcome())
    ...
    endpoint.send_all(conv.ranks, *conv.prepare(plan.step, plan.prepare))
    for event in conv.receive(rank, frame_or_error, now):
        StepReady(N)     -> endpoint.send_all(conv.ranks, *conv.go(N)); maybe prepare N+1 now
        StepRefused(N)   -> endpoint.send_all(conv.ranks, *conv.abort(N, reason)); fail event.seq_ids'
                            requests (or the whole step when it is empty) and plan again
        StepDone(N)      -> scheduler.on_result(plan_of[N], event.result)
        StepFailed, RankShutdown -> the group cannot go on
        ProtocolViolation -> abort the step waiting for answers, if any; after GO, fail
    deadline passed while conv.unanswered(N): abort(N) naming those ranks (conv.who(rank))

Each executor's loop (the worker), in outline:

    conv = ExecutorConversation(rank=r, world_size=w, run_id=run_id, geometry=g, model_fingerprint=fp,
                                config_fingerprint=options_fp, host=socket.gethostname())
    endpoint.send(*conv.hello())
    while True:
        try:
            got = endpoint.recv(timeout_ms)          # None on timeout
        except ProtocolError as exc:
            got = exc
        for event in conv.receive(got) if got is not None else ():
            Welcomed          -> endpoint.version = event.version
            WelcomeRefused    -> exit: this rank cannot run what the scheduler chose
            PrepareReceived   -> page tables, inputs, clears; endpoint.send(*conv.ready(event.step)),
                                 or endpoint.send(*conv.reject(event.step, error)) if those fail
            GoReceived        -> forward; endpoint.send(*conv.result(event.step, result)) on rank 0,
                                 endpoint.send(*conv.done(event.step)) elsewhere
            AbortReceived     -> drop the staged inputs (event.dropped) and the held page tables
            Refused           -> endpoint.send(*conv.reject(event.step, event.error))
            ShutdownReceived  -> exit
            Ignored           -> log
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import (
    LAYOUT_VERSION,
    SUPPORTED_VERSIONS,
    Abort,
    Body,
    CacheGeometry,
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
from protocol.validate import check_envelope, check_geometry, negotiate_version, validate_prepare

# Late answers to the last aborted steps are dropped rather than reported as violations; a rank that
# lags further behind has long been declared silent by the caller's timeouts.
_ABORTED_REMEMBERED = 64


class Outgoing(NamedTuple):
    """A frame to send: the body and the step its envelope carries, in the order the endpoints'
    send(body, step) and send_all(ranks, body, step) take them."""

    body: Body
    step: int


class Phase(enum.Enum):
    HANDSHAKE = "handshake"  # scheduler: collecting HELLOs; executor: HELLO sent, waiting for WELCOME
    AGREED = "agreed"  # scheduler: every HELLO in and consistent; WELCOME not sent yet
    RUNNING = "running"
    REFUSED = "refused"  # the handshake failed; only SHUTDOWN is left to send
    CLOSED = "closed"  # SHUTDOWN sent (scheduler) or received (executor)


def _check_handshake_envelope(frame: Frame, supported: Sequence[int], layout: int, run_id: str) -> None:
    # HELLO and WELCOME are accepted at any version this side supports: agreeing on one is their
    # purpose. Every other frame must carry exactly the negotiated version.
    if frame.version not in supported:
        raise ProtocolError(
            RejectCode.BAD_VERSION,
            f"{frame.type.name} has protocol version {frame.version}; this peer supports {list(supported)}",
        )
    check_envelope(frame, version=frame.version, layout=layout, run_id=run_id)


def _not_valid_now(frame: Frame, when: str) -> ProtocolError:
    return ProtocolError(RejectCode.UNEXPECTED_FRAME, f"{frame.type.name} for step {frame.step} {when}")


# ---- the scheduler's side -------------------------------------------------------------------


class PlannedGeometry(Protocol):
    """What the scheduler plans with (scheduler.SchedulerConfig has these): every rank's cache must
    agree, or the scheduler would plan pages and lengths the executors do not have."""

    num_kv_pages: int
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_host_pages: int


PLANNED_FIELDS = ("num_kv_pages", "page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_host_pages")


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


@dataclass
class _Step:
    step: int
    go_sent: bool = False
    ready: set[int] = field(default_factory=set)
    rejections: dict[int, Rejection] = field(default_factory=dict)
    answered: bool = False  # StepReady or StepRefused was reported
    finished: set[int] = field(default_factory=set)
    result: Result | None = None


class SchedulerConversation:
    """The scheduler's half: the handshake, then steps numbered 1, 2, 3, ...

    Rules it enforces on the caller (UsageError otherwise):
    - prepare(N) needs N == next_step, no step waiting for GO, and fewer than max_inflight steps in
      flight (prepared and not yet done or aborted): with max_inflight 1 the next PREPARE waits for
      the previous step's end, with 2 it may go out as soon as GO for the previous step is out;
    - go(N) only when every rank answered READY for N and none refused it;
    - abort(N) only for the step waiting for GO; it uses up N (the next step is N + 1).
    Rules it enforces on the ranks (ProtocolViolation otherwise): frames stamped with this launch's
    run id, the negotiated version and layout; READY/REJECT only for the step waiting for answers
    (late answers to an aborted step are dropped); RESULT from rank 0 and DONE from the others, each
    rank finishing its GOed steps in order.
    """

    def __init__(
        self,
        *,
        world_size: int,
        run_id: str,
        planned: PlannedGeometry | None = None,
        max_inflight: int = 1,
        supported_versions: Iterable[int] = SUPPORTED_VERSIONS,
        layout: int = LAYOUT_VERSION,
    ) -> None:
        if world_size < 1 or max_inflight < 1:
            raise UsageError(f"world_size ({world_size}) and max_inflight ({max_inflight}) must be >= 1")
        self.world_size = world_size
        self.ranks = tuple(range(world_size))
        self.run_id = run_id
        self.max_inflight = max_inflight
        self.supported_versions = tuple(supported_versions)
        self.layout = layout
        self._planned = planned
        self.phase = Phase.HANDSHAKE
        self.version: int | None = None
        self.geometry: CacheGeometry | None = None
        self._hellos: dict[int, Hello] = {}
        self._last_heard: dict[int, float] = {}
        self.next_step = 1
        self._steps: deque[_Step] = deque()  # in flight, oldest first; the last may wait for GO
        self._aborted: deque[int] = deque(maxlen=_ABORTED_REMEMBERED)

    # -- what the caller reads --

    @property
    def hellos(self) -> Mapping[int, Hello]:
        return dict(self._hellos)

    @property
    def last_heard(self) -> Mapping[int, float]:
        """When each rank's last frame arrived, in the caller's clock (`now` of receive)."""
        return dict(self._last_heard)

    @property
    def in_flight(self) -> tuple[int, ...]:
        return tuple(s.step for s in self._steps)

    @property
    def staged(self) -> int | None:
        """The step that was prepared and waits for GO or ABORT."""
        return self._steps[-1].step if self._steps and not self._steps[-1].go_sent else None

    def who(self, rank: int) -> str:
        """How errors name a rank: with its host, once its HELLO said which."""
        return f"rank {rank} on host {self._host(rank)}"

    def unanswered(self, step: int) -> frozenset[int]:
        """Ranks that have answered neither READY nor REJECT for the step waiting for GO."""
        s = self._find(step)
        if s is None or s.go_sent:
            return frozenset()
        return frozenset(self.ranks) - s.ready - s.rejections.keys()

    def unfinished(self, step: int) -> frozenset[int]:
        """Ranks whose RESULT/DONE for a GOed step has not arrived."""
        s = self._find(step)
        if s is None or not s.go_sent:
            return frozenset()
        return frozenset(self.ranks) - s.finished

    # -- what the caller sends --

    def welcome(self) -> Outgoing:
        if self.phase is not Phase.AGREED:
            raise UsageError(f"WELCOME needs every rank's HELLO to agree; the conversation is {self.phase.value}")
        self.phase = Phase.RUNNING
        return Outgoing(Welcome(self.version, self.layout, self.world_size, self.geometry), 0)

    def prepare(self, step: int, body: Prepare) -> Outgoing:
        self._require_running("PREPARE")
        if step != self.next_step:
            raise UsageError(f"PREPARE for step {step}, but the next step is {self.next_step}")
        if self.staged is not None:
            raise UsageError(f"PREPARE for step {step} while step {self.staged} waits for GO or ABORT")
        if len(self._steps) >= self.max_inflight:
            raise UsageError(
                f"PREPARE for step {step} with steps {list(self.in_flight)} in flight (max_inflight {self.max_inflight})"
            )
        self._steps.append(_Step(step))
        self.next_step = step + 1
        return Outgoing(body, step)

    def go(self, step: int) -> Outgoing:
        self._require_running("GO")
        if step != self.staged:
            raise UsageError(f"GO for step {step}, but the step waiting for GO is {self.staged}")
        s = self._steps[-1]
        if s.rejections or len(s.ready) != self.world_size:
            raise UsageError(f"GO for step {step} before every rank is READY (unanswered {sorted(self.unanswered(step))}, "
                             f"refused by {sorted(s.rejections)})")
        s.go_sent = True
        return Outgoing(Go(), step)

    def abort(self, step: int, reason: str) -> Outgoing:
        self._require_running("ABORT")
        if step != self.staged:
            raise UsageError(f"ABORT for step {step}, but the step waiting for GO is {self.staged}: a GOed step cannot be aborted")
        self._steps.pop()
        self._aborted.append(step)
        return Outgoing(Abort(reason), step)

    def heartbeat(self) -> Outgoing:
        self._require_running("HEARTBEAT")
        return Outgoing(Heartbeat(-1), 0)

    def shutdown(self, reason: str) -> Outgoing:
        """Legal in every phase: the end of the conversation."""
        self.phase = Phase.CLOSED
        return Outgoing(Shutdown(reason), 0)

    def _require_running(self, what: str) -> None:
        if self.phase is not Phase.RUNNING:
            raise UsageError(f"{what} is not legal while the conversation is {self.phase.value}")

    # -- what the caller receives --

    def receive(self, rank: int, frame: Frame | ProtocolError, now: float) -> list[SchedulerEvent]:
        """One frame from `rank` (as the transport attributed it), or the ProtocolError its
        authenticated parts failed to decode with; `now` is the caller's clock."""
        if not isinstance(frame, (Frame, ProtocolError)):
            raise UsageError(f"receive takes a Frame or a ProtocolError, not {type(frame).__name__}")
        if self.phase in (Phase.REFUSED, Phase.CLOSED):
            return []
        if rank not in self.ranks:
            return self._outside_world(rank, frame)
        self._last_heard[rank] = now
        if isinstance(frame, ProtocolError):
            return [self._violation(rank, None, frame)]
        if self.phase is Phase.HANDSHAKE:
            return self._receive_handshake(rank, frame)
        body = frame.body
        if isinstance(body, Heartbeat):
            return []
        if isinstance(body, Shutdown):
            return [RankShutdown(rank, self._host(rank), body.reason)]
        if self.phase is Phase.AGREED:
            return [self._violation(rank, frame.step, _not_valid_now(frame, "before WELCOME"))]
        try:
            check_envelope(frame, version=self.version, layout=self.layout, run_id=self.run_id)
        except ProtocolError as exc:
            return [self._violation(rank, frame.step, exc)]
        if isinstance(body, (Ready, Reject, Done)) and body.rank != rank:
            return [self._violation(rank, frame.step, ProtocolError(
                RejectCode.MALFORMED, f"{frame.type.name} from rank {rank}'s connection says rank {body.rank}"))]
        if isinstance(body, Ready):
            return self._on_answer(rank, frame, None)
        if isinstance(body, Reject):
            return self._on_answer(rank, frame, body)
        if isinstance(body, (Result, Done)):
            return self._on_finished(rank, frame)
        return [self._violation(rank, frame.step, _not_valid_now(frame, "is not a frame a rank sends"))]

    def _outside_world(self, rank: int, frame: Frame | ProtocolError) -> list[SchedulerEvent]:
        error = ProtocolError(
            RejectCode.GEOMETRY_MISMATCH, f"rank {rank} is not in this launch's world of {self.world_size}"
        )
        if self.phase is Phase.HANDSHAKE and isinstance(frame, Frame) and isinstance(frame.body, Hello):
            self.phase = Phase.REFUSED
            host = frame.body.host or "?"
            return [HandshakeRefused(rank, host, error.code, f"rank {rank} on host {host}: {error.message}")]
        return [ProtocolViolation(rank, "?", frame.step if isinstance(frame, Frame) else None, error.code, error.message)]

    def _receive_handshake(self, rank: int, frame: Frame) -> list[SchedulerEvent]:
        body = frame.body
        if isinstance(body, Heartbeat):
            return []
        if isinstance(body, Shutdown):
            return [RankShutdown(rank, self._host(rank), body.reason)]
        if not isinstance(body, Hello):
            return [self._violation(rank, frame.step, _not_valid_now(frame, "before the handshake ended"))]
        if rank in self._hellos:
            return [self._violation(rank, frame.step, _not_valid_now(frame, "a second time"))]
        self._hellos[rank] = body
        try:
            _check_handshake_envelope(frame, self.supported_versions, self.layout, self.run_id)
            self._check_hello(rank, body)
        except ProtocolError as exc:
            return [self._refuse(rank, exc.code, f"{self.who(rank)}: {exc.message}")]
        if 0 in self._hellos:
            for other in [rank] if rank != 0 else sorted(self._hellos)[1:]:
                try:
                    self._check_against_rank0(other, self._hellos[other])
                except ProtocolError as exc:
                    return [self._refuse(other, exc.code, exc.message)]
        if len(self._hellos) < self.world_size:
            return []
        common = set(self.supported_versions).intersection(*(h.versions for h in self._hellos.values()))
        try:
            self.version = negotiate_version(common)
        except ProtocolError:
            offers = ", ".join(f"{self.who(r)} {list(h.versions)}" for r, h in sorted(self._hellos.items()))
            return [self._refuse(rank, RejectCode.BAD_VERSION, (
                f"no protocol version is common to every rank and the scheduler ({list(self.supported_versions)}): {offers}"))]
        self.geometry = self._hellos[0].geometry
        self.phase = Phase.AGREED
        return [HandshakeComplete(self.version, self.geometry, tuple(self._hellos[r] for r in self.ranks))]

    def _refuse(self, rank: int, code: RejectCode, message: str) -> HandshakeRefused:
        self.phase = Phase.REFUSED
        return HandshakeRefused(rank, self._host(rank), code, message)

    def _check_hello(self, rank: int, hello: Hello) -> None:
        if hello.rank != rank:
            raise ProtocolError(RejectCode.MALFORMED, f"its connection is rank {rank}'s, but its HELLO says rank {hello.rank}")
        if hello.world_size != self.world_size:
            raise ProtocolError(
                RejectCode.GEOMETRY_MISMATCH, f"runs with world size {hello.world_size}, this launch has {self.world_size}"
            )
        if hello.layout != self.layout:
            raise ProtocolError(RejectCode.BAD_LAYOUT, f"uses cache layout {hello.layout}, the scheduler {self.layout}")
        if not set(hello.versions) & set(self.supported_versions):
            raise ProtocolError(
                RejectCode.BAD_VERSION,
                f"speaks protocol versions {list(hello.versions)}, the scheduler {list(self.supported_versions)}",
            )
        if self._planned is not None:
            for name in PLANNED_FIELDS:
                have, planned = getattr(hello.geometry, name), getattr(self._planned, name)
                if have != planned:
                    raise ProtocolError(
                        RejectCode.GEOMETRY_MISMATCH,
                        f"was started with other options than the scheduler: its cache has {name} {have}, the "
                        f"scheduler plans with {planned}; every host must be given the same model and options",
                    )

    def _check_against_rank0(self, rank: int, hello: Hello) -> None:
        first = self._hellos[0]
        if hello.config_fingerprint != first.config_fingerprint:
            raise ProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                f"{self.who(rank)} was started with other options (fingerprint {hello.config_fingerprint}) than "
                f"{self.who(0)} ({first.config_fingerprint}): every host must be given the same model and options",
            )
        if hello.model_fingerprint != first.model_fingerprint:
            raise ProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                f"{self.who(rank)} loaded other weights (fingerprint {hello.model_fingerprint}) than {self.who(0)} "
                f"({first.model_fingerprint})",
            )
        check_geometry(first.geometry, hello.geometry, who=f"{self.who(rank)} (compared with rank 0)")

    def _on_answer(self, rank: int, frame: Frame, reject: Reject | None) -> list[SchedulerEvent]:
        s = self._find(frame.step)
        if s is None:
            if frame.step in self._aborted:
                return []  # a late answer to a step that was aborted meanwhile
            what = "is not in flight" if frame.step < self.next_step else "was never prepared"
            detail = f" ({_reject_code(reject).name}: {reject.message})" if reject is not None else ""
            return [self._violation(rank, frame.step, _not_valid_now(frame, f"which {what}{detail}"))]
        if s.go_sent:
            if reject is None:
                return [self._violation(rank, frame.step, _not_valid_now(frame, "after GO"))]
            return [StepFailed(s.step, rank, self._host(rank), _reject_code(reject), reject.message)]
        if reject is None:
            if rank in s.ready or rank in s.rejections:
                return [self._violation(rank, frame.step, _not_valid_now(frame, "a second time"))]
            s.ready.add(rank)
        elif rank not in s.rejections:
            s.ready.discard(rank)
            s.rejections[rank] = Rejection(
                rank, self._host(rank), _reject_code(reject), reject.message, tuple(int(i) for i in reject.seq_ids)
            )
            if s.answered:  # READY from everyone was reported, and now this rank takes it back
                s.answered = False
        if s.answered or len(s.ready) + len(s.rejections) < self.world_size:
            return []
        s.answered = True
        if s.rejections:
            return [StepRefused(s.step, tuple(s.rejections[r] for r in sorted(s.rejections)))]
        return [StepReady(s.step)]

    def _on_finished(self, rank: int, frame: Frame) -> list[SchedulerEvent]:
        is_result = isinstance(frame.body, Result)
        if is_result != (rank == 0):
            expected = "RESULT" if rank == 0 else "DONE"
            return [self._violation(rank, frame.step, _not_valid_now(frame, f"from rank {rank}, which sends {expected}"))]
        pending = next((s for s in self._steps if s.go_sent and rank not in s.finished), None)
        if pending is None or pending.step != frame.step:
            when = "with no GOed step pending" if pending is None else f"while step {pending.step} is this rank's next to finish"
            return [self._violation(rank, frame.step, _not_valid_now(frame, when))]
        pending.finished.add(rank)
        if is_result:
            pending.result = frame.body
        if len(pending.finished) < self.world_size:
            return []
        self._steps.remove(pending)
        return [StepDone(pending.step, pending.result)]

    def _find(self, step: int) -> _Step | None:
        return next((s for s in self._steps if s.step == step), None)

    def _host(self, rank: int) -> str:
        hello = self._hellos.get(rank)
        return hello.host if hello is not None and hello.host else "?"

    def _violation(self, rank: int, step: int | None, error: ProtocolError) -> ProtocolViolation:
        return ProtocolViolation(rank, self._host(rank), step, error.code, error.message)


def _reject_code(reject: Reject) -> RejectCode:
    try:
        return RejectCode(reject.code)
    except ValueError:  # a code from a newer peer: still a refusal, with its number in the message
        return RejectCode.INTERNAL


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
    """A PREPARE in sequence and valid against the geometry: answer ready(step) or reject(step, ...)."""

    step: int
    prepare: Prepare


@dataclass(frozen=True)
class GoReceived:
    """Run the step; answer result(step, ...) on rank 0, done(step) elsewhere."""

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


ExecutorEvent = Welcomed | WelcomeRefused | PrepareReceived | GoReceived | AbortReceived | ShutdownReceived | Refused | Ignored


class ExecutorConversation:
    """One rank's half: HELLO, WELCOME, then steps.

    A PREPARE must carry last step + 1 and arrive while no other step waits for GO here (one may be
    running: the pipelined PREPARE for N+1 arrives while N runs); GO must be for the staged step, so
    GO N+1 always follows GO N; ABORT names a step and uses it up (dropping it if staged). RESULT or
    DONE go out in the order the steps were GOed.
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
        if step != self._pending:
            raise UsageError(f"READY for step {step}, but the PREPARE waiting for an answer is {self._pending}")
        self._pending, self._staged = None, step
        return Outgoing(Ready(self.rank), step)

    def reject(self, step: int, error: ProtocolError) -> Outgoing:
        """The REJECT for a Refused event, for a received PREPARE this rank cannot stage (it is
        dropped), or for a running step whose forward failed (it is dropped from the running ones)."""
        if not isinstance(error, ProtocolError):
            raise UsageError(f"reject takes a ProtocolError, not {type(error).__name__}")
        if step == self._pending:
            self._pending, self._refused = None, step
        elif step == self._staged:
            self._staged, self._refused = None, step
        elif step in self._running:
            self._running.remove(step)
        return Outgoing(
            Reject(self.rank, int(error.code), error.message, np.asarray(error.seq_ids, dtype=np.int64)), step
        )

    def result(self, step: int, result: Result) -> Outgoing:
        if self.rank != 0:
            raise UsageError(f"rank {self.rank} sends DONE, not RESULT")
        self._finish(step, "RESULT")
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
        if isinstance(body, Prepare):
            return [self._on_prepare(frame, body)]
        if isinstance(body, Go):
            return [self._on_go(frame)]
        if isinstance(body, Abort):
            return [self._on_abort(frame, body)]
        if isinstance(body, Shutdown):
            self.phase = Phase.CLOSED
            return [ShutdownReceived(body.reason)]
        return [Refused(frame.step, _not_valid_now(frame, "is not valid after WELCOME"))]

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
            _check_handshake_envelope(frame, self.supported_versions, self.layout, self.run_id)
            self._check_welcome(frame, body)
        except ProtocolError as exc:
            self.phase = Phase.CLOSED
            return [WelcomeRefused(exc.message)]
        self.phase = Phase.RUNNING
        self.version = body.version
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
        try:
            check_geometry(self.geometry, welcome.geometry, who="WELCOME")
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{exc.message}; this rank cannot run it") from None

    def _refusal_step(self) -> int:
        staged = self.staged
        return staged if staged is not None else self.last_step + 1

    def _on_prepare(self, frame: Frame, prepare: Prepare) -> ExecutorEvent:
        if self.staged is not None:
            return Refused(frame.step, _not_valid_now(frame, f"while step {self.staged} is staged (it needs GO or ABORT)"))
        try:
            check_envelope(frame, version=self.version, layout=self.layout, run_id=self.run_id, expected_step=self.last_step + 1)
        except ProtocolError as exc:
            return Refused(frame.step, exc)
        self.last_step = frame.step
        try:
            validate_prepare(prepare, self.geometry)
        except ProtocolError as exc:
            self._refused = frame.step
            return Refused(frame.step, exc)
        self._pending = frame.step
        return PrepareReceived(frame.step, prepare)

    def _on_go(self, frame: Frame) -> ExecutorEvent:
        if self._staged is None or frame.step != self._staged:
            have = "nothing" if self.staged is None else f"step {self.staged}"
            return Refused(frame.step, _not_valid_now(frame, f"but {have} is staged"))
        self._staged = None
        self._running.append(frame.step)
        return GoReceived(frame.step)

    def _on_abort(self, frame: Frame, abort: Abort) -> ExecutorEvent:
        step = frame.step
        if step == self.staged:
            self._pending = self._staged = None
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
        return Refused(step, _not_valid_now(frame, when))
