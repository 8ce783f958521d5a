"""The scheduler's half of the conversation: the handshake (scheduler_handshake.py), then steps
numbered 1, 2, 3, ... with their READY sets, answers and ends."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from protocol.conversation.common import Outgoing, Phase, not_valid_now
from protocol.conversation.scheduler_events import (
    HandshakeComplete,
    HandshakeRefused,
    ProtocolViolation,
    RankShutdown,
    Rejection,
    SchedulerEvent,
    StepDone,
    StepFailed,
    StepReady,
    StepRefused,
)
from protocol.conversation.scheduler_handshake import Handshake, PlannedGeometry
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
from protocol.validate import check_envelope

# Late answers to the last aborted steps are dropped rather than reported as violations; a rank that
# lags further behind has long been declared silent by the caller's timeouts.
_ABORTED_REMEMBERED = 64


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
    - go(N) only when every rank answered READY for N and none refused it (with ready_is_go, a
      group of one rank, go(N) records that the rank runs N and there is nothing to send);
    - abort(N) only for the step waiting for GO; it uses up N (the next step is N + 1);
    - cut(N) only for a GOed step in flight.
    prepare(N, body, brief) sends the CONTINUE `brief` instead of the PREPARE `body` it stands for
    when step N - 1 was prepared and not aborted: that PREPARE is the one every rank expands it
    after (protocol.continuation).
    Rules it enforces on the ranks (ProtocolViolation otherwise): frames stamped with this launch's
    run id, the negotiated version and layout; READY/REJECT only for the step waiting for answers
    (late answers to an aborted step are dropped), or a lone rank's READY for the step waiting for
    it in the RESULT of the step before (ready_next; StepDone.next_ready says it came); RESULT from
    rank 0 and DONE from the others, each rank finishing its GOed steps in order.
    """

    def __init__(
        self,
        *,
        world_size: int,
        run_id: str,
        planned: PlannedGeometry | None = None,
        max_inflight: int = 1,
        ready_is_go: bool = False,
        supported_versions: Iterable[int] = SUPPORTED_VERSIONS,
        layout: int = LAYOUT_VERSION,
    ) -> None:
        if world_size < 1 or max_inflight < 1:
            raise UsageError(f"world_size ({world_size}) and max_inflight ({max_inflight}) must be >= 1")
        if ready_is_go and world_size != 1:
            raise UsageError(f"READY can be GO only in a group of one rank, not {world_size}")
        self.world_size = world_size
        self.ready_is_go = ready_is_go
        self.ranks = tuple(range(world_size))
        self.run_id = run_id
        self.max_inflight = max_inflight
        self.supported_versions = tuple(supported_versions)
        self.layout = layout
        self._handshake = Handshake(
            world_size=world_size,
            run_id=run_id,
            planned=planned,
            supported_versions=self.supported_versions,
            layout=layout,
        )
        self.phase = Phase.HANDSHAKE
        self.version: int | None = None
        self.geometry: CacheGeometry | None = None
        self._last_heard: dict[int, float] = {}
        self.next_step = 1
        self._steps: deque[_Step] = deque()  # in flight, oldest first; the last may wait for GO
        self._aborted: deque[int] = deque(maxlen=_ABORTED_REMEMBERED)
        self._held: int | None = None  # the step whose PREPARE every rank holds, unless it refuses it

    # -- what the caller reads --

    @property
    def hellos(self) -> Mapping[int, Hello]:
        return dict(self._handshake.hellos)

    @property
    def last_heard(self) -> Mapping[int, float]:
        """When each rank's last frame arrived, in the caller's clock (`now` of receive)."""
        return dict(self._last_heard)

    def heard_at(self, rank: int) -> float | None:
        """When `rank`'s last frame arrived (last_heard's, without the copy)."""
        return self._last_heard.get(rank)

    @property
    def in_flight(self) -> tuple[int, ...]:
        return tuple(s.step for s in self._steps)

    @property
    def staged(self) -> int | None:
        """The step that was prepared and waits for GO or ABORT."""
        return self._steps[-1].step if self._steps and not self._steps[-1].go_sent else None

    def who(self, rank: int) -> str:
        """How errors name a rank: with its host, once its HELLO said which."""
        return self._handshake.who(rank)

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
        return Outgoing(Welcome(self.version, self.layout, self.world_size, self.geometry, self.ready_is_go), 0)

    def prepare(self, step: int, body: Prepare, brief: Continue | None = None) -> Outgoing:
        """PREPARE `body` for the step, or `brief`, the CONTINUE that expands to it, when the ranks
        hold the step before's."""
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
        continues = brief is not None and self._held == step - 1
        self._held = step
        return Outgoing(brief if continues else body, step)

    def go(self, step: int) -> Outgoing | None:
        """GO for the staged step; None when the WELCOME said READY is GO (the rank runs it already)."""
        self._require_running("GO")
        if step != self.staged:
            raise UsageError(f"GO for step {step}, but the step waiting for GO is {self.staged}")
        s = self._steps[-1]
        if s.rejections or len(s.ready) != self.world_size:
            raise UsageError(f"GO for step {step} before every rank is READY (unanswered {sorted(self.unanswered(step))}, "
                             f"refused by {sorted(s.rejections)})")
        s.go_sent = True
        return None if self.ready_is_go else Outgoing(Go(), step)

    def cut(self, step: int) -> Outgoing:
        """CUT for a GOed step still in flight: a step of several forwards ends after the one running."""
        self._require_running("CUT")
        s = self._find(step)
        if s is None or not s.go_sent:
            raise UsageError(f"CUT for step {step}, which is not a GOed step in flight (in flight: {list(self.in_flight)})")
        return Outgoing(Cut(), step)

    def abort(self, step: int, reason: str) -> Outgoing:
        self._require_running("ABORT")
        if step != self.staged:
            raise UsageError(f"ABORT for step {step}, but the step waiting for GO is {self.staged}: a GOed step cannot be aborted")
        self._steps.pop()
        self._aborted.append(step)
        self._held = None
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
            return [self._violation(rank, frame.step, not_valid_now(frame, "before WELCOME"))]
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
        return [self._violation(rank, frame.step, not_valid_now(frame, "is not a frame a rank sends"))]

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
            return [self._violation(rank, frame.step, not_valid_now(frame, "before the handshake ended"))]
        if rank in self._handshake.hellos:
            return [self._violation(rank, frame.step, not_valid_now(frame, "a second time"))]
        outcome = self._handshake.add(rank, frame)
        if isinstance(outcome, HandshakeRefused):
            self.phase = Phase.REFUSED
        elif isinstance(outcome, HandshakeComplete):
            self.version, self.geometry = outcome.version, outcome.geometry
            self.phase = Phase.AGREED
        return [] if outcome is None else [outcome]

    def _on_answer(self, rank: int, frame: Frame, reject: Reject | None) -> list[SchedulerEvent]:
        s = self._find(frame.step)
        if s is None:
            if frame.step in self._aborted:
                return []  # a late answer to a step that was aborted meanwhile
            what = "is not in flight" if frame.step < self.next_step else "was never prepared"
            detail = f" ({_reject_code(reject).name}: {reject.message})" if reject is not None else ""
            return [self._violation(rank, frame.step, not_valid_now(frame, f"which {what}{detail}"))]
        if s.go_sent:
            if reject is None:
                return [self._violation(rank, frame.step, not_valid_now(frame, "after GO"))]
            return [StepFailed(s.step, rank, self._host(rank), _reject_code(reject), reject.message)]
        if reject is None:
            if rank in s.ready or rank in s.rejections:
                return [self._violation(rank, frame.step, not_valid_now(frame, "a second time"))]
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
            return [self._violation(rank, frame.step, not_valid_now(frame, f"from rank {rank}, which sends {expected}"))]
        pending = next((s for s in self._steps if s.go_sent and rank not in s.finished), None)
        if pending is None or pending.step != frame.step:
            when = "with no GOed step pending" if pending is None else f"while step {pending.step} is this rank's next to finish"
            return [self._violation(rank, frame.step, not_valid_now(frame, when))]
        pending.finished.add(rank)
        if is_result:
            pending.result = frame.body
        if len(pending.finished) < self.world_size:
            return []
        self._steps.remove(pending)
        if not (is_result and frame.body.ready_next):
            return [StepDone(pending.step, pending.result)]
        nxt = self._find(pending.step + 1)
        if not self.ready_is_go or nxt is None or nxt.go_sent or nxt.ready or nxt.rejections:
            why = "without ready_is_go" if not self.ready_is_go else f"but step {pending.step + 1} does not wait for it"
            error = not_valid_now(frame, f"saying READY for the next step {why}")
            return [StepDone(pending.step, pending.result), self._violation(rank, pending.step + 1, error)]
        nxt.ready.add(rank)
        nxt.answered = True
        return [StepDone(pending.step, pending.result, next_ready=True)]

    def _find(self, step: int) -> _Step | None:
        return next((s for s in self._steps if s.step == step), None)

    def _host(self, rank: int) -> str:
        return self._handshake.host(rank)

    def _violation(self, rank: int, step: int | None, error: ProtocolError) -> ProtocolViolation:
        return ProtocolViolation(rank, self._host(rank), step, error.code, error.message)


def _reject_code(reject: Reject) -> RejectCode:
    try:
        return RejectCode(reject.code)
    except ValueError:  # a code from a newer peer: still a refusal, with its number in the message
        return RejectCode.INTERNAL
