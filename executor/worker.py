"""The executor process of one rank: a link thread that talks to the scheduler, and the model's
thread that runs the steps it hands over (executor/link.py, executor/steps.py).

A PREPARE is validated (the conversation), its page tables resolved and its inputs staged on the
link thread, which answers READY; on GO the model's thread runs it: feedback tokens, the cache
operations in DESIGN.md's order (offload, poison, restore, clear), the forward, sampling on rank 0.
Heartbeats keep going while a forward runs, so a stopped rank is noticed by its silence and a
healthy one is not mistaken for it.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from executor.cache import KVCache
from executor.clear_ahead import ClearAhead
from executor.feedback import Feedback, open_feedback
from executor.grammar import GrammarEngine, GrammarVocabulary
from executor.link import Command, Endpoint, LinkTimings, Run, SchedulerLink, Started, Stop
from executor.options import ExecutorOptions
from executor.steps import ReadbackError, StepModel, StepRunner
from protocol.conversation import ExecutorConversation
from protocol.errors import TPRuntimeError
from protocol.frames import CacheGeometry, Result

if TYPE_CHECKING:
    from protocol.curve import ClientCurve

logger = logging.getLogger("tp_runtime.executor")


# How often the model's thread looks whether the device has finished the open step while it waits
# for the next one (pipelined): a later look answers that step later, when no step came to follow it.
_LANDING_POLL_S = 0.00025


class ExitCode(enum.IntEnum):
    OK = 0  # SHUTDOWN received
    HANDSHAKE_REFUSED = 2  # WELCOME disagreed with this rank, or SHUTDOWN/timeout before it
    SCHEDULER_SILENT = 3  # nothing from the scheduler for peer_timeout_s
    STEP_FAILED = 4  # the forward raised, or stayed stuck after a stop: the collectives are unusable
    TRANSPORT_FAILED = 5  # the endpoint could not send


class ExecutorStartError(TPRuntimeError):
    """The executor cannot start: options, device or process group do not fit together."""


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
        force_exit: Callable[[int], None] = os._exit,
        grammars: GrammarEngine | None = None,
        feedback: Feedback | None = None,
    ) -> None:
        self.rank = rank
        conversation = ExecutorConversation(
            rank=rank,
            world_size=world_size,
            run_id=run_id,
            geometry=geometry,
            model_fingerprint=model.fingerprint,
            config_fingerprint=options.fingerprint(),
            host=socket.gethostname(),
        )
        clear_ahead = ClearAhead(cache, options)
        self.link = SchedulerLink(
            conversation=conversation,
            endpoint=endpoint,
            page_size=cache.page_size,
            pad_page=cache.pad_page,
            device=cache.device,
            timings=LinkTimings(
                heartbeat_s=options.heartbeat_interval_s,
                peer_timeout_s=options.peer_timeout_s,
                handshake_s=options.handshake_timeout_s,
                stuck_grace_s=options.stuck_grace_s,
            ),
            exit_codes=ExitCode,
            force_exit=force_exit,
            clear_ahead=clear_ahead,
        )
        self.runner = StepRunner(
            rank=rank, world_size=world_size, model=model, cache=cache, options=options, grammars=grammars,
            is_cut=self.link.is_cut, clear_ahead=clear_ahead,
            pipelined=options.pipelined_readback, feedback=feedback,
        )
        self._held: _Answer | None = None  # the last step's answer, while the next step may be here already

    def run(self) -> int:
        link = self.link
        link.start()
        try:
            while True:
                try:
                    command = self._next_command()
                except ReadbackError as failed:
                    return self._failed(failed.step, failed.cause)
                if isinstance(command, Stop):
                    if command.code != ExitCode.OK:
                        logger.error("[rank %d] %s", self.rank, command.reason)
                    return command.code
                if isinstance(command, Started):
                    logger.info("[rank %d] welcomed: protocol %d", self.rank, link.endpoint.version)
                    continue
                assert isinstance(command, Run)
                step = command.staged.step
                link.mark_busy()
                previous, self._held = self._held, None  # sent as this step's forward starts (or below, on a failure)
                try:
                    self.runner.run(
                        command.staged, self._answered, before_forward=None if previous is None else previous.send_while_busy
                    )
                    link.release(command)
                    del command
                except Exception as exc:  # noqa: BLE001 - any failure here leaves the collectives unusable
                    if previous is not None:
                        previous.send_while_busy()
                    if isinstance(exc, ReadbackError):
                        # Its own step's sample, or (pipelined) the step before's, found as this one
                        # ran: that step is named. A step queued after it is not answered; the rank
                        # ends, and the scheduler fails every step in flight with it.
                        return self._failed(exc.step, exc.cause)
                    self._answer_open_step_before_failing()
                    return self._failed(step, exc)
        finally:
            held, self._held = self._held, None
            if held is not None:
                held.send()
            link.close()

    def _answered(self, step: int, result: Callable[[], Result] | None, next_running: bool) -> None:
        """The runner's answer of a step. On the CPU it comes as the step ends and is held until
        the next step's forward starts, if that step is here (_Answer says why); pipelined, it comes
        once the next step's forward is queued, or from settle(), and goes at once."""
        answer = _Answer(self.link, step, result)
        if not self.runner.pipelined:
            self._held = answer
        elif next_running:
            answer.send_while_busy()
        else:
            answer.send()

    def _next_command(self) -> Command:
        """The next command. What is still to answer (the answer held, the step still open) waits
        only when the next command is a step that is here already, or pipelined, one that comes
        while the device still works on the open step; otherwise it goes first."""
        commands = self.link.commands
        if self._held is None and self.runner.open_step is None:
            return commands.get()
        command = self._command_before_landing(commands)
        if isinstance(command, Run):
            return command
        self._answer_now()
        return commands.get() if command is None else command

    def _command_before_landing(self, commands: queue.Queue[Command]) -> Command | None:
        """The next command if it is here before the open step's sample lands on the host, else
        None. Pipelined, run() returns as soon as the step is queued: the scheduler's next step
        (sent once the step before was answered, behind this step's first forward) usually comes
        while the device still runs this one, and queued then, it follows with no gap. Answering
        first would wait for the device and leave it idle until the next step came and was queued."""
        while True:
            landed = self.runner.sample_landed()
            try:
                return commands.get_nowait() if landed else commands.get(timeout=_LANDING_POLL_S)
            except queue.Empty:
                if landed:
                    return None

    def _answer_now(self) -> None:
        """Pipelined: the open step answered once its sample is on the host (ReadbackError when
        the device failed under it). Then the answer held, if any."""
        self.runner.settle(self._answered)
        held, self._held = self._held, None
        if held is not None:
            held.send()

    def _answer_open_step_before_failing(self) -> None:
        """Pipelined: a forward that failed may have been the first of its step, queued behind the
        step before, whose answer is then still to give."""
        try:
            self.runner.settle(self._answered, next_running=True)
        except ReadbackError:  # the failure being reported is the one that counts
            logger.exception("[rank %d] the step before the failed one could not be answered", self.rank)

    def _failed(self, step: int, exc: BaseException) -> int:
        logger.error("[rank %d] step %d failed in the forward; exiting", self.rank, step, exc_info=exc)
        self.link.fail(step, f"rank {self.rank} failed in the forward: {exc}")
        return ExitCode.STEP_FAILED


@dataclass
class _Answer:
    """A step's RESULT (rank 0) or DONE, held while the next step, already GOed, gets its feed and
    its cache operations, and sent as its forward starts. Sent at once, it brought the scheduler's
    next PREPARE into that window, and every rank's link thread decoded and staged it there, taking
    the GIL from the model's thread between two forwards (bench_step at 2 ranks: the gap 945 / 834
    us against 1,380 / 1,803, docs/control_plane.md change 52). Nothing waits for it sooner: with
    overlap the scheduler has that next step already, and with nothing queued it goes at once."""

    link: SchedulerLink
    step: int
    result: Callable[[], Result] | None  # makes the RESULT (rank 0), on the link's thread
    sent: bool = False

    def send(self) -> None:
        """Sent with the model's thread idle: the link no longer counts it busy."""
        self._send(still_busy=False)

    def send_while_busy(self) -> None:
        """Sent as the next step runs: the link keeps counting the model's thread busy with it."""
        self._send(still_busy=True)

    def _send(self, still_busy: bool) -> None:
        if not self.sent:
            self.sent = True
            # The link's thread holds the RESULT's maker (and the step's samples and inputs in it)
            # from here, and frees them there once it is sent (SchedulerLink.release says why).
            result, self.result = self.result, None
            self.link.finish(self.step, result, still_busy=still_busy)


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
    grammar_vocabulary: Callable[[], GrammarVocabulary] | None = None,
    host_group: torch.distributed.ProcessGroup | None = None,
) -> int:
    """Load this rank's shard, allocate its cache, connect to the scheduler and serve steps
    (load_executor, then serve_executor: a launcher that learns the scheduler's address while the
    shard loads calls the two itself).

    torch.distributed must already be initialized when world_size > 1 (the launcher does it).
    `load` replaces executor.model.load_model (same signature); the loop tests pass a stand-in.
    `curve` (protocol.curve.ClientCurve) makes the connection a CurveZMQ client, across hosts.
    `grammar_vocabulary` loads the tokenizer's view for rank 0's grammar engine (structured output).
    `host_group`: load_executor's.
    """
    loaded = load_executor(options, rank=rank, world_size=world_size, load=load, host_group=host_group)
    return serve_executor(
        loaded, address=address, key=key, run_id=run_id, curve=curve, grammar_vocabulary=grammar_vocabulary
    )


@dataclass(frozen=True)
class LoadedExecutor:
    """One rank before it connects: its shard, its cache and the geometry it will announce."""

    options: ExecutorOptions
    rank: int
    world_size: int
    cache: KVCache
    model: StepModel
    geometry: CacheGeometry
    feedback: Feedback | None


def load_executor(
    options: ExecutorOptions, *, rank: int, world_size: int, load: Callable[..., Any] | None = None,
    host_group: torch.distributed.ProcessGroup | None = None,
) -> LoadedExecutor:
    """This rank's shard on its device and its KV cache: everything before the connection.
    `host_group`: a gloo group of the ranks where the default group is NCCL's (executor.feedback)."""
    if world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ExecutorStartError(
            f"world size {world_size} needs torch.distributed initialized before run_executor"
        )
    # Imported when a rank starts, not with this module: the model package pulls in the weight readers.
    from executor.allocator import retain_freed_memory

    retain_freed_memory()
    device = pick_device(options)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = _load_shard(options, load, rank=rank, world_size=world_size, device=device)
    geometry = build_geometry(options, model.config)
    cache = _allocate_cache(options, model, world_size=world_size, device=device)
    step_model = _step_model(options, model, cache, geometry, world_size=world_size)
    if options.seed is not None:
        torch.manual_seed(options.seed)
    feedback = open_feedback(rank, world_size, device, host_group)
    return LoadedExecutor(options, rank, world_size, cache, step_model, geometry, feedback)


def serve_executor(
    loaded: LoadedExecutor,
    *,
    address: str,
    key: bytes,
    run_id: str,
    curve: ClientCurve | None = None,
    grammar_vocabulary: Callable[[], GrammarVocabulary] | None = None,
) -> int:
    """Connects a loaded rank to the scheduler and serves steps until SHUTDOWN or a failure."""
    from protocol.transport import ExecutorEndpoint  # imported when a rank starts: it pulls in zmq

    rank = loaded.rank
    # Woken by the model's thread for each step's answer, right before its next forward: on a CPU,
    # measured to pay (docs/control_plane.md, change 113); a GPU rank's forward gives the GIL up at
    # each launch, where the link's RESULT would come between two, unmeasured.
    on_cpu = loaded.cache.device.type == "cpu"
    endpoint = ExecutorEndpoint(address, key, run_id, rank, curve=curve, wake_holding_gil=on_cpu)
    try:
        worker = Worker(
            rank=rank,
            world_size=loaded.world_size,
            endpoint=endpoint,
            cache=loaded.cache,
            model=loaded.model,
            geometry=loaded.geometry,
            options=loaded.options,
            run_id=run_id,
            grammars=(
                GrammarEngine(grammar_vocabulary, loaded.geometry.vocab_size) if rank == 0 and grammar_vocabulary else None
            ),
            feedback=loaded.feedback,
        )
        return worker.run()
    finally:
        endpoint.close()
        if loaded.feedback is not None:
            loaded.feedback.close()


def _load_shard(
    options: ExecutorOptions, load: Callable[..., Any] | None, *, rank: int, world_size: int, device: torch.device
) -> Any:
    from executor.model import TORCH_DTYPES

    if load is None:
        from executor.model import load_model as load

    return load(
        options.model,
        rank=rank,
        world_size=world_size,
        dtype=TORCH_DTYPES[options.dtype],
        device=device,
        weight_format=options.weight_format,
        progress=rank == 0,
        deterministic=options.deterministic,
    )


def _allocate_cache(options: ExecutorOptions, model: Any, *, world_size: int, device: torch.device) -> KVCache:
    """This rank's KV cache: its share of the KV heads, and the fp8 scales of every layer."""
    from executor.kv_scales import cache_scales

    return KVCache(
        num_kv_pages=options.num_kv_pages,
        page_size=options.page_size,
        num_layers=model.config.num_layers,
        num_kv_heads=model.shard.local_kv_heads,
        head_dim=model.config.head_dim,
        kv_dtype=options.kv_cache_dtype,
        device=device,
        num_host_pages=options.num_host_pages,
        poison=options.debug_poison_cache,
        scales=cache_scales(
            options.kv_cache_scales, options.model, model.config.num_layers, world_size, options.kv_cache_dtype
        ),
    )


def check_graph_collectives(world_size: int, backend: str | None) -> None:
    """CUDA graphs capture the model's all_reduce only where it is a CUDA kernel, as NCCL's is.
    gloo's runs on the host through pinned copies and a stream sync: its capture fails (on the GPU
    check: both ranks of a TP=2 group on one GPU over gloo died before HELLO), and a replay would
    skip it anyway. So such a group is refused at start, in a sentence, rather than hanging."""
    if world_size > 1 and backend != "nccl":
        raise ExecutorStartError(
            f"CUDA graphs need NCCL between the ranks; this group of {world_size} runs over {backend}, "
            "whose collectives cannot be captured: start with --enforce-eager"
        )


def _step_model(options: ExecutorOptions, model: Any, cache: KVCache, geometry: CacheGeometry, *, world_size: int) -> StepModel:
    """The model as a step runs it: executor.model.runner picks eager, compiled layers or, on CUDA
    with graphs asked for, a captured decode graph. A stand-in model (the loop tests') runs as it is."""
    from executor.model import LlamaModel

    if not isinstance(model, LlamaModel):
        return model
    from executor.model.runner import ModelRunner

    graphs = None
    if cache.device.type == "cuda" and options.cuda_graphs:
        from executor.cuda_graphs import DecodeGraphRunner

        check_graph_collectives(world_size, torch.distributed.get_backend() if world_size > 1 else None)

        graphs = DecodeGraphRunner(model, cache, geometry=geometry, batch_sizes=options.cuda_graph_batch_sizes)
    return ModelRunner(model, graphs=graphs)
