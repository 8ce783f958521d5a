"""Property-based tests of the conversation.

1. A scheduler and its ranks, each a conversation, joined by FIFO channels (what ZeroMQ gives one
   pair of peers): hypothesis picks who acts and which frame is delivered next, with refusals,
   timeouts, pipelining, frames damaged in transit and frames no correct peer sends. Checked against
   a plain record of what was sent and delivered: GO is legal exactly when every rank's READY arrived
   for the staged step and no REJECT did; a rank runs only a step it said READY to, once, never after
   its ABORT; a step is done only once every rank's RESULT/DONE arrived, after those of the steps
   GOed before it; steps finish in GO order. Between correct peers on a clean network, nothing is ever
   a violation or a refusal, and every rank runs the same steps in the same order.
2. Random frames of every type, step, version and run id, and random local calls, into each side:
   receive never raises, and a call raises nothing but UsageError.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from protocol.conversation import (
    AbortReceived,
    ExecutorConversation,
    GoReceived,
    HandshakeComplete,
    Phase,
    PrepareReceived,
    ProtocolViolation,
    Refused,
    SchedulerConversation,
    StepDone,
    StepFailed,
    StepReady,
    StepRefused,
    Welcomed,
)
from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import Abort, Done, Frame, Go, Heartbeat, Ready, Reject, Result, Shutdown, Welcome
from tests.protocol.conversation_helpers import PREPARE, V, hello, result
from tests.protocol.wire_samples import GEOMETRY, RUN_ID

SCHEDULER = -1


class Pair(RuleBasedStateMachine):
    """One scheduler, `world` ranks, two FIFO channels per rank, and a record of what was sent and
    delivered (the model the conversations are checked against)."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = 0
        self.damaged = False  # a frame was replaced by its decoding error in transit
        self.rogue = False  # a frame no correct peer would send was injected

    @initialize(world=st.integers(1, 3), max_inflight=st.integers(1, 3))
    def start(self, world: int, max_inflight: int) -> None:
        self.world = world
        self.all = set(range(world))
        self.sched = SchedulerConversation(world_size=world, run_id=RUN_ID, max_inflight=max_inflight)
        self.ranks = [
            ExecutorConversation(rank=r, world_size=world, run_id=RUN_ID, geometry=GEOMETRY, model_fingerprint="w")
            for r in range(world)
        ]
        self.to_rank = [deque() for _ in range(world)]
        self.to_sched = [deque() for _ in range(world)]
        # The model: what each side sent and what was delivered, as plain records.
        self.answers: dict[int, str] = {}  # step -> "ready" | "refused", as the scheduler reported it
        self.ready_heard: dict[int, set[int]] = {}  # step -> ranks whose READY arrived while it was staged
        self.reject_heard: dict[int, set[int]] = {}  # step -> ranks whose REJECT arrived while it was staged
        self.finish_heard: dict[int, list[int]] = {r: [] for r in range(world)}  # rank -> steps whose RESULT/DONE arrived
        self.gone: list[int] = []  # steps GO was sent for
        self.aborted: list[int] = []
        self.finished: list[int] = []  # StepDone, in order
        self.ready_sent: list[set[int]] = [set() for _ in range(world)]  # each rank's READYs
        self.aborted_at: list[set[int]] = [set() for _ in range(world)]  # each rank's ABORTs received
        self.ran: list[list[int]] = [[] for _ in range(world)]  # GoReceived at each rank, in order
        for r in range(world):
            self._rank_send(r, self.ranks[r].hello())
        for r in range(world):
            self._flush_to_sched(r)
        assert self.sched.phase is Phase.AGREED
        self._sched_send(self.sched.welcome())
        for r in range(world):
            self._flush_to_rank(r)
        assert all(c.phase is Phase.RUNNING for c in self.ranks)

    # -- plumbing --

    def _frame(self, body, step: int) -> Frame:
        self.seq += 1
        return Frame(V, 1, RUN_ID, step, self.seq, body)

    def _sched_send(self, out) -> None:
        for r in range(self.world):
            self.to_rank[r].append(self._frame(*out))

    def _rank_send(self, rank: int, out) -> None:
        self.to_sched[rank].append(self._frame(*out))

    def _deliver_to_sched(self, rank: int, damage: bool = False) -> None:
        item = self.to_sched[rank].popleft()
        if damage:
            item = ProtocolError(RejectCode.BAD_MAC, "damaged in transit")
        else:
            self._record_arrival(rank, item)
        for event in self.sched.receive(rank, item, 0.0):
            self._on_sched_event(event)

    def _record_arrival(self, rank: int, f: Frame) -> None:
        if isinstance(f.body, (Ready, Reject)) and f.step == self.sched.staged:
            heard = self.ready_heard if isinstance(f.body, Ready) else self.reject_heard
            heard.setdefault(f.step, set()).add(rank)
        elif isinstance(f.body, (Result, Done)):
            self.finish_heard[rank].append(f.step)

    def _deliver_to_rank(self, rank: int, damage: bool = False) -> None:
        item = self.to_rank[rank].popleft()
        if damage:
            item = ProtocolError(RejectCode.BAD_MAC, "damaged in transit")
        for event in self.ranks[rank].receive(item):
            self._on_rank_event(rank, event)

    def _flush_to_rank(self, r: int) -> None:
        while self.to_rank[r]:
            self._deliver_to_rank(r)

    def _flush_to_sched(self, r: int) -> None:
        while self.to_sched[r]:
            self._deliver_to_sched(r)

    def _on_sched_event(self, event) -> None:
        if isinstance(event, HandshakeComplete):
            assert [h.rank for h in event.hellos] == sorted(self.all)
        elif isinstance(event, StepReady):
            # Every rank's READY arrived while the step was staged, and no REJECT did.
            assert self.ready_heard.get(event.step, set()) == self.all and not self.reject_heard.get(event.step)
            self.answers[event.step] = "ready"
        elif isinstance(event, StepRefused):
            # Every rank answered, and those that refused are the ones whose REJECT arrived.
            assert self.ready_heard.get(event.step, set()) | self.reject_heard.get(event.step, set()) == self.all
            assert {r.rank for r in event.rejections} == self.reject_heard.get(event.step)
            self.answers[event.step] = "refused"
        elif isinstance(event, StepDone):
            # Each rank's RESULT or DONE for it arrived, after one for every step GOed before.
            for r in range(self.world):
                heard = self.finish_heard[r]
                assert event.step in heard
                last = len(heard) - 1 - heard[::-1].index(event.step)
                earlier = [s for s in self.gone if s < event.step]
                assert all(s in heard[:last] for s in earlier), (r, heard, self.gone)
            self.finished.append(event.step)
        else:
            assert self.damaged or self.rogue, f"a correct pair of peers produced {event}"
            assert isinstance(event, (ProtocolViolation, StepFailed)), event

    def _on_rank_event(self, rank: int, event) -> None:
        conv = self.ranks[rank]
        if isinstance(event, (Welcomed, PrepareReceived)):
            return  # a PREPARE is answered by a rule, some time later
        if isinstance(event, GoReceived):
            # Only a step this rank said READY to, never twice, never after its ABORT.
            assert event.step in self.ready_sent[rank] and event.step not in self.ran[rank]
            assert event.step not in self.aborted_at[rank]
            self.ran[rank].append(event.step)
            return
        if isinstance(event, AbortReceived):
            assert event.step not in self.ran[rank]  # a running step cannot be aborted
            self.aborted_at[rank].add(event.step)
            assert event.step in self.aborted or self.rogue
            return
        if isinstance(event, Refused):
            assert self.damaged or self.rogue, f"rank {rank} refused a frame of a correct scheduler: {event}"
            self._rank_send(rank, conv.reject(event.step, event.error))
            return
        assert self.damaged or self.rogue, event

    # -- the scheduler's moves --

    @precondition(lambda self: self.sched.phase is Phase.RUNNING)
    @rule()
    def prepare(self) -> None:
        step = self.sched.next_step
        legal = self.sched.staged is None and len(self.sched.in_flight) < self.sched.max_inflight
        try:
            out = self.sched.prepare(step, PREPARE)
        except UsageError:
            assert not legal
            return
        assert legal
        self._sched_send(out)

    @precondition(lambda self: self.sched.staged is not None)
    @rule(timeout=st.integers(0, 9).map(lambda n: n == 0))
    def go_or_abort(self, timeout: bool) -> None:
        step = self.sched.staged
        answer = self.answers.get(step)
        if answer == "ready" and not timeout:
            self._sched_send(self.sched.go(step))
            self.gone.append(step)
        elif answer == "refused" or timeout:
            self._sched_send(self.sched.abort(step, "refused" if answer else "timed out"))
            self.aborted.append(step)

    @precondition(lambda self: self.sched.staged is not None)
    @rule()
    def try_go_early(self) -> None:
        """GO is accepted exactly when every rank's READY arrived while the step was staged and no
        REJECT did."""
        step = self.sched.staged
        ok = self.ready_heard.get(step, set()) == self.all and not self.reject_heard.get(step)
        try:
            out = self.sched.go(step)
        except UsageError:
            assert not ok
            return
        assert ok
        self._sched_send(out)
        self.gone.append(step)

    @precondition(lambda self: self.sched.phase is Phase.RUNNING)
    @rule()
    def scheduler_heartbeat(self) -> None:
        self._sched_send(self.sched.heartbeat())

    @precondition(lambda self: self.sched.phase is Phase.RUNNING and self.sched.staged is None)
    @rule()
    def step_while_one_runs(self) -> None:
        """PREPARE, every rank READY, GO, all delivered at once: with a step still running at the
        ranks, this is the overlapped pipeline."""
        step = self.sched.next_step
        try:
            self._sched_send(self.sched.prepare(step, PREPARE))
        except UsageError:
            return
        for r, conv in enumerate(self.ranks):
            self._flush_to_rank(r)
            if conv.staged == step and step not in self.ready_sent[r]:
                self._ready(r, step)
            self._flush_to_sched(r)
        if self.answers.get(step) == "ready" and self.sched.staged == step:
            self._sched_send(self.sched.go(step))
            self.gone.append(step)
            for r in range(self.world):
                self._flush_to_rank(r)

    # -- the ranks' moves --

    def _ready(self, r: int, step: int) -> None:
        self._rank_send(r, self.ranks[r].ready(step))
        self.ready_sent[r].add(step)

    @rule(data=st.data())
    def rank_answers(self, data) -> None:
        r = data.draw(st.integers(0, self.world - 1))
        conv = self.ranks[r]
        step = conv.staged
        if step is None or step in self.ready_sent[r]:
            return
        if data.draw(st.integers(0, 5)) > 0:
            self._ready(r, step)
        else:
            seq_ids = data.draw(st.sampled_from([(), (int(PREPARE.seq_ids[0]),)]))
            self._rank_send(r, conv.reject(step, ProtocolError(RejectCode.BAD_SAMPLING, "no", seq_ids)))

    @rule(data=st.data())
    def rank_finishes(self, data) -> None:
        r = data.draw(st.integers(0, self.world - 1))
        conv = self.ranks[r]
        if not conv.running:
            return
        step = conv.running[0]
        self._rank_send(r, conv.result(step, result(tuple(PREPARE.seq_ids.tolist()))) if r == 0 else conv.done(step))

    @rule(data=st.data())
    def rank_heartbeat(self, data) -> None:
        r = data.draw(st.integers(0, self.world - 1))
        self._rank_send(r, self.ranks[r].heartbeat())

    # -- the network, and frames no correct peer sends --

    @rule(data=st.data(), damage=st.integers(0, 19).map(lambda n: n == 0))
    def deliver(self, data, damage: bool) -> None:
        channels = [(SCHEDULER, r) for r in range(self.world) if self.to_sched[r]]
        channels += [(r, r) for r in range(self.world) if self.to_rank[r]]
        if not channels:
            return
        to, r = data.draw(st.sampled_from(channels))
        self.damaged |= damage
        if to == SCHEDULER:
            self._deliver_to_sched(r, damage)
        else:
            self._deliver_to_rank(r, damage)

    @rule(data=st.data())
    def deliver_everything(self, data) -> None:
        """Every queued frame, channel after channel in a drawn order (FIFO within each)."""
        order = data.draw(st.permutations([(to, r) for to in (SCHEDULER, 0) for r in range(self.world)]))
        for to, r in order:
            (self._flush_to_sched if to == SCHEDULER else self._flush_to_rank)(r)

    @rule(data=st.data())
    def inject_rogue_frame(self, data) -> None:
        """A GO, ABORT or PREPARE for any step to a rank, or a READY, REJECT, RESULT or DONE for any
        step from one: what a buggy peer holding the key could send."""
        r = data.draw(st.integers(0, self.world - 1))
        near = {self.sched.next_step - 2, self.sched.next_step - 1, self.sched.next_step, self.sched.next_step + 1}
        near |= set(self.ranks[r].running) | {self.ranks[r].staged, self.sched.staged}
        step = data.draw(st.sampled_from(sorted(s for s in near if s is not None and s >= 1)))
        self.rogue = True
        if data.draw(st.booleans()):
            body = data.draw(st.sampled_from([Go(), Abort("rogue"), PREPARE]))
            self.to_rank[r].append(self._frame(body, step))
        else:
            finish = result() if r == 0 else Done(r)
            body = data.draw(st.sampled_from([Ready(r), Reject(r, int(RejectCode.INTERNAL), "rogue"), finish]))
            self.to_sched[r].append(self._frame(body, step))

    @rule(data=st.data())
    def inject_go_for_another_step(self, data) -> None:
        """A GO for a step next to the one a rank has staged, as a buggy scheduler might send."""
        staged = [(r, c._staged) for r, c in enumerate(self.ranks) if c._staged is not None]
        if not staged:
            return
        r, step = data.draw(st.sampled_from(staged))
        self.rogue = True
        self.to_rank[r].appendleft(self._frame(Go(), step + data.draw(st.sampled_from([-1, 1]))))

    @rule(data=st.data())
    def inject_reject_after_ready(self, data) -> None:
        """A REJECT from a rank whose READY for the staged step has arrived."""
        step = self.sched.staged
        heard = sorted(self.ready_heard.get(step, ())) if step is not None else []
        if not heard:
            return
        r = data.draw(st.sampled_from(heard))
        self.rogue = True
        self.to_sched[r].appendleft(self._frame(Reject(r, int(RejectCode.INTERNAL), "rogue"), step))

    # -- what must hold --

    @invariant()
    def bounded(self) -> None:
        assert len(self.sched.in_flight) <= self.sched.max_inflight
        assert list(self.sched.in_flight) == sorted(self.sched.in_flight)
        for conv in self.ranks:
            assert list(conv.running) == sorted(conv.running)

    @invariant()
    def steps_finish_in_go_order(self) -> None:
        assert self.finished == self.gone[: len(self.finished)]
        assert not set(self.gone) & set(self.aborted)

    @invariant()
    def every_rank_runs_the_same_steps(self) -> None:
        if self.damaged or self.rogue:
            return
        for ran in self.ran:
            assert ran == self.gone[: len(ran)]
        for conv in self.ranks:
            assert conv.last_step < self.sched.next_step


TestPair = Pair.TestCase
TestPair.settings = settings(max_examples=100, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- random frames into each side ------------------------------------------------------------------

bodies = st.sampled_from(
    [
        hello(0),
        hello(1),
        hello(1, world_size=3),
        Welcome(V, 1, 2, GEOMETRY),
        PREPARE,
        Ready(0),
        Ready(1),
        Reject(1, 9, "x", np.asarray([1000], np.int64)),
        Reject(0, 999, "from a newer peer"),
        Go(),
        Abort("x"),
        result(),
        Done(1),
        Done(0),
        Heartbeat(0),
        Shutdown("x"),
    ]
)
frames = st.builds(
    Frame,
    version=st.sampled_from([V, V + 1]),
    layout=st.sampled_from([1, 1, 2]),
    run_id=st.sampled_from([RUN_ID, RUN_ID, "other"]),
    step=st.integers(0, 5),
    seq=st.integers(0, 10),
    body=bodies,
)
inputs = st.one_of(frames, st.builds(ProtocolError, st.sampled_from(list(RejectCode)), st.text(max_size=5)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 3), inputs, st.integers(0, 6)), max_size=40))
def test_the_scheduler_side_never_raises_on_input_and_only_usage_errors_on_calls(script) -> None:
    conv = SchedulerConversation(world_size=2, run_id=RUN_ID, max_inflight=2)
    for rank, item, call in script:
        conv.receive(rank, item, 0.0)
        try:
            if call == 1:
                conv.welcome()
            elif call == 2:
                conv.prepare(conv.next_step, PREPARE)
            elif call == 3 and conv.staged is not None:
                conv.go(conv.staged)
            elif call == 4 and conv.staged is not None:
                conv.abort(conv.staged, "x")
            elif call == 5:
                conv.heartbeat()
        except UsageError:
            pass
        assert len(conv.in_flight) <= 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(inputs, st.integers(0, 5), st.integers(0, 6)), max_size=40), st.integers(0, 1))
def test_the_executor_side_never_raises_on_input_and_only_usage_errors_on_calls(script, rank) -> None:
    conv = ExecutorConversation(rank=rank, world_size=2, run_id=RUN_ID, geometry=GEOMETRY, model_fingerprint="w")
    conv.hello()
    for item, step, call in script:
        events = conv.receive(item)
        assert len(events) <= 1
        try:
            if call == 1:
                conv.ready(step)
            elif call == 2:
                conv.reject(step, ProtocolError(RejectCode.INTERNAL, "x"))
            elif call == 3:
                conv.result(step, result())
            elif call == 4:
                conv.done(step)
            elif call == 5:
                conv.heartbeat()
        except UsageError:
            pass
