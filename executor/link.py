"""An executor's link to the scheduler: a thread that owns the socket and the conversation.

It runs beside the model, so that three things never wait for a forward:
- a frame goes out at least every heartbeat interval, also while a step runs (a heartbeat when
  nothing else did): a rank that stops (SIGSTOP, a hang) is seen by its silence within seconds,
  and a healthy rank waiting in a collective for it is not;
- the next step's PREPARE is decoded, validated, its page tables resolved and its inputs staged
  while the current step runs: READY goes out as soon as nothing can refuse the step, and its
  inputs are built after it, before its GO is read. With the scheduler planning ahead, the GO for
  step N+1 is already here when step N ends;
- SHUTDOWN is heard even when the model is stuck in a collective whose peer is gone;
- a CUT for the step of several forwards that runs reaches the model's thread before its next one.

Offload, poison, restore and clears run on the model's thread, right before the forward of their
step (executor.steps), so that they are ordered after the step before it, which may still be
running when the PREPARE arrives; but for a CPU step's clears, which this thread claims once it
has handed the step over while the model's thread is in the step before, when nothing before them
in that order can still touch their pages (executor/clear_ahead.py).

Threads: the socket and the conversation belong to this thread alone. The model's thread hands it
RESULT/DONE/failures through a queue and wakes its poll (ExecutorEndpoint.wake); this thread hands
the model's thread GOed steps and stops through another queue.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from executor.clear_ahead import ClearAhead, PendingClear
from executor.host_copy import to_device
from executor.inputs import StepInputs, StepInputsError, pages_needed
from executor.sampler import HostOutputs
from executor.sampling_state import StatefulSequences, touches_states
from protocol.conversation import (
    AbortReceived,
    CutReceived,
    ExecutorConversation,
    GoReceived,
    Ignored,
    Outgoing,
    PrepareReceived,
    Refused,
    ShutdownReceived,
    Welcomed,
    WelcomeRefused,
)
from protocol.errors import ProtocolError, RejectCode, TransportError
from protocol.frames import Body, Frame, Prepare, Result
from protocol.page_tables import HeldPageTables

logger = logging.getLogger("tp_runtime.executor")


class Endpoint(Protocol):
    version: int

    def send(self, body: Body, step: int) -> None: ...

    def recv(self, timeout_ms: int) -> Frame | None: ...

    def wake(self) -> None: ...


@dataclass(frozen=True)
class StagedStep:
    """A validated step, its inputs built, waiting for GO (and then for the model's thread)."""

    step: int
    prepare: Prepare  # the cache operations run from it on the model's thread (clears: or ahead)
    inputs: StepInputs
    # For each feedback row, the index of its sequence among the sampled rows of the step run
    # before this one (host: the sampling states' and the CPU's feed)...
    feedback_sources: np.ndarray
    # ... and its token's index in the step's inputs (int64, host).
    feedback_rows: np.ndarray
    # The two over each other (long[2, f]) on a GPU, copied here rather than between two forwards,
    # where each copy waits for the device; None on the CPU, which reads the host arrays, and
    # without feedback rows.
    feedback_on_device: torch.Tensor | None
    # Its cleared pages, zeroed once by the link thread ahead or by the model's thread
    # (executor/clear_ahead.py).
    clears: PendingClear = field(default_factory=PendingClear)
    # Rank 0: whether the step has work for the sampling states (executor.sampling_state.touches_states).
    touches_states: bool = True
    # Rank 0 on a CPU: where each forward's sample is written (executor.sampler.HostOutputs), else ().
    outputs: tuple[HostOutputs, ...] = ()
    # On a CPU with feedback rows: the host array under inputs.token_ids, where the feed lands its
    # tokens (its numpy view made where the step is staged, not between two forwards: change
    # 111), else None.
    token_ids_host: np.ndarray | None = field(init=False)

    def __post_init__(self) -> None:
        host_feed = self.feedback_rows.shape[0] and self.feedback_on_device is None
        object.__setattr__(self, "token_ids_host", self.inputs.token_ids.numpy() if host_feed else None)


def feedback_on_device(rows: np.ndarray, sources: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A GPU step's feedback rows over their sources (long[2, f]), as StepRunner._feed reads them
    on the device (a CPU's are read from the host arrays)."""
    return to_device(np.stack((rows, sources)), device)


@dataclass(frozen=True)
class _Checked:
    """A PREPARE that passed every check a rank makes before its READY, with what they found."""

    step: int
    prepare: Prepare
    page_table: np.ndarray  # its whole page tables, the held ones resolved
    needed: np.ndarray  # the pages each sequence's context covers (executor.inputs.pages_needed)
    feedback_rows: np.ndarray  # each feedback row's token index in the step's inputs
    feedback_sources: np.ndarray  # ... and its sequence's index among the last step's samples


@dataclass(frozen=True)
class Started:
    """The handshake is done: steps may come."""


@dataclass(frozen=True)
class Run:
    staged: StagedStep


@dataclass(frozen=True)
class Stop:
    code: int
    reason: str


Command = Started | Run | Stop


@dataclass(frozen=True)
class LinkTimings:
    heartbeat_s: float
    peer_timeout_s: float  # silence from the scheduler this long ends the rank
    handshake_s: float
    stuck_grace_s: float  # after SHUTDOWN, how long the model's thread may take to come back


def link_thread_name(rank: int) -> str:
    """The link thread's name (benchmarks find it by it, to read its CPU clock)."""
    return f"link-rank-{rank}"


class SchedulerLink:
    def __init__(
        self,
        *,
        conversation: ExecutorConversation,
        endpoint: Endpoint,
        page_size: int,
        pad_page: int,
        device: torch.device | str,
        timings: LinkTimings,
        exit_codes: Any,
        force_exit: Callable[[int], None] = os._exit,
        clear_ahead: ClearAhead | None = None,
    ) -> None:
        self.conversation = conversation
        self.endpoint = endpoint
        self.rank = conversation.rank
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[Callable[[], Outgoing]] = queue.SimpleQueue()
        self._released: queue.SimpleQueue[Run] = queue.SimpleQueue()  # release()'s, freed by _flush
        self._page_size = page_size
        self._pad_page = pad_page
        self._device = device
        self._timings = timings
        self._codes = exit_codes
        self._force_exit = force_exit
        self._clear_ahead = clear_ahead
        self._page_tables = HeldPageTables()
        self._stateful = StatefulSequences()
        self._staged: StagedStep | None = None
        # Sequences sampled by the last step GOed here, in its sample order: feedback rows of the
        # next step read their tokens from that step's samples.
        self._last_sampled = np.zeros(0, dtype=np.int64)
        self._busy_since: float | None = None  # a step handed to the model's thread and not back
        self._sent_at = -math.inf  # when a frame last went out: a heartbeat is due heartbeat_s after
        self._cut: int | None = None  # the last step a CUT named (one int: read by the model's thread)
        self._stopping = threading.Event()
        self._stopped_at: float | None = None
        self._thread = threading.Thread(target=self._run, name=link_thread_name(self.rank), daemon=True)

    # -- the model's thread ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def finish(self, step: int, result: Callable[[], Result] | None, still_busy: bool = False) -> None:
        """Step `step` ran: RESULT on rank 0 (`result` makes it, on this thread), DONE elsewhere.
        still_busy: the next step already runs on the model's thread."""
        if result is None:
            self._post(lambda: self.conversation.done(step), still_busy)
        else:
            self._post(lambda: self._result(step, result), still_busy)

    def release(self, done: Run) -> None:
        """Frees `done` (a step the model's thread has run, with its inputs and a frame's later
        forwards) on this thread the next time it wakes, not on the model's thread between two
        forwards: there, freeing a 16-forward frame's step and the answer before it took ~150 us,
        tensor by tensor (bench_step --num-scheduler-steps 16, marked). The caller keeps no
        reference to it."""
        self._released.put(done)

    def fail(self, step: int, message: str) -> None:
        """The forward of `step` raised: the collectives are unusable, the rank ends after this."""
        error = ProtocolError(RejectCode.INTERNAL, message)
        self._post(lambda: self.conversation.reject(step, error))

    def close(self) -> None:
        """Send what is queued, then end the thread."""
        self._stopping.set()
        self.endpoint.wake()
        self._thread.join(timeout=5)

    def _post(self, outgoing: Callable[[], Outgoing], still_busy: bool = False) -> None:
        if not still_busy:
            self._busy_since = None
        self._outbox.put(outgoing)
        self.endpoint.wake()

    def mark_busy(self) -> None:
        self._busy_since = time.monotonic()

    def is_cut(self, step: int) -> bool:
        """Whether a CUT came for `step`, which runs on the model's thread."""
        return self._cut == step

    # -- this thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._send(self.conversation.hello())
            if self._handshake():
                self._serve()
        except TransportError as exc:
            logger.error("[rank %d] cannot reach the scheduler: %s", self.rank, exc)
            self._stop(self._codes.TRANSPORT_FAILED, str(exc))
        except Exception as exc:  # noqa: BLE001 - the model's thread must hear why the link ended
            logger.exception("[rank %d] the link to the scheduler failed", self.rank)
            self._stop(self._codes.TRANSPORT_FAILED, f"the link failed: {exc!r}")
        finally:
            self._flush()

    def _result(self, step: int, make: Callable[[], Result]) -> Outgoing:
        """Step `step`'s RESULT. One that cannot be made fails its step as a failed forward does: a
        REJECT names it, and the rank ends."""
        try:
            result = make()
        except Exception as exc:  # noqa: BLE001 - whatever it is, the scheduler must hear of the step
            logger.exception("[rank %d] step %d's RESULT could not be made", self.rank, step)
            self._stop(self._codes.STEP_FAILED, f"step {step}'s RESULT could not be made: {exc!r}")
            error = ProtocolError(RejectCode.INTERNAL, f"rank {self.rank} could not make step {step}'s RESULT: {exc}")
            return self.conversation.reject(step, error)
        return self.conversation.result(step, result)

    def _send(self, outgoing: Outgoing) -> None:
        self.endpoint.send(*outgoing)
        self._sent_at = time.monotonic()

    def _flush(self) -> None:
        while True:
            try:
                make = self._outbox.get_nowait()
            except queue.Empty:
                break
            self._send(make())
        while not self._released.empty():
            self._released.get_nowait()

    def _recv(self, timeout_s: float) -> Frame | ProtocolError | None:
        try:
            return self.endpoint.recv(max(1, math.ceil(timeout_s * 1000)))  # up: not a wake before it is due
        except ProtocolError as exc:
            return exc

    def _handshake(self) -> bool:
        deadline = time.monotonic() + self._timings.handshake_s
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self._stop(
                    self._codes.HANDSHAKE_REFUSED, f"handshake refused: no WELCOME within {self._timings.handshake_s:.0f} s of HELLO"
                )
                return False
            got = self._recv(min(left, self._timings.heartbeat_s))
            for event in self.conversation.receive(got) if got is not None else ():
                if isinstance(event, Welcomed):
                    self.endpoint.version = event.version
                    self.commands.put(Started())
                    return True
                if isinstance(event, WelcomeRefused):
                    self._stop(self._codes.HANDSHAKE_REFUSED, f"handshake refused: {event.message}")
                    return False
                if isinstance(event, ShutdownReceived):
                    self._stop(self._codes.HANDSHAKE_REFUSED, f"handshake refused: the scheduler refused this launch: {event.reason}")
                    return False
                if isinstance(event, Ignored):
                    logger.warning("[rank %d] %s", self.rank, event.reason)
        return False

    def _serve(self) -> None:
        timings = self._timings
        last_heard = time.monotonic()
        while not self._stopping.is_set():
            self._flush()
            now = time.monotonic()
            if self._stopped_at is not None:
                # Stopped: only the model thread's last answers are left to send.
                self._check_stuck(now)
                self._recv(timings.heartbeat_s)
                continue
            if now - last_heard > timings.peer_timeout_s:
                self._stop(
                    self._codes.SCHEDULER_SILENT,
                    f"nothing from the scheduler for {now - last_heard:.1f} s (peer_timeout_s {timings.peer_timeout_s})",
                )
                continue
            # Any frame tells the scheduler this rank lives (a READY, a RESULT): a heartbeat only
            # fills a silence.
            if now >= self._sent_at + timings.heartbeat_s:
                self._send(self.conversation.heartbeat())
            got = self._recv(max(0.001, self._sent_at + timings.heartbeat_s - time.monotonic()))
            if got is None:
                continue
            if isinstance(got, Frame):
                last_heard = time.monotonic()
            for event in self.conversation.receive(got):
                self._on_event(event)

    def _on_event(self, event: object) -> None:
        conv = self.conversation
        if isinstance(event, PrepareReceived):
            try:
                checked = self._check(event.step, event.prepare)
            except ProtocolError as exc:
                logger.error("[rank %d] reject step %d: %s", self.rank, event.step, exc)
                self._send(conv.reject(event.step, exc))
                return
            ready = conv.ready_or_ride(event.step)
            if ready is not None:
                self._send(ready)
                # ZeroMQ's I/O thread, just woken to write the READY, runs first where it shares
                # this CPU: building at once, the READY waited behind the build (at 2 ranks and
                # 256 rows PREPARE to every READY ~1.0 ms instead of ~1.1: docs/control_plane.md,
                # change 92).
                os.sched_yield()
            # Built once READY is out: only the checks could refuse the step, and its GO comes no
            # sooner than every rank's READY has reached the scheduler (at 2 ranks on two cores the
            # build was ~160-280 us of a ~1 ms PREPARE to every READY: docs/control_plane.md, change 91).
            self._staged = self._build(checked)
            if conv.ready_is_go:
                self._run_staged(event.step)
        elif isinstance(event, GoReceived):
            self._run_staged(event.step)
        elif isinstance(event, CutReceived):
            self._cut = event.step
        elif isinstance(event, AbortReceived):
            if event.dropped:
                logger.info("[rank %d] abort step %d: %s", self.rank, event.step, event.reason)
                self._staged = None
            # The scheduler sends whole page tables and sampling states after an ABORT: hold nothing
            # that could be stale.
            self._page_tables.drop()
            self._stateful.drop()
        elif isinstance(event, Refused):
            logger.error("[rank %d] reject step %d: %s", self.rank, event.step, event.error)
            self._send(conv.reject(event.step, event.error))
        elif isinstance(event, ShutdownReceived):
            logger.info("[rank %d] shutdown: %s", self.rank, event.reason)
            self._stop(self._codes.OK, event.reason)
        elif isinstance(event, Ignored):
            logger.warning("[rank %d] %s", self.rank, event.reason)

    def _run_staged(self, step: int) -> None:
        staged, self._staged = self._staged, None
        assert staged is not None and staged.step == step  # the conversation checked it
        self._last_sampled = staged.inputs.sample_seq_ids
        busy = self._busy_since is not None
        self.commands.put(Run(staged))
        # A CPU step's clears, while the model's thread is in the step before. An idle one takes
        # the step at once and clears it itself, with torch's threads (a prefill's pages).
        if busy and self._clear_ahead is not None:
            self._clear_ahead.clear(step, staged.prepare, staged.clears)

    def _check(self, step: int, prepare: Prepare) -> _Checked:
        """Everything that may refuse a step (its feedback rows' samples, its page tables against
        those held, its sampling states, its lengths against its tables): nothing here changes if
        it is refused, but for the held page tables and sampling-state ids, which the ABORT that
        follows a REJECT drops anyway."""
        feedback_rows, feedback_sources = self._feedback(prepare)
        table = self._page_tables.apply(prepare)
        self._stateful.accept(prepare)
        try:
            needed = pages_needed(prepare, table, self._page_size)
        except StepInputsError as exc:
            raise ProtocolError(RejectCode.LENGTH_MISMATCH, str(exc)) from exc
        return _Checked(step, prepare, table, needed, feedback_rows, feedback_sources)

    def _build(self, checked: _Checked) -> StagedStep:
        """A checked step's inputs, and everything else of it that needs no device work; rank 0's
        draw from torch's default generator (the inputs' unseeded uniforms)."""
        prepare = checked.prepare
        inputs = StepInputs.from_prepare(
            prepare, pad_page=self._pad_page, page_size=self._page_size, device=self._device, page_table=checked.page_table,
            samples=self.rank == 0, needed=checked.needed,
        )  # fmt: skip
        on_cpu = inputs.sample_rows.device.type == "cpu"
        on_device = None
        if checked.feedback_rows.shape[0] and not on_cpu:
            on_device = feedback_on_device(checked.feedback_rows, checked.feedback_sources, self._device)
        touches = self.rank == 0 and touches_states(prepare)
        outputs = ()
        if self.rank == 0 and on_cpu:
            outputs = HostOutputs.frame(prepare.decode_steps, inputs.sample_rows.shape[0], inputs.sampling.host.most_logprobs)
        return StagedStep(
            checked.step, prepare, inputs, checked.feedback_sources, checked.feedback_rows, on_device,
            touches_states=touches, outputs=outputs,
        )  # fmt: skip

    def _feedback(self, prepare: Prepare) -> tuple[np.ndarray, np.ndarray]:
        """Where each feedback row's token comes from: the sample of its sequence in the step GOed
        before this one. A sequence that step did not sample is refused by its id alone."""
        rows = prepare.feedback.nonzero()[0]
        if not rows.shape[0]:
            return rows, rows
        wanted = prepare.seq_ids[rows]
        order = np.argsort(self._last_sampled, kind="stable")
        sampled = self._last_sampled[order]
        at = sampled.searchsorted(wanted)
        hit = at < sampled.shape[0]
        hit[hit] = sampled[at[hit]] == wanted[hit]
        if not hit.all():
            missing = wanted[~hit]
            raise ProtocolError(
                RejectCode.FEEDBACK_WITHOUT_SAMPLE,
                f"feedback for sequences {missing.tolist()[:8]} that the step run before this one did not sample",
                seq_ids=tuple(int(s) for s in missing),
            )
        query_start = prepare.query_lens.cumsum(dtype=np.int64) - prepare.query_lens
        return query_start[rows], order[at].astype(np.int64)

    def _stop(self, code: int, reason: str) -> None:
        if self._stopped_at is None:
            self._stopped_at = time.monotonic()
            self.commands.put(Stop(code, reason))

    def _check_stuck(self, now: float) -> None:
        """After a stop, a model thread that stays inside a step (a collective whose peer is gone)
        would keep the process alive until the collective's own timeout: end the process."""
        busy = self._busy_since
        if busy is not None and now - max(busy, self._stopped_at or now) > self._timings.stuck_grace_s:
            logger.error("[rank %d] the model is stuck in a step after the stop; exiting", self.rank)
            self._flush()
            self._busy_since = None
            self._force_exit(int(self._codes.STEP_FAILED))
