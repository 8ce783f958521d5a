"""The engine thread's step loop: the scheduler's plans through the conversation to the ranks.

One iteration: plan a step if the conversation allows one now (with overlap, step N+1 is planned,
sent and staged on every rank while step N runs; GO N+1 goes out as soon as every rank is READY, and
the ranks run it the moment N ends), then wait for a frame or a wake-up, then hand what the frame
means to the scheduler: READY -> GO, REJECT -> ABORT and on_abort, RESULT -> on_result.

Liveness, each noticed within seconds and named: a rank's connection closes (its process ended);
a rank falls silent (every executor heartbeats from a thread that runs beside its forward, so
silence means it stopped, even mid-step); a step outlives its deadline, which is derived from the
steps measured so far (a deadlocked collective, every rank still heartbeating); a rank says
SHUTDOWN or breaks the protocol after GO; under recovery, the launcher reports the group dead
(`check_deaths`). A closed connection and the launcher's report wake the loop and are taken at
once; silence and deadlines are looked at when the first of them can be crossed (`_next_look`), not
on a clock: every frame a rank sends puts its silence off, so while steps run the loop wakes for
frames, new requests and its own heartbeat (and at the longest wait its caller gives, the engine's
0.5 s).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protocol.conversation import (
    HandshakeComplete,
    HandshakeRefused,
    Outgoing,
    Phase,
    ProtocolViolation,
    RankShutdown,
    SchedulerConversation,
    StepDone,
    StepFailed,
    StepReady,
    StepRefused,
)
from protocol.errors import TPRuntimeError, TransportError
from protocol.transport import SchedulerEndpoint
from scheduler.scheduler import RequestOutput, Scheduler, StepPlan
from tp_runtime.stats import STEP_LATENCY_BUCKETS, BucketCounter

log = logging.getLogger("tp_runtime.engine")

PAGES_CLEARED_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# A heartbeat due within this fraction of heartbeat_s goes out with a burst that a rank's frame
# woke already, rather than on a wake-up of its own. Ranks send a frame at least every 0.5 s, so
# an idle engine's heartbeat rides one only some of the time; 0.5 here (always riding, and twice
# the heartbeats to the ranks) cost the idle frontend the same (1.06-1.17 ms a second on the
# engine thread against 1.17-1.19, docs/control_plane.md's fourteenth sitting).
EARLY_HEARTBEAT = 0.75
# A rank whose collective failed reports it at once, while the peer that died under the collective
# may have its connection's close still unread: this long for it, so that the error names the rank
# that died (a killed rank 1 reached the client as "rank 0 ... gloo Read error").
ROOT_CAUSE_WAIT_S = 0.3


class RankFailure(TPRuntimeError):
    """A rank died, hung or broke the protocol after GO: the group cannot go on."""


class HandshakeError(TPRuntimeError):
    """The ranks disagree with each other or with the frontend (weights, options, geometry, version)."""


@dataclass(frozen=True)
class EngineTimeouts:
    handshake_s: float = 600.0  # ranks load their weights before HELLO
    ready_s: float = 10.0  # PREPARE -> READY from every rank
    # A step's deadline before any step of its kind was measured: a long CPU prefill, or a group's
    # first decode step, which runs code no step ran before (the compiled layers' first call).
    first_step_s: float = 120.0
    step_floor_s: float = 5.0  # no measured deadline is shorter than this
    step_margin: float = 10.0  # a step may take this many times the longest like it measured so far
    # No frame from a rank for this long: it stopped. Executors send a frame at least every 0.5 s
    # beside their forward, a heartbeat when nothing else went (ExecutorOptions.heartbeat_interval_s),
    # and frames that arrived while this process did not run count as heard when it reads them. The
    # longest silence a live rank showed with the 2-core machine at load 5-6 was 0.29 s with a frame
    # every 0.25 s, 0.59 s with one every 0.5 s (tp_runtime_peer_longest_silence_seconds,
    # docs/reports.md): 1.5 s finds a stopped rank within the 2 s with 2.5 times that margin.
    peer_silence_s: float = 1.5
    # A frame to every rank at least this often: a rank ends itself after ExecutorOptions.peer_timeout_s
    # (5 s) without one, five times this.
    heartbeat_s: float = 1.0
    refusal_grace_s: float = 5.0  # after a refused handshake, how long ranks still starting are told to exit


class StepDeadlines:
    """How long a step may run, from the steps measured so far: a step of t tokens may take
    step_margin times the longest measured step, scaled up by t over that step's tokens when t is
    more, and never less than step_floor_s. A deadline catches a group that heartbeats but makes no
    progress; a stopped rank is caught sooner by its silence.

    Until a decode step (one new token per sequence) and a step with a prefill have each been
    measured, a step of the kind not seen yet gets first_step_s: the two run different code (on a
    CPU, compiled layers against eager ones), and the first call of that code pays one-time costs a
    step of the other kind says nothing about."""

    def __init__(self, timeouts: EngineTimeouts, history: int = 64) -> None:
        self._t = timeouts
        # seconds * max(1, t / measured) = max(seconds, t * seconds / measured): the maxima of these
        # two answer any t. Kept apart so that max() runs over plain floats, in C: a generator over
        # the history was a fifth of the engine thread's calls per step. Taken once per step measured,
        # not at each of the loop's several looks a step.
        self._seconds: deque[float] = deque(maxlen=history)
        self._seconds_per_token: deque[float] = deque(maxlen=history)
        self._longest = self._longest_per_token = 0.0
        self._kinds_seen: set[bool] = set()

    def observe(self, tokens: int, seconds: float, decode: bool) -> None:
        self._seconds.append(seconds)
        self._seconds_per_token.append(seconds / max(tokens, 1))
        self._longest, self._longest_per_token = max(self._seconds), max(self._seconds_per_token)
        self._kinds_seen.add(decode)

    def allowed(self, tokens: int, decode: bool) -> float:
        if decode not in self._kinds_seen:
            return self._t.first_step_s
        expected = max(self._longest, tokens * self._longest_per_token)
        return max(self._t.step_floor_s, self._t.step_margin * expected)


@dataclass
class LoopCounters:
    """Filled on the engine thread only; the engine publishes snapshots of them."""

    rejects: int = 0
    aborts: int = 0
    planned_ahead: int = 0  # steps planned while the step before them was still in flight
    forwards: int = 0  # forwards the steps that ended ran (Prepare.decode_steps each, fewer when cut)
    cuts: int = 0  # steps of several forwards told to end early (CUT) because a request waited
    plan_s: float = 0.0  # scheduler work: planning and taking results
    protocol_s: float = 0.0  # PREPARE sent -> GO sent
    step_s: float = 0.0  # PREPARE sent -> RESULT in
    model_busy_s: float = 0.0  # rank 0's forwards + sampling, back-to-back steps
    model_idle_s: float = 0.0  # rank 0's model idle between back-to-back steps: the control plane
    # The longest a rank went unheard, as its next frame ended the silence or a look found it: how
    # close this machine's load came to taking a live rank for a stopped one (peer_silence_s).
    longest_silence_s: float = 0.0


@dataclass
class _InFlight:
    plan: StepPlan
    sent_at: float  # PREPARE sent
    go_at: float | None = None
    started_at: float | None = None  # GO sent and the step before it ended: it runs from here
    back_to_back: bool = False  # planned while the model had work: its gap is control-plane time
    cut: bool = False  # a CUT went out for it

    @property
    def tokens(self) -> int:
        """Tokens computed, over all of the step's forwards: what its deadline scales with."""
        prepare = self.plan.prepare
        return int(prepare.token_ids.shape[0]) * prepare.decode_steps

    @property
    def decode(self) -> bool:
        """One new token per sequence (in each forward)."""
        prepare = self.plan.prepare
        return prepare.token_ids.shape[0] == prepare.seq_ids.shape[0]


class StepLoop:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        endpoint: SchedulerEndpoint,
        world_size: int,
        timeouts: EngineTimeouts,
        deliver: Callable[[list[RequestOutput]], None],
        on_scheduled: Callable[[StepPlan], None],
        check_deaths: Callable[[], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.endpoint = endpoint
        self.timeouts = timeouts
        self.conversation = SchedulerConversation(
            world_size=world_size,
            run_id=endpoint.run_id,
            planned=scheduler.config,
            max_inflight=scheduler.config.max_inflight_steps,
            ready_is_go=world_size == 1,
        )
        self.counters = LoopCounters()
        self.step_latency = BucketCounter(STEP_LATENCY_BUCKETS)
        self.pages_cleared = BucketCounter(PAGES_CLEARED_BUCKETS)
        self._deliver = deliver
        self._on_scheduled = on_scheduled
        self._check_deaths = check_deaths
        self._deadlines = StepDeadlines(timeouts)
        self._inflight: dict[int, _InFlight] = {}
        self._last_sent = 0.0  # when a frame last went to every rank: a heartbeat is due heartbeat_s after
        # Silence counts from the WELCOME at the earliest: a rank that said HELLO first waits for the
        # others (still loading their weights) without a word, for as long as they take.
        self._welcomed_at = 0.0
        self._model_had_work = False  # the last RESULT left work behind: the next step follows at once
        self._finished_at = 0.0  # when the last step's RESULT came
        self._undelivered: list[RequestOutput] = []  # a RESULT's outputs, held until the next PREPARE is out

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.conversation.ranks

    # ---- the handshake ---------------------------------------------------------------------------

    def handshake(self, stopping: Callable[[], bool]) -> None:
        conv, endpoint = self.conversation, self.endpoint
        deadline = time.monotonic() + self.timeouts.handshake_s
        while conv.phase is Phase.HANDSHAKE:
            if stopping():
                raise HandshakeError("stopped before every rank said HELLO")
            if time.monotonic() > deadline:
                missing = sorted(set(conv.ranks) - set(conv.hellos))
                raise HandshakeError(f"ranks {missing} did not say HELLO within {self.timeouts.handshake_s:.0f} s")
            got = endpoint.recv(200)
            if got is None:
                continue
            for event in conv.receive(got.rank, got.frame or got.error, time.monotonic()):
                if isinstance(event, HandshakeRefused):
                    self._shutdown_connected(event.message)
                    raise HandshakeError(event.message)
                assert isinstance(event, HandshakeComplete)
        endpoint.version = conv.version
        endpoint.disconnected_ranks()  # connections that came and went during start-up
        endpoint.send_all(conv.ranks, *conv.welcome())
        self._welcomed_at = time.monotonic()

    def _shutdown_connected(self, reason: str) -> None:
        """Tell every rank to exit, also those whose HELLO is still to come (a refusal can follow
        the first HELLO, while the other ranks still load their weights), for a few seconds."""
        body, step = self.conversation.shutdown(reason)
        told: set[int] = set()
        deadline = time.monotonic() + self.timeouts.refusal_grace_s
        while True:
            for rank in sorted(self.endpoint.ranks - told):
                told.add(rank)
                try:
                    self.endpoint.send(rank, body, step)
                except TPRuntimeError as exc:
                    log.info("could not tell rank %d to exit: %s", rank, exc)
            if len(told) == len(self.conversation.ranks) or time.monotonic() > deadline:
                return
            self.endpoint.recv(100)  # the transport learns a rank from its HELLO as it arrives

    # ---- the steps -------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    def iterate(self, wait_s: float) -> None:
        """Plan what can be planned, then handle frames for up to wait_s (less if woken)."""
        self._plan()
        now = time.monotonic()
        got = self.endpoint.recv(max(0, math.ceil(min(wait_s, self._next_look(now) - now) * 1000)))
        heard = got is not None
        while got is not None:
            now = time.monotonic()
            self._note_silence(now - self._heard_since(got.rank, now))
            for event in self.conversation.receive(got.rank, got.frame or got.error, now):
                self._on_event(event)
            got = self.endpoint.recv(0)
        now = time.monotonic()
        if now >= self._next_look(now):
            self._duties(now)
        else:
            self._take_notices()
            if heard and now - self._last_sent >= EARLY_HEARTBEAT * self.timeouts.heartbeat_s:
                self._send_all(self.conversation.heartbeat())

    def _plan(self) -> None:
        conv = self.conversation
        if self._inflight:
            self._cut_if_asked()
        while (
            conv.staged is None
            and len(conv.in_flight) < self.scheduler.config.max_inflight_steps
            and self.scheduler.has_work()
        ):
            t0 = time.perf_counter()
            plan = self.scheduler.plan_step()
            self.counters.plan_s += time.perf_counter() - t0
            if plan is None:
                break
            back_to_back = bool(self._inflight) or self._model_had_work
            self.counters.planned_ahead += bool(self._inflight)
            self._send_all(conv.prepare(plan.step, plan.prepare, plan.brief))
            self._flush_outputs()
            self._inflight[plan.step] = _InFlight(plan, time.monotonic(), back_to_back=back_to_back)
            self.pages_cleared.observe(int(plan.prepare.cleared_pages.shape[0]))
            self._on_scheduled(plan)
        self._flush_outputs()

    def _cut_if_asked(self) -> None:
        """CUT the newest step in flight, once, when it runs several forwards and the scheduler says
        a request should not wait for all of them. Nothing is planned after such a step before its
        RESULT, so it is the newest."""
        step = next(reversed(self._inflight))
        entry = self._inflight[step]
        if entry.cut or entry.go_at is None or not self.scheduler.should_cut(entry.plan):
            return
        self._send_all(self.conversation.cut(step))
        entry.cut = True
        self.counters.cuts += 1

    def _flush_outputs(self) -> None:
        """Outputs go to the streams after the PREPARE they came before: handing them over wakes
        the HTTP thread, whose Python work would otherwise hold the GIL in front of the frame the
        ranks wait for. In the order they were made: a step's tokens, then what planning ended."""
        outputs, self._undelivered = self._undelivered + self.scheduler.drain_outputs(), []
        self._deliver(outputs)

    def _on_event(self, event: object) -> None:
        conv = self.conversation
        if isinstance(event, StepReady):
            self._go(event.step)
            self._plan()  # with overlap, the next step goes out while this one runs
        elif isinstance(event, StepRefused):
            self._abort(event.step, f"step {event.step} was refused: {event.message}", event.seq_ids)
        elif isinstance(event, StepDone):
            self._finish(event)
        elif isinstance(event, (StepFailed, RankShutdown)):
            said = f"{conv.who(event.rank)}: {getattr(event, 'message', None) or event.reason}"
            raise RankFailure(self._root_cause(event.rank, said))
        elif isinstance(event, ProtocolViolation):
            staged = conv.staged
            # A step whose READY may ride cannot be aborted: the lone rank may be running it.
            if staged is not None and event.rank in conv.unanswered(staged) and not self._may_ride(staged):
                self._abort(staged, f"{conv.who(event.rank)} broke the protocol: {event.message}", ())
            else:
                raise RankFailure(f"{conv.who(event.rank)} broke the protocol with steps running: {event.message}")

    def _go(self, step: int) -> None:
        """Every rank is READY for `step`: GO, and it runs once the steps before it have ended."""
        go = self.conversation.go(step)
        if go is not None:
            self._send_all(go)
        entry = self._inflight[step]
        entry.go_at = time.monotonic()
        self.counters.protocol_s += entry.go_at - self._answer_due_from(entry)
        if not any(s < step for s in self._inflight):
            entry.started_at = entry.go_at

    def _may_ride(self, step: int) -> bool:
        """Whether the ranks' READY for `step` may ride in the RESULT of the step before it: a lone
        rank's, while that step runs (protocol 8)."""
        return self.conversation.ready_is_go and step - 1 in self._inflight

    def _answer_due_from(self, entry: _InFlight) -> float:
        """When the ranks' answer to a PREPARE was due from: its sending, or for a lone rank, whose
        READY rides in the RESULT of the step running before it, that step's end if later."""
        return max(entry.sent_at, self._finished_at) if self.conversation.ready_is_go else entry.sent_at

    def _abort(self, step: int, reason: str, seq_ids: tuple[int, ...]) -> None:
        """ABORT the step waiting for GO. Only the sequences the ranks named fail when they named
        some; the others are planned again at once. Steps before it are untouched."""
        log.warning("%s", reason)
        self._send_all(self.conversation.abort(step, reason))
        self.counters.rejects += 1
        self.counters.aborts += 1
        entry = self._inflight.pop(step)
        t0 = time.perf_counter()
        outputs = self.scheduler.on_abort(entry.plan, reason, seq_ids or None)
        self.counters.plan_s += time.perf_counter() - t0
        self._deliver(outputs)

    def _finish(self, event: StepDone) -> None:
        entry = self._inflight.pop(event.step)
        now = self._finished_at = time.monotonic()
        result = event.result
        forwards = result.forwards  # fewer than planned when cut
        if entry.started_at is not None:
            ran = entry.tokens * forwards // entry.plan.prepare.decode_steps
            self._deadlines.observe(ran, now - entry.started_at, entry.decode)
        self.step_latency.observe(now - entry.sent_at)
        self.counters.forwards += forwards
        self.counters.step_s += now - entry.sent_at
        if entry.back_to_back:
            self.counters.model_idle_s += result.gap_us / 1e6
            self.counters.model_busy_s += result.step_time_us / 1e6
        if event.next_ready:
            self._go(event.step + 1)
        nxt = self._inflight.get(event.step + 1)
        if nxt is not None and nxt.go_at is not None:
            nxt.started_at = now
        t0 = time.perf_counter()
        outputs = self.scheduler.on_result(entry.plan, result)
        self.counters.plan_s += time.perf_counter() - t0
        self._model_had_work = self.scheduler.has_work()
        self._undelivered.extend(outputs)
        self._plan()  # the next PREPARE first: it is on the model's path, the tokens on the client's

    def _root_cause(self, reporter: int, said: str) -> str:
        deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
        while True:
            closed = [r for r in self.endpoint.disconnected_ranks() if r != reporter]
            if closed:
                names = ", ".join(self.conversation.who(r) for r in closed)
                return f"the connection of {names} closed: its process ended (then {said})"
            if time.monotonic() >= deadline:
                return said
            time.sleep(0.02)

    # ---- liveness --------------------------------------------------------------------------------

    def _next_look(self, now: float) -> float:
        """When silence, deadlines or the heartbeat are looked at next: the first moment one of them
        can be crossed. A clock of looks every 0.2 s while steps ran woke the engine thread five
        times a second for nothing (a frame puts the silence off, a step's deadline is seconds
        away); each wake costs the frontend ~0.2 ms of CPU on a virtual machine (docs/control_plane.md)."""
        look = min(self._last_sent + self.timeouts.heartbeat_s, self._quiet_since(now) + self.timeouts.peer_silence_s)
        staged = self.conversation.staged
        if staged is not None and not self._may_ride(staged):
            look = min(look, self._answer_due_from(self._inflight[staged]) + self.timeouts.ready_s)
        running = self._running()
        if running is not None:
            look = min(look, running.started_at + self._deadlines.allowed(running.tokens, running.decode))
        return look

    def _heard_since(self, rank: int, now: float) -> float:
        """Since when a rank has been silent: its last frame, or the WELCOME if later (a rank that
        said HELLO first waited for the others without a word). Never heard: not silent."""
        heard = self.conversation.heard_at(rank)
        return max(now if heard is None else heard, self._welcomed_at)

    def _quiet_since(self, now: float) -> float:
        """Since when the most silent rank has been."""
        return min([self._heard_since(r, now) for r in self.ranks], default=now)

    def _note_silence(self, silence: float) -> None:
        if silence > self.counters.longest_silence_s:
            self.counters.longest_silence_s = silence

    def _running(self) -> _InFlight | None:
        """The step the ranks run now: the first started one (later steps start when it ends)."""
        for entry in self._inflight.values():
            if entry.started_at is not None:
                return entry
        return None

    def check_closed(self) -> None:
        """RankFailure naming the rank whose connection closed first, if any did."""
        if closed := self.endpoint.disconnected_ranks():
            first, *then = (self.conversation.who(r) for r in closed)
            after = f" (then {', '.join(then)} too)" if then else ""
            raise RankFailure(f"the connection of {first} closed: its process ended{after}")

    def _send_all(self, outgoing: Outgoing) -> None:
        """A frame to every rank while steps run. A rank the socket can no longer reach has died
        before the monitor reported its closed connection (a SIGKILL, then a send in the same
        millisecond): that is the rank's failure, as the closed connection would have been, not the
        engine's."""
        try:
            self.endpoint.send_all(self.ranks, *outgoing)
            self._last_sent = time.monotonic()
        except TransportError as exc:
            self.check_closed()  # the monitor's report, when it has arrived meanwhile, names the cause
            raise RankFailure(f"{exc}: the rank cannot be reached, its process has ended") from exc

    def _take_notices(self) -> None:
        """Closed connections and the launcher's reports of dead groups: each wakes the loop's wait
        (the socket's monitor is polled beside it; the report's reader wakes the endpoint)."""
        # A closed connection, when there is one, names the rank more exactly than the exit code
        # the launcher reports after it.
        self.check_closed()
        if self._check_deaths is not None:
            self._check_deaths()

    def _duties(self, now: float) -> None:
        self._take_notices()
        silence = {r: now - self._heard_since(r, now) for r in self.ranks}
        self._note_silence(max(silence.values(), default=0.0))
        silent = [r for r, quiet in silence.items() if quiet > self.timeouts.peer_silence_s]
        if silent:
            names = ", ".join(self.conversation.who(r) for r in silent)
            raise RankFailure(f"{names} stopped answering (no frame for {self.timeouts.peer_silence_s:g} s)")
        self._check_deadlines(now)
        # Any frame tells the ranks the scheduler lives: a heartbeat only fills a silence (steps of
        # more than heartbeat_s, or none).
        if now - self._last_sent >= self.timeouts.heartbeat_s:
            self._send_all(self.conversation.heartbeat())

    def _check_deadlines(self, now: float) -> None:
        conv = self.conversation
        staged = conv.staged
        if staged is not None:
            entry = self._inflight[staged]
            late = conv.unanswered(staged)
            if late and not self._may_ride(staged) and now - self._answer_due_from(entry) > self.timeouts.ready_s:
                names = ", ".join(conv.who(r) for r in sorted(late))
                self._abort(staged, f"{names} did not answer READY for step {staged} within {self.timeouts.ready_s:.0f} s", ())
        running = self._running()
        if running is not None:
            allowed = self._deadlines.allowed(running.tokens, running.decode)
            if now - running.started_at > allowed:
                step = running.plan.step
                names = ", ".join(conv.who(r) for r in sorted(conv.unfinished(step)))
                raise RankFailure(f"step {step} did not finish within {allowed:.1f} s on {names}")

    def shutdown_ranks(self, reason: str) -> None:
        try:
            self.endpoint.send_all(self.endpoint.ranks, *self.conversation.shutdown(reason))
        except TPRuntimeError as exc:  # a rank already gone cannot be told; the launcher reaps it
            log.info("could not tell every rank to shut down: %s", exc)
