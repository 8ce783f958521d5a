"""The executor process of one rank: handshake, the PREPARE/READY/GO loop, heartbeats.

The loop is single-threaded and owns the endpoint: it waits on the socket with a timeout that
expires at the next heartbeat or at the scheduler-silence deadline, whichever comes first. A
forward (GO) runs to completion inside the loop; heartbeats stop meanwhile, and the scheduler's
step timeout covers that window.

Order of a PREPARE, and why (DESIGN.md):
1. envelope (version, layout, run id), step == last + 1, then validate_prepare against the local
   geometry, then the page-table deltas against the tables held from the previous step (a base
   that does not match is a REJECT): nothing touches the device before the frame is known good;
2. StepInputs.from_prepare: the step's input copies are queued on the model stream first;
3. offload (reads pages before anything in this step writes them), poison (debug), restore, clear:
   all queued on the same stream, so the clear is ordered after the input copies and before the
   forward or CUDA graph replay without a synchronization;
4. READY. On GO every rank runs the forward with its peers; on ABORT the staged step is dropped.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from executor.cache import KVCache
from executor.inputs import StepInputs, StepInputsError
from executor.options import ExecutorOptions
from executor.sampler import SamplingBatch, sample
from protocol import validate
from protocol.errors import ProtocolError, RejectCode, TransportError
from protocol.frames import (
    LAYOUT_VERSION,
    SUPPORTED_VERSIONS,
    Abort,
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
from protocol.page_tables import HeldPageTables

if TYPE_CHECKING:
    from protocol.curve import ClientCurve

logger = logging.getLogger("tp_runtime.executor")


class ExitCode(enum.IntEnum):
    OK = 0  # SHUTDOWN received
    HANDSHAKE_REFUSED = 2  # WELCOME disagreed with this rank, or SHUTDOWN/timeout before it
    SCHEDULER_SILENT = 3  # nothing from the scheduler for peer_timeout_s
    STEP_FAILED = 4  # the forward raised: peers may be gone, the collectives are unusable
    TRANSPORT_FAILED = 5  # the endpoint could not send


class ExecutorStartError(RuntimeError):
    """The executor cannot start: options, device or process group do not fit together."""


class HandshakeError(RuntimeError):
    """The scheduler's WELCOME does not describe what this rank can run."""


class StepModel(Protocol):
    """What the loop needs of a model: LlamaModel, a CUDA graph runner around it, or a test stand-in."""

    fingerprint: str

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None: ...


class Endpoint(Protocol):
    version: int  # the protocol version frames are stamped with; WELCOME sets it

    def send(self, body: Any, step: int) -> None: ...

    def recv(self, timeout_ms: int) -> Frame | None: ...


@dataclass
class StagedStep:
    step: int
    inputs: StepInputs


class Worker:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        endpoint: Endpoint,
        cache: KVCache,
        model: StepModel,
        geometry: CacheGeometry,
        options: ExecutorOptions,
        run_id: str,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.endpoint = endpoint
        self.cache = cache
        self.model = model
        self.geometry = geometry
        self.options = options
        self.run_id = run_id
        self.version = 0  # set by WELCOME
        # Highest step number known to be used: a PREPARE must carry last_step + 1.
        self.last_step = 0
        self.staged: StagedStep | None = None
        self.page_tables = HeldPageTables()
        self.last_heard = time.monotonic()

    def _info(self, message: str, *args: object) -> None:
        logger.info(f"[rank {self.rank}] {message}", *args)

    def _error(self, message: str, *args: object) -> None:
        logger.error(f"[rank {self.rank}] {message}", *args)

    def run(self) -> int:
        try:
            self._handshake()
        except HandshakeError as exc:
            self._error("handshake refused: %s", exc)
            return ExitCode.HANDSHAKE_REFUSED
        except TransportError as exc:
            self._error("cannot reach the scheduler: %s", exc)
            return ExitCode.TRANSPORT_FAILED
        try:
            return self._loop()
        except TransportError as exc:
            self._error("cannot reach the scheduler: %s", exc)
            return ExitCode.TRANSPORT_FAILED

    # -- handshake ---------------------------------------------------------------------------

    def _handshake(self) -> None:
        self.endpoint.send(
            Hello(
                rank=self.rank,
                world_size=self.world_size,
                versions=SUPPORTED_VERSIONS,
                layout=LAYOUT_VERSION,
                model_fingerprint=self.model.fingerprint,
                geometry=self.geometry,
                config_fingerprint=self.options.fingerprint(),
                host=socket.gethostname(),
            ),
            step=0,
        )
        deadline = time.monotonic() + self.options.handshake_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HandshakeError(
                    f"no WELCOME within {self.options.handshake_timeout_s:.0f} s of HELLO"
                )
            try:
                frame = self.endpoint.recv(timeout_ms=max(1, int(remaining * 1000)))
            except ProtocolError as exc:
                self._error("dropped a bad frame while waiting for WELCOME: %s", exc)
                continue
            if frame is None:
                continue
            if frame.run_id != self.run_id:
                self._error("dropped a frame of run %r while waiting for WELCOME", frame.run_id)
                continue
            body = frame.body
            if isinstance(body, Shutdown):
                raise HandshakeError(f"the scheduler refused this launch: {body.reason}")
            if isinstance(body, Heartbeat):
                continue
            if not isinstance(body, Welcome):
                self._error("ignored %s while waiting for WELCOME", frame.type.name)
                continue
            self._accept_welcome(body, frame)
            self.last_heard = time.monotonic()
            return

    def _accept_welcome(self, welcome: Welcome, frame: Frame) -> None:
        if welcome.version not in SUPPORTED_VERSIONS:
            raise HandshakeError(
                f"WELCOME chose protocol version {welcome.version}; this rank supports "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        if welcome.layout != LAYOUT_VERSION:
            raise HandshakeError(
                f"WELCOME chose cache layout {welcome.layout}; this rank uses layout {LAYOUT_VERSION}"
            )
        if welcome.world_size != self.world_size:
            raise HandshakeError(
                f"WELCOME says world size {welcome.world_size}; this rank was started in a world "
                f"of {self.world_size}"
            )
        try:
            validate.check_geometry(self.geometry, welcome.geometry, who="WELCOME")
        except ProtocolError as exc:
            raise HandshakeError(f"{exc.message}; this rank cannot run it") from exc
        self.version = welcome.version
        self.endpoint.version = welcome.version
        self.last_step = frame.step
        self._info(
            "welcomed: protocol %d, layout %d, world %d, %d pages of %d",
            welcome.version,
            welcome.layout,
            welcome.world_size,
            self.geometry.num_kv_pages,
            self.geometry.page_size,
        )

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> int:
        interval = self.options.heartbeat_interval_s
        silence = self.options.peer_timeout_s
        next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if now - self.last_heard > silence:
                self._error(
                    "nothing from the scheduler for %.1f s (peer_timeout_s %.1f); exiting",
                    now - self.last_heard,
                    silence,
                )
                return ExitCode.SCHEDULER_SILENT
            if now >= next_beat:
                self.endpoint.send(Heartbeat(rank=self.rank), step=self.last_step)
                next_beat = now + interval
            wait_s = min(next_beat, self.last_heard + silence) - now
            try:
                frame = self.endpoint.recv(timeout_ms=max(1, int(wait_s * 1000)))
            except ProtocolError as exc:
                # Unauthenticated or undecodable: it does not count as hearing from the scheduler.
                self._reject(self.last_step + 1, exc.code, exc.message)
                continue
            if frame is None:
                continue
            exit_code = self._dispatch(frame)
            if exit_code is not None:
                return exit_code
            # Counted from the end of the handling: a long forward is not silence of the scheduler.
            self.last_heard = time.monotonic()

    def _dispatch(self, frame: Frame) -> int | None:
        body = frame.body
        sequenced = isinstance(body, Prepare) and self.staged is None
        try:
            validate.check_envelope(
                frame,
                version=self.version,
                layout=LAYOUT_VERSION,
                run_id=self.run_id,
                expected_step=self.last_step + 1 if sequenced else None,
            )
        except ProtocolError as exc:
            self._reject(frame.step, exc.code, exc.message)
            return None
        if isinstance(body, Heartbeat):
            return None
        if isinstance(body, Prepare):
            self._on_prepare(frame.step, body)
            return None
        if isinstance(body, Go):
            return self._on_go(frame.step)
        if isinstance(body, Abort):
            self._on_abort(frame.step, body)
            return None
        if isinstance(body, Shutdown):
            self._info("shutdown: %s", body.reason)
            return ExitCode.OK
        self._reject(frame.step, RejectCode.UNEXPECTED_FRAME, f"{frame.type.name} is not valid after WELCOME")
        return None

    def _reject(self, step: int, code: RejectCode, message: str) -> None:
        self._error("reject step %d: %s: %s", step, RejectCode(code).name, message)
        self.endpoint.send(Reject(rank=self.rank, code=int(code), message=message), step=step)

    def _on_prepare(self, step: int, prepare: Prepare) -> None:
        if self.staged is not None:
            self._reject(
                step,
                RejectCode.UNEXPECTED_FRAME,
                f"PREPARE for step {step} while step {self.staged.step} is staged (needs GO or ABORT)",
            )
            return
        self.last_step = step
        try:
            validate.validate_prepare(prepare, self.geometry)
            if prepare.feedback.any():
                raise ProtocolError(
                    RejectCode.FEEDBACK_WITHOUT_SAMPLE,
                    "this executor keeps no samples between steps: feedback rows need the overlapped loop",
                )
            inputs = StepInputs.from_prepare(
                prepare,
                pad_page=self.cache.pad_page,
                page_size=self.cache.page_size,
                device=self.cache.device,
                page_table=self.page_tables.apply(prepare),
            )
        except ProtocolError as exc:
            self._reject(step, exc.code, exc.message)
            return
        except StepInputsError as exc:
            self._reject(step, RejectCode.LENGTH_MISMATCH, str(exc))
            return
        self._stage_cache(prepare)
        self.staged = StagedStep(step=step, inputs=inputs)
        self.endpoint.send(Ready(rank=self.rank), step=step)

    def _stage_cache(self, prepare: Prepare) -> None:
        cache = self.cache
        if prepare.offload_pages.size:
            cache.offload(prepare.offload_pages, prepare.offload_slots)
        if self.options.debug_poison_freed and prepare.poison_pages.size:
            cache.poison_pages(prepare.poison_pages)
        if prepare.restore_pages.size:
            cache.restore(prepare.restore_pages, prepare.restore_slots)
        if not self.options.debug_skip_clears and prepare.cleared_pages.size:
            cache.clear_pages(prepare.cleared_pages)

    def _on_abort(self, step: int, abort: Abort) -> None:
        # ABORT names the step it ends, so a step whose PREPARE never decoded here still counts.
        self.last_step = max(self.last_step, step)
        # The scheduler sends whole page tables after an abort: hold nothing that could go stale.
        self.page_tables.drop()
        if self.staged is not None and self.staged.step <= step:
            self._info("abort step %d: %s", self.staged.step, abort.reason)
            self.staged = None

    def _on_go(self, step: int) -> int | None:
        staged = self.staged
        if staged is None or staged.step != step:
            have = "nothing" if staged is None else f"step {staged.step}"
            self._reject(step, RejectCode.UNEXPECTED_FRAME, f"GO for step {step} but {have} is staged")
            return None
        self.staged = None
        started = time.perf_counter()
        try:
            logits = self.model.forward(staged.inputs, self.cache)
            body: Result | Done = (
                self._sample(staged.inputs, logits, started) if self.rank == 0 else Done(rank=self.rank)
            )
        except Exception as exc:  # noqa: BLE001 - any failure here leaves the collectives unusable
            logger.exception(f"[rank {self.rank}] step {step} failed in the forward; exiting")
            self._reject(step, RejectCode.INTERNAL, f"rank {self.rank} failed in the forward: {exc}")
            return ExitCode.STEP_FAILED
        self.endpoint.send(body, step=step)
        return None

    def _sample(self, inputs: StepInputs, logits: torch.Tensor | None, started: float) -> Result:
        if logits is None:
            raise RuntimeError("the model returned no logits on rank 0")
        rows = inputs.sample_rows.shape[0]
        if logits.shape[0] != rows:
            raise RuntimeError(f"the model returned {logits.shape[0]} logits rows for {rows} sampled rows")
        out = sample(
            logits,
            SamplingBatch(
                temperature=inputs.temperature,
                top_p=inputs.top_p,
                top_k=inputs.top_k,
                seeds=inputs.seeds,
                positions=inputs.sample_positions,
            ),
        )
        return Result(
            seq_ids=np.ascontiguousarray(inputs.sample_seq_ids, dtype=np.int64),
            token_ids=out.token_ids.to("cpu", torch.int32).numpy(),
            logprobs=out.logprobs.to("cpu", torch.float32).numpy(),
            finite=out.finite.to("cpu", torch.uint8).numpy(),
            step_time_us=int((time.perf_counter() - started) * 1e6),
        )


# -- process entry -------------------------------------------------------------------------------


def pick_device(options: ExecutorOptions) -> torch.device:
    if options.device == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if options.device.startswith("cuda:"):
        return torch.device(options.device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if options.device == "cuda":
        raise ExecutorStartError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device("cpu")


def build_geometry(options: ExecutorOptions, config: Any) -> CacheGeometry:
    if options.max_model_len > config.max_position_embeddings:
        raise ExecutorStartError(
            f"max_model_len {options.max_model_len} exceeds the model's context of "
            f"{config.max_position_embeddings} positions"
        )
    return CacheGeometry(
        num_kv_pages=options.num_kv_pages,
        page_size=options.page_size,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        kv_dtype=options.kv_cache_dtype,
        vocab_size=config.vocab_size,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        num_host_pages=options.num_host_pages,
    )


def run_executor(
    options: ExecutorOptions,
    *,
    rank: int,
    world_size: int,
    address: str,
    key: bytes,
    run_id: str,
    load: Callable[..., Any] | None = None,
    curve: ClientCurve | None = None,
) -> int:
    """Load this rank's shard, allocate its cache, connect to the scheduler and serve steps.

    torch.distributed must already be initialized when world_size > 1 (the launcher does it).
    `load` replaces executor.model.load_model (same signature); the loop tests pass a stand-in.
    `curve` (protocol.curve.ClientCurve) makes the connection a CurveZMQ client, across hosts.
    """
    if world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ExecutorStartError(
            f"world size {world_size} needs torch.distributed initialized before run_executor"
        )
    # Imported when a rank starts, not with this module: the transport pulls in zmq and the model
    # package the weight readers.
    from executor.allocator import retain_freed_memory
    from executor.model import TORCH_DTYPES
    from protocol.transport import ExecutorEndpoint

    if load is None:
        from executor.model import load_model as load

    retain_freed_memory()
    device = pick_device(options)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = load(
        options.model,
        rank=rank,
        world_size=world_size,
        dtype=TORCH_DTYPES[options.dtype],
        device=device,
        weight_format=options.weight_format,
        progress=rank == 0,
    )
    geometry = build_geometry(options, model.config)
    cache = KVCache(
        num_kv_pages=options.num_kv_pages,
        page_size=options.page_size,
        num_layers=model.config.num_layers,
        num_kv_heads=model.shard.local_kv_heads,
        head_dim=model.config.head_dim,
        kv_dtype=options.kv_cache_dtype,
        device=device,
        num_host_pages=options.num_host_pages,
        poison=options.debug_poison_cache,
    )
    step_model: StepModel = model
    if device.type == "cuda" and options.cuda_graphs:
        from executor.cuda_graphs import DecodeGraphRunner

        step_model = DecodeGraphRunner(
            model, cache, geometry=geometry, batch_sizes=options.cuda_graph_batch_sizes
        )
    endpoint = ExecutorEndpoint(address, key, run_id, rank, curve=curve)
    try:
        worker = Worker(
            rank=rank,
            world_size=world_size,
            endpoint=endpoint,
            cache=cache,
            model=step_model,
            geometry=geometry,
            options=options,
            run_id=run_id,
        )
        return worker.run()
    finally:
        endpoint.close()
