"""The engine: drives the scheduler and the executors from the frontend process.

One thread (the engine loop) owns the scheduler and the scheduler endpoint; the HTTP server and the
CLI talk to it only through `submit`, `cancel` and `finish`, which post commands to its inbox, and
read tokens from a `RequestStream`. Data flows one way: request -> scheduler -> PREPARE -> executors
-> RESULT -> scheduler -> stream. This module imports no torch: the frontend process stays small
and never competes with rank 0's model step for the GIL.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from protocol.errors import ProtocolError, TPRuntimeError
from protocol.frames import (
    SUPPORTED_VERSIONS,
    Abort,
    Done,
    Frame,
    Go,
    Heartbeat,
    Hello,
    Ready,
    Reject,
    Result,
    Shutdown,
    Welcome,
    LAYOUT_VERSION,
)
from protocol.transport import SchedulerEndpoint
from scheduler.request import SamplingParams, token_array
from scheduler.scheduler import AdmissionError, RequestOutput, Scheduler, StepPlan
from tp_runtime.stats import STEP_LATENCY_BUCKETS, BucketCounter, EngineStats  # EngineStats: stats()'s type

log = logging.getLogger("tp_runtime.engine")


class EngineUnavailable(Exception):
    """The runtime cannot take requests: a rank failed, it is draining, or it has stopped."""


class EngineOverloaded(TPRuntimeError):
    """As many requests are in flight as the engine was told to hold: retry later."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class HandshakeError(Exception):
    """The ranks disagree with each other or with the frontend (weights, geometry, version)."""


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool
    finish_reason: str | None
    error: str | None = None


@dataclass(frozen=True)
class Health:
    ok: bool
    reason: str


@dataclass(frozen=True)
class EngineTimeouts:
    handshake_s: float = 600.0  # ranks load their weights before HELLO
    ready_s: float = 10.0  # PREPARE -> READY from every rank
    step_s: float = 120.0  # GO -> RESULT/DONE; a long CPU prefill chunk is slow
    peer_silence_s: float = 5.0  # no frame from a rank for this long while idle: it is gone
    heartbeat_s: float = 0.5


class RequestStream:
    """Token events of one request, readable with `async for` (server) or `for` (CLI)."""

    def __init__(self, request_id: int, prompt_len: int, loop: asyncio.AbstractEventLoop | None):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self._loop = loop
        self._async_queue: asyncio.Queue[TokenEvent] | None = asyncio.Queue() if loop else None
        self._queue: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()

    def push(self, event: TokenEvent) -> None:
        """Called on the engine thread."""
        if self._loop is not None and self._async_queue is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
            except RuntimeError:  # the server's loop has closed: nobody is listening any more
                pass
        else:
            self._queue.put(event)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        assert self._async_queue is not None, "submitted outside an event loop: iterate with `for`"
        while True:
            event = await self._async_queue.get()
            yield event
            if event.finished:
                return

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self._queue.get()
            yield event
            if event.finished:
                return


@dataclass(frozen=True)
class _Submit:
    stream: RequestStream
    prompt_token_ids: np.ndarray  # int32, made on the caller's thread
    params: SamplingParams


@dataclass(frozen=True)
class _Cancel:
    request_id: int


@dataclass(frozen=True)
class _Finish:
    request_id: int


@dataclass
class _Counters:
    rejects: int = 0
    aborts: int = 0
    tokens: int = 0
    finished: int = 0
    plan_s: float = 0.0
    protocol_s: float = 0.0
    step_s: float = 0.0
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
    ):
        """max_num_queued_reqs bounds the requests in flight (waiting + running, as vLLM's flag of
        that name): submit raises EngineOverloaded past it. 0 leaves it unbounded."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._scheduler = scheduler
        self._endpoint = endpoint
        self._world_size = world_size
        self._ranks = tuple(range(world_size))
        self._timeouts = timeouts
        self._inbox: queue.SimpleQueue[_Submit | _Cancel | _Finish] = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count(1)
        self._counters = _Counters()
        self._step_latency = BucketCounter(STEP_LATENCY_BUCKETS)
        self._max_in_flight = max_num_queued_reqs
        # submit() counts on the caller's thread, _apply() on the engine thread: submitted - applied
        # are in the inbox, the rest of the requests in flight are in _streams.
        self._submit_lock = threading.Lock()
        self._submitted = 0
        self._applied = 0
        self._last_heard: dict[int, float] = {}
        self._last_heartbeat = 0.0
        self._shutdown_reason = "shutdown"
        self._failure: str | None = None
        self._draining = False
        self._stopping = threading.Event()
        self._ready = threading.Event()
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

    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        if self._failure is not None:
            raise EngineUnavailable(self._failure)
        if self._draining or self._stopping.is_set():
            raise EngineUnavailable("the runtime is shutting down and takes no new requests")
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
                raise EngineOverloaded(
                    f"{in_flight} requests are in flight, the most this server takes (--max-num-queued-reqs): retry later",
                    retry_after_s=1.0,
                )
            self._submitted += 1
        stream = RequestStream(next(self._ids), prompt.shape[0], loop)
        self._inbox.put(_Submit(stream, prompt, params))
        return stream

    def cancel(self, request_id: int) -> None:
        self._inbox.put(_Cancel(request_id))

    def finish(self, request_id: int) -> None:
        self._inbox.put(_Finish(request_id))

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def health(self) -> Health:
        if self._failure is not None:
            return Health(False, self._failure)
        if not self._ready.is_set():
            return Health(False, "the ranks are still starting")
        if self._draining:
            return Health(False, "draining")
        if self._stopping.is_set():
            return Health(False, "shutting down")
        return Health(True, "ok")

    def stats(self) -> EngineStats:
        """The snapshot the engine thread published last (after its latest step or idle tick)."""
        return self._snapshot

    def drain(self, timeout_s: float) -> None:
        """Takes no new requests, lets the running ones finish for up to timeout_s, then stops."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self.shutdown(f"the server is shutting down: the request did not finish within the {timeout_s:g} s drain")

    def shutdown(self, reason: str = "shutdown") -> None:
        """Fails what is still running, tells every rank to exit and joins the loop."""
        if not self._stopping.is_set():
            self._shutdown_reason = reason
            self._stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def fail(self, reason: str) -> None:
        """Marks the runtime failed from outside the loop (e.g. the launcher saw a rank die)."""
        self._failure = self._failure or reason
        self._stopping.set()

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._handshake()
            self._ready.set()
            while not self._stopping.is_set():
                self._take_commands(block=not self._scheduler.has_work())
                self._deliver(self._scheduler.drain_outputs())
                if self._stopping.is_set():
                    break
                t0 = time.perf_counter()
                plan = self._scheduler.plan_step()
                t1 = time.perf_counter()
                self._counters.plan_s += t1 - t0
                self._deliver(self._scheduler.drain_outputs())
                if plan is not None:
                    self._run_step(plan, t1)
                self._check_liveness()
                self._snapshot = self._make_stats()
        except _RankFailure as exc:
            self._failure = self._failure or str(exc)
            log.error("%s", exc)
        except HandshakeError as exc:
            self._failure = f"handshake failed: {exc}"
            log.error("%s", self._failure)
        except Exception as exc:  # the loop must never die silently: fail everyone, say why
            self._failure = self._failure or f"engine loop failed: {exc!r}"
            log.exception("engine loop failed")
        finally:
            self._ready.set()
            reason = self._failure or self._shutdown_reason
            self._fail_all(reason)
            self._snapshot = self._make_stats()
            self._shutdown_ranks(reason)

    def _make_stats(self) -> EngineStats:
        """Called on the engine thread only (and in __init__, before it starts)."""
        c, scheduler = self._counters, self._scheduler.stats()
        cfg = self._scheduler.config
        return EngineStats(
            scheduler=scheduler,
            rejects_total=c.rejects,
            aborts_total=c.aborts,
            tokens_generated_total=c.tokens,
            requests_finished_total=c.finished,
            step_latency=self._step_latency.snapshot(),
            plan_time_s_total=c.plan_s,
            protocol_time_s_total=c.protocol_s,
            step_time_s_total=c.step_s,
            prompt_tokens_total=c.prompt_tokens,
            prefix_cache_queries_total=c.prompt_tokens if cfg.enable_prefix_cache else 0,
            prefix_cache_hits_total=scheduler.prefix_hit_pages_total * cfg.page_size,
        )

    def _handshake(self) -> None:
        hellos: dict[int, Hello] = {}
        deadline = time.monotonic() + self._timeouts.handshake_s
        while len(hellos) < self._world_size:
            if self._stopping.is_set():
                raise HandshakeError("stopped before every rank said HELLO")
            if time.monotonic() > deadline:
                missing = sorted(set(self._ranks) - set(hellos))
                raise HandshakeError(f"ranks {missing} did not say HELLO within {self._timeouts.handshake_s} s")
            received = self._endpoint.recv(200)
            if received is None or received.rank not in self._ranks:
                continue
            if received.error is not None:
                raise HandshakeError(f"rank {received.rank} sent a bad frame: {received.error}")
            body = received.frame.body
            if isinstance(body, Hello):
                hellos[received.rank] = body
                self._last_heard[received.rank] = time.monotonic()
        self._check_hellos(hellos)
        version = max(set(SUPPORTED_VERSIONS).intersection(*(h.versions for h in hellos.values())))
        self._endpoint.version = version
        self._endpoint.disconnected_ranks()  # connections that came and went during start-up
        self._endpoint.send_all(self._ranks, Welcome(version, LAYOUT_VERSION, self._world_size, hellos[0].geometry), 0)

    def _check_hellos(self, hellos: dict[int, Hello]) -> None:
        first = hellos[0]
        for rank, hello in sorted(hellos.items()):
            if hello.rank != rank:
                raise HandshakeError(f"the peer with identity rank-{rank} says it is rank {hello.rank}")
            if hello.world_size != self._world_size:
                raise HandshakeError(f"rank {rank} runs with world size {hello.world_size}, expected {self._world_size}")
            if hello.layout != LAYOUT_VERSION:
                raise HandshakeError(f"rank {rank} uses cache layout {hello.layout}, this frontend {LAYOUT_VERSION}")
            if not set(hello.versions) & set(SUPPORTED_VERSIONS):
                raise HandshakeError(
                    f"rank {rank} speaks protocol versions {list(hello.versions)}, this frontend {list(SUPPORTED_VERSIONS)}"
                )
            if hello.config_fingerprint != first.config_fingerprint:
                raise HandshakeError(
                    f"rank {rank} on host {hello.host or '?'} was started with other options (fingerprint "
                    f"{hello.config_fingerprint}) than rank 0 on host {first.host or '?'} ({first.config_fingerprint}): "
                    "every host must be given the same model and options"
                )
            if hello.model_fingerprint != first.model_fingerprint:
                raise HandshakeError(
                    f"rank {rank} loaded other weights (fingerprint {hello.model_fingerprint}) than rank 0 "
                    f"({first.model_fingerprint})"
                )
            if hello.geometry != first.geometry:
                raise HandshakeError(f"rank {rank} has cache geometry {hello.geometry}, rank 0 {first.geometry}")
        # The model's shape comes from the ranks; what the scheduler plans with must match it.
        cfg, geometry = self._scheduler.config, first.geometry
        for name in ("num_kv_pages", "page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_host_pages"):
            if getattr(geometry, name) != getattr(cfg, name):
                raise HandshakeError(
                    f"the ranks' cache has {name} {getattr(geometry, name)}, the scheduler plans with {getattr(cfg, name)}"
                )

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Submit | _Cancel | _Finish) -> None:
        if isinstance(command, _Submit):
            stream = command.stream
            try:
                self._scheduler.add_request(stream.request_id, command.prompt_token_ids, command.params)
            except Exception as exc:  # admission checks raced with the pool's state: say why
                stream.push(TokenEvent((), (), True, "error", str(exc)))
            else:
                self._streams[stream.request_id] = stream
                self._counters.prompt_tokens += stream.prompt_len
            self._applied += 1
        elif isinstance(command, _Cancel):
            if command.request_id in self._streams:
                self._scheduler.cancel(command.request_id)
        elif command.request_id in self._streams:
            self._scheduler.finish(command.request_id)

    def _run_step(self, plan: StepPlan, t_planned: float) -> None:
        self._endpoint.send_all(self._ranks, plan.prepare, plan.step)
        waiting = set(self._ranks)
        rejects: list[str] = []
        deadline = time.monotonic() + self._timeouts.ready_s
        while waiting:
            frame_rank = self._next_frame(deadline, plan.step, "READY")
            if frame_rank is None:
                rejects.append(f"ranks {sorted(waiting)} did not answer READY within {self._timeouts.ready_s} s")
                break
            rank, frame, error = frame_rank
            if error is not None:
                rejects.append(f"rank {rank} sent a bad frame: {error}")
                waiting.discard(rank)
            elif isinstance(frame.body, Ready) and frame.step == plan.step:
                waiting.discard(rank)
            elif isinstance(frame.body, Reject):
                rejects.append(f"rank {rank} rejected step {plan.step}: {frame.body.message}")
                waiting.discard(rank)
        if rejects:
            self._abort(plan, "; ".join(rejects))
            return
        self._endpoint.send_all(self._ranks, Go(), plan.step)
        self._counters.protocol_s += time.perf_counter() - t_planned
        result: Result | None = None
        waiting = set(self._ranks)
        deadline = time.monotonic() + self._timeouts.step_s
        while waiting:
            frame_rank = self._next_frame(deadline, plan.step, "RESULT")
            if frame_rank is None:
                raise _RankFailure(f"ranks {sorted(waiting)} did not finish step {plan.step} within {self._timeouts.step_s} s")
            rank, frame, error = frame_rank
            if error is not None:
                raise _RankFailure(f"rank {rank} sent a bad frame after GO: {error}")
            if frame.step != plan.step:
                continue
            if isinstance(frame.body, Result) and rank == 0:
                result = frame.body
                waiting.discard(rank)
            elif isinstance(frame.body, Done):
                waiting.discard(rank)
        assert result is not None
        t_done = time.perf_counter()
        outputs = self._scheduler.on_result(plan, result)
        self._counters.step_s += t_done - t_planned
        self._step_latency.observe(t_done - t_planned)
        self._deliver(outputs)

    def _abort(self, plan: StepPlan, reason: str) -> None:
        log.warning("step %d aborted: %s", plan.step, reason)
        self._endpoint.send_all(self._ranks, Abort(reason), plan.step)
        self._counters.rejects += 1
        self._counters.aborts += 1
        self._deliver(self._scheduler.on_abort(plan, reason))

    def _next_frame(self, deadline: float, step: int, waiting_for: str) -> tuple[int, Frame, ProtocolError | None] | None:
        """The next frame that matters for the step in flight; heartbeats only refresh liveness.

        A closed connection is checked before every receive, not only when one times out: the
        surviving ranks' heartbeats would otherwise keep the receive busy and hide a dead peer."""
        while True:
            if closed := self._endpoint.disconnected_ranks():
                raise _RankFailure(f"the connection of ranks {sorted(closed)} closed: their process ended")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            received = self._endpoint.recv(int(min(left, self._timeouts.heartbeat_s) * 1000) + 1)
            now = time.monotonic()
            if received is None:
                self._check_liveness(busy=True)
                continue
            if received.rank not in self._ranks:
                log.warning("ignored a frame from an unknown peer: %s", received.error)
                continue
            self._last_heard[received.rank] = now
            if received.error is not None:
                return received.rank, None, received.error  # type: ignore[return-value]
            body = received.frame.body
            if isinstance(body, Heartbeat):
                continue
            if isinstance(body, Shutdown):
                raise _RankFailure(f"rank {received.rank} is shutting down: {body.reason}")
            return received.rank, received.frame, None

    def _check_liveness(self, busy: bool = False) -> None:
        """A rank whose connection closed has died; while idle every rank heartbeats, and one that
        stays silent is gone (a hang). During a step the collective's own failure shows up as a
        SHUTDOWN from a rank, a closed connection, or the step timeout."""
        if closed := self._endpoint.disconnected_ranks():
            raise _RankFailure(f"the connection of ranks {sorted(closed)} closed: their process ended")
        while not busy:
            received = self._endpoint.recv(0)
            if received is None:
                break
            if received.rank not in self._ranks:
                continue
            self._last_heard[received.rank] = time.monotonic()
            if received.frame is not None and isinstance(received.frame.body, Shutdown):
                raise _RankFailure(f"rank {received.rank} is shutting down: {received.frame.body.reason}")
        now = time.monotonic()
        silent = [] if busy else [r for r in self._ranks if now - self._last_heard.get(r, now) > self._timeouts.peer_silence_s]
        if silent:
            raise _RankFailure(f"ranks {silent} stopped answering (no frame for {self._timeouts.peer_silence_s} s)")
        if not busy and now - self._last_heartbeat >= self._timeouts.heartbeat_s:
            self._last_heartbeat = now
            self._endpoint.send_all(self._ranks, Heartbeat(-1), 0)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        finished = 0
        tokens = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            tokens += len(out.token_ids)
            stream.push(TokenEvent(out.token_ids, out.logprobs, out.finished, out.finish_reason, out.error))
            if out.finished:
                finished += 1
                del self._streams[out.request_id]
        self._counters.tokens += tokens
        self._counters.finished += finished

    def _fail_all(self, reason: str) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.push(TokenEvent((), (), True, "error", reason))
            del self._streams[request_id]
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                command.stream.push(TokenEvent((), (), True, "error", reason))

    def _shutdown_ranks(self, reason: str) -> None:
        try:
            self._endpoint.send_all(self._ranks, Shutdown(reason), 0)
        except Exception as exc:  # a rank already gone cannot be told; the launcher reaps it
            log.info("could not tell every rank to shut down: %s", exc)


class _RankFailure(Exception):
    """A rank died, hung or sent garbage after GO: the group cannot continue."""
