"""The engine: drives the scheduler and the executors from the frontend process.

One thread (the engine loop, tp_runtime/step_loop.py) owns the scheduler, the conversation and the
scheduler endpoint; the HTTP server and the CLI talk to it only through `submit`, `cancel` and
`finish`, which post commands to its inbox and wake its poll, and read tokens from a
`RequestStream`. Data flows one way: request -> scheduler -> PREPARE -> executors -> RESULT ->
scheduler -> stream. Detokenizing and streaming happen on the reader's side of the stream, never on
the engine thread. This module imports no torch: the frontend process stays small and never
competes with rank 0's model step for the GIL.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from protocol.errors import TPRuntimeError
from protocol.transport import SchedulerEndpoint
from scheduler.request import SamplingParams, token_array
from scheduler.scheduler import AdmissionError, RequestOutput, Scheduler, StepPlan
from tp_runtime.recovery import CrashLoop, Fault, Recovery, carry_totals
from tp_runtime.stats import QUEUE_TIME_BUCKETS, BucketCounter, EngineStats  # EngineStats: stats()'s type
from tp_runtime.step_loop import EngineTimeouts, HandshakeError, RankFailure, StepLoop

log = logging.getLogger("tp_runtime.engine")

# The most a busy engine's published stats (/metrics) lag behind; an idle engine's are current. A
# snapshot walks the scheduler's state (~75 us on a loaded VM): five a second were ~3% of the engine
# thread's CPU at concurrency 32, for scrapes that come every few seconds at most.
STATS_INTERVAL_S = 1.0

__all__ = [
    "Engine", "EngineOverloaded", "EngineStats", "EngineTimeouts", "EngineUnavailable", "HandshakeError", "Health",
    "RequestStream",
]


class EngineUnavailable(TPRuntimeError):
    """The runtime cannot take requests: a rank failed, it is draining, or it has stopped.
    retry_after_s is set while the executor group restarts: the service will be back."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineOverloaded(TPRuntimeError):
    """As many requests are in flight as the engine was told to hold: retry later."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Health:
    ok: bool
    reason: str


class RequestStream:
    """One request's outputs (scheduler.RequestOutput, as the scheduler made them), readable with
    `async for` (server) or `for` (CLI)."""

    def __init__(self, request_id: int, prompt_len: int, loop: asyncio.AbstractEventLoop | None):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self._loop = loop
        # A reader on an event loop: events arrive on the loop (_arrive) and wake the one reader's
        # future; asyncio.Queue's general getters and putters were 12 calls of every streamed token.
        self._arrived: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def push(self, event: RequestOutput) -> None:
        """Called on the engine thread."""
        hand_off([(self, event)])

    def _arrive(self, event: RequestOutput) -> None:
        """On the reader's loop."""
        self._arrived.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._loop is not None, "submitted outside an event loop: iterate with `for`"
        arrived = self._arrived
        while True:
            if not arrived:
                self._waiter = self._loop.create_future()
                await self._waiter
            event = arrived.popleft()
            yield event
            if event.finished:
                return

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            event = self._queue.get()
            yield event
            if event.finished:
                return


def hand_off(events: Sequence[tuple[RequestStream, RequestOutput]]) -> None:
    """Gives each stream its event, on the engine thread: one wake-up of each reader's event loop
    for all of its streams (call_soon_threadsafe writes to the loop's self-pipe, and with 32 streams
    a step that was 32 writes and 32 wake-ups), a plain queue put for a reader with no loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
    for stream, event in events:
        if stream._loop is None:
            stream._queue.put(event)
        else:
            by_loop.setdefault(stream._loop, []).append((stream, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_arrive_all, items)
        except RuntimeError:  # the server's loop has closed: nobody is listening any more
            pass


def _arrive_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, event in items:
        stream._arrive(event)


@dataclass(frozen=True)
class _Submit:
    stream: RequestStream
    prompt_token_ids: np.ndarray  # int32, made on the caller's thread
    params: SamplingParams
    prompt_leader: int | None
    submitted_at: float


@dataclass(frozen=True)
class _Cancel:
    request_id: int


@dataclass(frozen=True)
class _Finish:
    request_id: int


@dataclass
class _Counters:
    tokens: int = 0
    finished: int = 0
    prompt_tokens: int = 0


class Engine:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        endpoint: SchedulerEndpoint,
        world_size: int,
        model_name: str,
        max_model_len: int,
        timeouts: EngineTimeouts = EngineTimeouts(),
        max_num_queued_reqs: int = 0,
        recovery: Recovery | None = None,
    ):
        """max_num_queued_reqs bounds the requests in flight (waiting + running, as vLLM's flag of
        that name): submit raises EngineOverloaded past it. 0 leaves it unbounded.
        recovery: under a supervised launch, a failed executor group is replaced by a new one from
        recovery.groups (tp_runtime/recovery.py); without it a failed rank ends the engine."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._world_size = world_size
        self._timeouts = timeouts
        self._scheduler = scheduler
        self._endpoint = endpoint
        self._endpoint_lock = threading.Lock()  # the HTTP thread wakes the endpoint the engine may swap
        self._recovery = recovery
        self._loop = self._new_loop(scheduler, endpoint, None)
        self._submits: dict[int, _Submit] = {}  # under recovery: how to submit a request again
        self._carried: tuple[object, object] | None = None  # dead groups' SchedulerStats and PeerStats totals
        if recovery is not None:
            recovery.groups.wake = self._wake
        self._inbox: queue.SimpleQueue[_Submit | _Cancel | _Finish] = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}
        self._waiting_since: dict[int, float] = {}  # submitted, not yet in a PREPARE
        self._ids = itertools.count(1)
        self._counters = _Counters()
        self._queue_time = BucketCounter(QUEUE_TIME_BUCKETS)
        self._max_in_flight = max_num_queued_reqs
        # submit() counts on the caller's thread, _apply() on the engine thread: submitted - applied
        # are in the inbox, the rest of the requests in flight are in _streams.
        self._submit_lock = threading.Lock()
        self._submitted = 0
        self._applied = 0
        self._shutdown_reason = "the runtime shut down"
        self._failure: str | None = None
        self._draining = False
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._down = threading.Event()  # failed, or the engine thread has ended
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._snapshot = self._make_stats()

    # ---- called from other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Blocks until every rank has shaken hands; raises EngineUnavailable if that failed."""
        if not self._ready.wait(timeout_s) and self._failure is None:
            raise EngineUnavailable(f"the ranks did not finish the handshake within {timeout_s} s")
        if self._failure is not None:
            raise EngineUnavailable(self._failure)

    def submit(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, prompt_leader: int | None = None
    ) -> RequestStream:
        """Queue one request. prompt_leader: the request id of an earlier submit with the same
        prompt (n samples of one prompt): this one shares its prompt's KV pages instead of
        computing them again."""
        if self._failure is not None:
            raise EngineUnavailable(self._failure)
        if self._draining or self._stopping.is_set():
            raise EngineUnavailable("the runtime is shutting down and takes no new requests")
        recovery = self._recovery
        if recovery is not None and recovery.expired:
            raise EngineUnavailable(
                f"the executor group is restarting ({recovery.reason}) and took longer than --recovery-timeout "
                f"{recovery.policy.recovery_timeout_s:g} s: retry later", retry_after_s=recovery.retry_after_s(),
            )
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        try:
            # Converted here, on the HTTP thread: reading a long prompt's ints was most of what
            # admitting 256 shared-prefix requests cost the engine thread (docs/scheduler.md).
            prompt = token_array(prompt_token_ids)
        except ValueError as exc:
            raise AdmissionError(f"invalid prompt: {exc}") from exc
        self._scheduler.check_admission(prompt.shape[0], params)
        with self._submit_lock:
            in_flight = self._submitted - self._applied + len(self._streams)
            if self._max_in_flight and in_flight >= self._max_in_flight:
                if recovery is not None and recovery.recovering_since is not None:
                    raise EngineUnavailable(
                        f"{in_flight} requests wait for the executor group to restart, the most this server holds "
                        "(--max-num-queued-reqs): retry later", retry_after_s=recovery.retry_after_s(),
                    )
                raise EngineOverloaded(
                    f"{in_flight} requests are in flight, the most this server takes (--max-num-queued-reqs): retry later",
                    retry_after_s=1.0,
                )
            self._submitted += 1
        stream = RequestStream(next(self._ids), prompt.shape[0], loop)
        self._post(_Submit(stream, prompt, params, prompt_leader, time.monotonic()))
        return stream

    def cancel(self, request_id: int) -> None:
        self._post(_Cancel(request_id))

    def finish(self, request_id: int) -> None:
        self._post(_Finish(request_id))

    def _post(self, command: _Submit | _Cancel | _Finish) -> None:
        self._inbox.put(command)
        self._wake()

    def _wake(self) -> None:
        with self._endpoint_lock:
            self._endpoint.wake()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def wait_down(self, timeout_s: float | None = None) -> bool:
        """Blocks until the runtime has failed or stopped (the engine thread ended, or shutdown()
        returned); False after timeout_s."""
        return self._down.wait(timeout_s)

    def health(self) -> Health:
        if self._failure is not None:
            return Health(False, self._failure)
        if self._recovery is not None and self._recovery.recovering_since is not None:
            return Health(False, f"restarting the executor group: {self._recovery.reason}")
        if not self._ready.is_set():
            return Health(False, "the ranks are still starting")
        if self._draining:
            return Health(False, "draining")
        if self._stopping.is_set():
            return Health(False, "shutting down")
        return Health(True, "ok")

    def retry_after_s(self) -> float | None:
        """While the executor group restarts, when a refused request may try again; else None."""
        recovery = self._recovery
        return recovery.retry_after_s() if recovery is not None and recovery.recovering_since is not None else None

    def stats(self) -> EngineStats:
        """The snapshot the engine thread published last (at most a second old while steps run; made
        as the last one ended when idle)."""
        return self._snapshot

    def drain(self, timeout_s: float) -> None:
        """Takes no new requests, lets the running ones finish for up to timeout_s, then stops."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self.shutdown(f"the server is shutting down: the request did not finish within the {timeout_s:g} s drain")

    def shutdown(self, reason: str = "the runtime shut down") -> None:
        """Fails what is still running, tells every rank to exit and joins the loop."""
        if not self._stopping.is_set():
            self._shutdown_reason = reason
            self._stopping.set()
            self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self._down.set()  # also when the loop is stuck past the join: the caller goes on without it

    def close(self) -> None:
        """After shutdown: closes the endpoint of the last executor group."""
        with self._endpoint_lock:
            self._endpoint.close()

    def fail(self, reason: str) -> None:
        """Marks the runtime failed from outside the loop (e.g. the launcher saw a rank die)."""
        self._failure = self._failure or reason
        self._stopping.set()
        self._down.set()
        self._wake()

    # ---- the engine thread ---------------------------------------------------------------------

    def _new_loop(self, scheduler: Scheduler, endpoint: SchedulerEndpoint, previous: StepLoop | None) -> StepLoop:
        loop = StepLoop(
            scheduler=scheduler,
            endpoint=endpoint,
            world_size=self._world_size,
            timeouts=self._timeouts,
            deliver=self._deliver,
            on_scheduled=self._scheduled,
            check_deaths=None if self._recovery is None else self._recovery.check_deaths,
        )
        if previous is not None:  # the totals /metrics shows go on across groups
            loop.counters, loop.step_latency, loop.pages_cleared = previous.counters, previous.step_latency, previous.pages_cleared
        return loop

    def _run(self) -> None:
        try:
            while True:
                try:
                    self._serve_group()
                    break
                except RankFailure as exc:
                    if self._recovery is None or self._stopping.is_set():
                        raise
                    log.error("%s: restarting the executor group", exc)
                    self._replace_group(str(exc))
        except CrashLoop as exc:
            self._failure = self._failure or str(exc)
            log.error("%s", exc)
        except RankFailure as exc:
            self._failure = self._failure or str(exc)
            log.error("%s", exc)
        except HandshakeError as exc:
            self._failure = self._failure or f"handshake failed: {exc}"
            log.error("%s", self._failure)
        except Exception as exc:  # the loop must never die silently: fail everyone, say why
            self._failure = self._failure or f"engine loop failed: {exc!r}"
            log.exception("engine loop failed")
        finally:
            try:
                self._ready.set()
                reason = self._failure or self._shutdown_reason
                self._fail_all(reason, Fault.RUNTIME_DOWN if self._failure is not None else Fault.SHUTDOWN)
                self._snapshot = self._make_stats()
                self._loop.shutdown_ranks(reason)
            finally:  # whatever the clean-up met: the frontend's main thread waits for this
                self._down.set()

    def _serve_group(self) -> None:
        """The handshake of the executor group, then its steps until the engine stops (RankFailure
        when the group dies or hangs)."""
        loop = self._loop
        loop.handshake(self._while_starting)
        if self._recovery is not None:
            self._recovery.group_ready()
        self._ready.set()
        published, was_busy = 0.0, False
        while not self._stopping.is_set():
            self._take_commands()
            self._deliver(self._scheduler.drain_outputs())
            if self._stopping.is_set():
                break
            loop.iterate(wait_s=0.5)
            # Not once per frame (several per step), nor on every heartbeat of an idle loop, but as
            # soon as the last step in flight has ended and otherwise at most every STATS_INTERVAL_S
            # (while idle, only the socket's counters of strangers can move).
            now, busy = time.monotonic(), loop.busy
            if (was_busy and not busy) or now - published >= STATS_INTERVAL_S:
                self._snapshot = self._make_stats()
                published = now
            was_busy = busy

    def _while_starting(self) -> bool:
        """Every 200 ms of a handshake: the launcher's reports of dead groups, the recovery deadline
        of the requests that wait; True to stop."""
        recovery = self._recovery
        if recovery is not None:
            recovery.check_deaths()
            if recovery.timed_out() and not recovery.expired:
                self._expire_waiting(recovery)
            self._snapshot = self._make_stats()
        return self._stopping.is_set()

    # ---- recovery (tp_runtime/recovery.py) ---------------------------------------------------------

    def _replace_group(self, cause: str) -> None:
        """The serving group died or hung: nothing it wrote is trusted. Its requests fail now, the
        group is killed and counted (CrashLoop past the window), and a new one is opened under a new
        run id and key, with a new scheduler (every page marked, no prefix snapshot, no host copy).
        Requests that no step had taken wait for it and start again from their prompts."""
        recovery = self._recovery
        assert recovery is not None
        recovery.begin(cause)  # /health: 503 from here
        kept = self._fail_started_requests(cause)
        self._snapshot = self._make_stats()
        recovery.end_group(cause)
        old_scheduler, old_endpoint = self._scheduler, self._endpoint
        scheduler_totals, peer_totals = old_scheduler.stats(), old_endpoint.peer_stats()
        if self._carried is not None:
            scheduler_totals = carry_totals(self._carried[0], scheduler_totals)
            peer_totals = carry_totals(self._carried[1], peer_totals)
        self._carried = (scheduler_totals, peer_totals)
        with self._endpoint_lock:  # the old socket first: across hosts the new one binds the same --frame-port
            old_endpoint.close()
            endpoint = self._endpoint = recovery.groups.open_group()
        self._scheduler = Scheduler(old_scheduler.config)
        self._loop = self._new_loop(self._scheduler, endpoint, self._loop)
        for command in kept:
            self._scheduler.add_request(
                command.stream.request_id, command.prompt_token_ids, command.params, prompt_leader=command.prompt_leader
            )
        log.warning("executor group replaced: %d waiting requests start again from their prompts", len(kept))

    def _fail_started_requests(self, cause: str) -> list[_Submit]:
        """Fails every request a step of the dead group had taken; returns, in their order, the
        waiting ones that none had."""
        untouched = [rid for rid in self._scheduler.waiting_requests() if rid in self._waiting_since]
        keep = set(untouched)
        for request_id, stream in list(self._streams.items()):
            if request_id not in keep:
                stream.push(RequestOutput(request_id, (), (), True, "error", cause, fault=Fault.RANK_FAILURE))
                self._forget(request_id)
        return [self._submits[rid] for rid in untouched]

    def _expire_waiting(self, recovery: Recovery) -> None:
        """Recovery has taken longer than --recovery-timeout: the waiting requests fail (503 with
        Retry-After where no answer had started), and new ones are refused until a group is back."""
        recovery.expired = True
        reason = (
            f"no executor group came back within --recovery-timeout {recovery.policy.recovery_timeout_s:g} s "
            f"({recovery.reason}): retry later"
        )
        log.error("%s", reason)
        for request_id in self._streams:
            self._scheduler.cancel(request_id)
        self._scheduler.drain_outputs()  # the cancellations' outputs: their streams end with the reason
        self._fail_all(reason, Fault.RECOVERY_TIMEOUT)

    def _forget(self, request_id: int) -> None:
        del self._streams[request_id]
        self._waiting_since.pop(request_id, None)
        self._submits.pop(request_id, None)

    def _make_stats(self) -> EngineStats:
        """Called on the engine thread only (and in __init__, before it starts)."""
        c, lc, scheduler = self._counters, self._loop.counters, self._scheduler.stats()
        peers = self._endpoint.peer_stats()
        if self._carried is not None:
            scheduler, peers = carry_totals(self._carried[0], scheduler), carry_totals(self._carried[1], peers)
        recovery = self._recovery
        return EngineStats(
            scheduler=scheduler,
            rejects_total=lc.rejects,
            aborts_total=lc.aborts,
            tokens_generated_total=c.tokens,
            requests_finished_total=c.finished,
            step_latency=self._loop.step_latency.snapshot(),
            plan_time_s_total=lc.plan_s,
            protocol_time_s_total=lc.protocol_s,
            step_time_s_total=lc.step_s,
            model_busy_s_total=lc.model_busy_s,
            model_idle_s_total=lc.model_idle_s,
            steps_planned_ahead_total=lc.planned_ahead,
            forwards_total=lc.forwards,
            steps_cut_total=lc.cuts,
            peer_longest_silence_s=lc.longest_silence_s,
            prompt_tokens_total=c.prompt_tokens,
            prefix_cache_queries_total=scheduler.prefix_queries_total,
            prefix_cache_hits_total=scheduler.prefix_hits_total,
            queue_time=self._queue_time.snapshot(),
            pages_cleared_per_step=self._loop.pages_cleared.snapshot(),
            peer_stats=peers,
            executor_restarts_total=recovery.restarts_total if recovery is not None else 0,
            recovery_time=recovery.times.snapshot() if recovery is not None else None,
        )

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._apply(command)

    def _apply(self, command: _Submit | _Cancel | _Finish) -> None:
        if isinstance(command, _Submit):
            stream = command.stream
            try:
                self._scheduler.add_request(
                    stream.request_id, command.prompt_token_ids, command.params, prompt_leader=command.prompt_leader
                )
            except Exception as exc:  # admission checks raced with the pool's state: say why
                stream.push(RequestOutput(stream.request_id, (), (), True, "error", str(exc)))
            else:
                self._streams[stream.request_id] = stream
                self._waiting_since[stream.request_id] = command.submitted_at
                self._counters.prompt_tokens += stream.prompt_len
                if self._recovery is not None:
                    self._submits[stream.request_id] = command
            self._applied += 1
        elif isinstance(command, _Cancel):
            if command.request_id in self._streams:
                self._scheduler.cancel(command.request_id)
        elif command.request_id in self._streams:
            self._scheduler.finish(command.request_id)

    def _scheduled(self, plan: StepPlan) -> None:
        """A PREPARE went out: its new requests' queue time ends here."""
        if not self._waiting_since:
            return
        now = time.monotonic()
        for rid in plan.prepare.seq_ids.tolist():
            since = self._waiting_since.pop(rid, None)
            if since is not None:
                self._queue_time.observe(now - since)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        finished = 0
        tokens = 0
        events = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            tokens += len(out.token_ids)
            if out.error is not None and out.fault is None:  # the scheduler failed it: its own step
                out.fault = Fault.STEP
            events.append((stream, out))
            if out.finished:
                finished += 1
                self._forget(out.request_id)
        hand_off(events)
        self._counters.tokens += tokens
        self._counters.finished += finished

    def _fail_all(self, reason: str, fault: str) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.push(RequestOutput(request_id, (), (), True, "error", reason, fault=fault))
            self._forget(request_id)
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                command.stream.push(RequestOutput(command.stream.request_id, (), (), True, "error", reason, fault=fault))
                self._applied += 1
