"""The scheduler's side of the step protocol, for bare executors (`executors.ExecutorCluster`): the
handshake, heartbeats, whole steps, and frames sent as raw sections (a fuzzer's), with every answer
seen as the rank sent it.

It speaks through protocol.conversation's SchedulerConversation, the state machine the engine uses,
over a real SchedulerEndpoint: every frame the ranks send goes through `conv.receive`, and every
step number, GO and ABORT comes from it. Raw sections take the place of a PREPARE the conversation
believes was sent (`send_parts`), so that the step numbering on both sides stays the engine's own
whatever the executors make of them. The sections are stamped with the endpoint's own key and
sequence counter (`stamp`), so a mutation that is not about the seq is never refused as a replay.

One thread: the endpoint's socket belongs to it. Every wait sends heartbeats, so the ranks (which
end after peer_timeout_s of silence) stay up while a caller drives them; between two calls the
caller has peer_timeout_s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack

from protocol.codec import encode, frame_mac, to_message
from protocol.conversation import (
    HandshakeComplete,
    HandshakeRefused,
    Phase,
    SchedulerConversation,
    SchedulerEvent,
    StepDone,
    StepReady,
    StepRefused,
)
from protocol.errors import RejectCode
from protocol.frames import (
    LAYOUT_VERSION,
    Body,
    Done,
    Frame,
    Prepare,
    Ready,
    Reject,
    Result,
)
from protocol.transport import SchedulerEndpoint

QUIET_S = 0.5  # how long a frame that must get no answer is watched for one


class DriverError(RuntimeError):
    """The ranks did not do what the step protocol requires of them (no answer, a rank gone)."""


@dataclass(frozen=True)
class Answer:
    """What one rank sent back, as it sent it."""

    rank: int
    step: int | None  # the envelope's step; None when the rank's frame did not decode here
    kind: str  # READY, REJECT, RESULT, DONE, or UNDECODABLE
    code: RejectCode | None = None
    message: str = ""
    seq_ids: tuple[int, ...] = ()


@dataclass
class Sent:
    """One frame (or a few) sent in place of step `step`'s PREPARE, and what came of it."""

    step: int
    answers: dict[int, list[Answer]] = field(default_factory=dict)  # by rank: READY/REJECT and strays
    events: list[SchedulerEvent] = field(default_factory=list)
    result: Result | None = None  # every rank was READY: the step ran, this is rank 0's RESULT

    def codes(self) -> dict[int, RejectCode | None]:
        """Each rank's first answer: its REJECT code, or None for READY."""
        return {rank: answers[0].code for rank, answers in sorted(self.answers.items()) if answers}


class FrameDriver:
    def __init__(
        self,
        endpoint: SchedulerEndpoint,
        world_size: int,
        *,
        heartbeat_s: float = 0.2,
        answer_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.conv = SchedulerConversation(world_size=world_size, run_id=endpoint.run_id)
        self.heartbeat_s = heartbeat_s
        self.answer_timeout_s = answer_timeout_s
        self._clock = clock
        self._next_beat = 0.0
        self._tap: Sent | None = None  # where the ranks' answers go while a raw frame is out
        self.events: list[SchedulerEvent] = []  # every event since the last take_events()

    # -- the handshake and whole steps -------------------------------------------------------------

    def handshake(self, timeout_s: float = 120.0) -> HandshakeComplete:
        kinds = (HandshakeComplete, HandshakeRefused)
        self._require(lambda: any(isinstance(e, kinds) for e in self.events), timeout_s, "every rank's HELLO")
        event = next(e for e in self.events if isinstance(e, kinds))
        if isinstance(event, HandshakeRefused):
            raise DriverError(f"the handshake was refused: {event.message}")
        self.endpoint.version = self.conv.version
        self.endpoint.send_all(self.conv.ranks, *self.conv.welcome())
        self.events.clear()
        return event

    def step(self, prepare: Prepare) -> StepDone | StepRefused:
        """One whole step: PREPARE, GO once every rank is READY (and its RESULT), or ABORT."""
        step = self.conv.next_step
        self.endpoint.send_all(self.conv.ranks, *self.conv.prepare(step, prepare))
        answer = self._wait_for(lambda e: isinstance(e, (StepReady, StepRefused)) and e.step == step)
        if isinstance(answer, StepRefused):
            self.endpoint.send_all(self.conv.ranks, *self.conv.abort(step, answer.message))
            return answer
        self.endpoint.send_all(self.conv.ranks, *self.conv.go(step))
        return self._wait_for(lambda e: isinstance(e, StepDone) and e.step == step)

    # -- raw frames ----------------------------------------------------------------------------------

    @property
    def next_step(self) -> int:
        return self.conv.next_step

    @property
    def key(self) -> bytes:
        return self.endpoint._stamp.key

    def stamp(
        self,
        body: Body,
        step: int,
        *,
        version: int | None = None,
        layout: int | None = None,
        run_id: str | None = None,
        seq: int | None = None,
        key: bytes | None = None,
    ) -> list[bytes]:
        """Parts as the endpoint would send them (its key, the next seq of its counter), with any
        envelope field or the key replaced."""
        stamp = self.endpoint._stamp
        stamp._seq += 1
        frame = Frame(
            version if version is not None else stamp.version,
            layout if layout is not None else LAYOUT_VERSION,
            run_id if run_id is not None else stamp.run_id,
            step,
            seq if seq is not None else stamp._seq,
            body,
        )
        return encode(frame, key if key is not None else stamp.key)

    def resign(self, parts: Sequence[bytes]) -> list[bytes]:
        """The parts but the last, with a MAC made with the launch key: what a buggy key holder sends."""
        head = [bytes(p) for p in parts[:-1]]
        return [*head, frame_mac(self.key, head)]

    def repack(self, parts: Sequence[bytes], envelope_of: Callable[[dict], object]) -> list[bytes]:
        """The parts with the envelope envelope_of(their envelope as a dict), re-signed."""
        packed = msgpack.packb(envelope_of(msgpack.unpackb(parts[0])), use_bin_type=True)
        return self.resign([packed, *parts[1:]])

    def send_parts(self, messages: Sequence[Sequence[bytes]], *, answered: bool = True, quiet_s: float = QUIET_S) -> Sent:
        """Sends `messages` (each a list of sections, made one ZeroMQ message) to every rank in place of the PREPARE of the next
        step, as the conversation sees it. Waits for one answer from every rank (`answered`), or
        watches for quiet_s that none comes (frames the protocol ignores). If every rank answered
        READY for the step, it runs (GO, then RESULT); otherwise it is aborted. Answers for another
        step (a mutated step number) are kept too."""
        step = self.conv.next_step
        sent = Sent(step)
        placeholder = Prepare.greedy([], [], [], [], [])
        self.conv.prepare(step, placeholder)
        self._tap = sent
        try:
            for parts in messages:
                self.endpoint.send_message(self.conv.ranks, to_message([bytes(p) for p in parts]))
            ranks = set(self.conv.ranks)
            if answered:
                answers = lambda: ranks <= {r for r, a in sent.answers.items() if a}  # noqa: E731
                self._require(answers, self.answer_timeout_s, f"an answer to step {step} from every rank")
            else:
                self._pump(lambda: False, quiet_s)
            ready = next((e for e in self.events if isinstance(e, StepReady) and e.step == step), None)
            if ready is not None:
                self.endpoint.send_all(self.conv.ranks, *self.conv.go(step))
                done = self._wait_for(lambda e: isinstance(e, StepDone) and e.step == step)
                sent.result = done.result
            elif self.conv.staged == step:
                self.endpoint.send_all(self.conv.ranks, *self.conv.abort(step, "the fuzzer's frame was not run"))
            # Answers to the ABORT (a rank that had used the step up already) are dropped by the
            # conversation; let them arrive before the next frame goes out.
            self._pump(lambda: False, 0.02)
        finally:
            self._tap = None
        sent.events = self.take_events()
        return sent

    # -- liveness ------------------------------------------------------------------------------------

    def idle(self, seconds: float) -> None:
        """Heartbeats and reads for `seconds`."""
        self._pump(lambda: False, seconds)

    def silent_ranks(self, within_s: float) -> list[int]:
        """Ranks from which nothing arrived in the last within_s seconds."""
        now, heard = self._clock(), self.conv.last_heard
        return [r for r in self.conv.ranks if now - heard.get(r, float("-inf")) > within_s]

    def take_events(self) -> list[SchedulerEvent]:
        events, self.events = self.events, []
        return events

    def shutdown(self, reason: str) -> None:
        self.endpoint.send_all(self.endpoint.ranks, *self.conv.shutdown(reason))

    # -- the loop ------------------------------------------------------------------------------------

    def _wait_for(self, match: Callable[[SchedulerEvent], bool]) -> SchedulerEvent:
        self._require(lambda: any(match(e) for e in self.events), self.answer_timeout_s, "the step's next event")
        found = next(e for e in self.events if match(e))
        self.events.remove(found)
        return found

    def _require(self, until: Callable[[], bool], timeout_s: float, what: str) -> None:
        if not self._pump(until, timeout_s):
            raise DriverError(
                f"no {what} within {timeout_s:.1f} s (in flight {list(self.conv.in_flight)}, silent ranks "
                f"{self.silent_ranks(4 * self.heartbeat_s)}, last events {self.events[-4:]})"
            )

    def _pump(self, until: Callable[[], bool], timeout_s: float) -> bool:
        """Heartbeats and hands every frame to the conversation until `until()` holds (True) or
        timeout_s has passed (False)."""
        deadline = self._clock() + timeout_s
        while not until():
            now = self._clock()
            if now >= deadline:
                return False
            if now >= self._next_beat and self.conv.phase is Phase.RUNNING:
                self.endpoint.send_all(self.conv.ranks, *self.conv.heartbeat())
                self._next_beat = now + self.heartbeat_s
            got = self.endpoint.recv(max(1, int(min(deadline - now, self.heartbeat_s) * 1000)))
            if got is None:
                continue
            if self._tap is not None:
                self._note(got.rank, got.frame, got.error is not None)
            self.events.extend(self.conv.receive(got.rank, got.frame or got.error, self._clock()))
        return True

    def _note(self, rank: int, frame: Frame | None, undecodable: bool) -> None:
        assert self._tap is not None
        if undecodable or frame is None:
            answer = Answer(rank, None, "UNDECODABLE")
        else:
            body = frame.body
            if isinstance(body, Ready):
                answer = Answer(rank, frame.step, "READY")
            elif isinstance(body, Reject):
                code = RejectCode(body.code) if body.code in RejectCode._value2member_map_ else None
                answer = Answer(rank, frame.step, "REJECT", code, body.message, tuple(int(s) for s in body.seq_ids))
            elif isinstance(body, (Result, Done)):
                return  # the step the fuzzer's frame ran as: StepDone carries it
            else:
                return  # heartbeats
        self._tap.answers.setdefault(rank, []).append(answer)
