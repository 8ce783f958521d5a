"""The model's thread of an executor: runs each GOed step, in order, with its peers.

For each step: the tokens of its feedback rows (the samples of the step run before it, sent from
rank 0 while the cache operations run, executor.feedback), the cache operations of its PREPARE in DESIGN.md's
order (offload reads pages before anything in this step writes them, then poison, restore, clear),
then the forward, then sampling on rank 0, after the logits processing its sampling states ask for
(executor.sampling_state). Every rank runs the same collectives in the same order: the feedback
message starts exactly when the step has feedback rows, which every rank reads from the same
PREPARE, and ends before the forward's first.

When a step's sample comes to the host: on the CPU right after it is drawn, and the step is answered
(RESULT on rank 0, DONE elsewhere) as run() ends. On a CUDA device, after the next forward is queued:
the sample's one copy to the host waits on an event while forward N+1 runs, and step N is answered
from there (or by settle(), when no step follows). Forward N+1 needs nothing of step N on the host
(its feedback tokens are gathered on the device), so the GPU goes from sample N to forward N+1 with
no Python between them: the H200 check measured 1.3-1.6 ms of the GPU idle there at batch 1, 15-18%
of its step (docs/control_plane.md, "On a GPU"). On a CPU the forward is synchronous, and the same
order would hold each RESULT back by a whole forward. Sample N+1 is drawn only after step N's tokens
are on the host, since its penalties and grammar masks count them.

Why the cache operations run here and not when the PREPARE is staged: with the scheduler planning
ahead, step N+1 is staged while step N runs, and N+1's offload must read what N wrote. On CUDA these
are queued on the model stream before the forward (and before a graph replay); on the CPU they run
right before it, but for a step's clears that the link thread may claim once it has handed the step
over (executor/clear_ahead.py). Either way a cleared page is zero before the forward that first
writes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import numpy as np
import torch

from executor.cache import KVCache
from executor.clear_ahead import ClearAhead
from executor.feedback import Feedback
from executor.grammar import GrammarEngine
from executor.inputs import StepInputs
from executor.link import StagedStep
from executor.options import ExecutorOptions
from executor.sampler import HostOutputs, SampleOutput, sample
from executor.sampling_state import SamplingStates
from protocol.errors import TPRuntimeError
from protocol.frames import Result

logger = logging.getLogger("tp_runtime.executor")


class StepModel(Protocol):
    """What a step needs of a model: LlamaModel, a CUDA graph runner around it, or a test stand-in."""

    fingerprint: str

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class _Feeding:
    """A step's feedback tokens on their way: `wait` for them to arrive (None on a single rank),
    `rows` the token indices of the step's inputs they go to (on the CPU both are host arrays, and
    `into` the host array under the inputs' token_ids: _feed says why)."""

    rows: torch.Tensor | np.ndarray
    tokens: torch.Tensor | np.ndarray
    wait: Callable[[], None] | None
    into: np.ndarray | None = None

    def land(self, inputs: StepInputs) -> None:
        if self.wait is not None:
            self.wait()
        if self.into is not None:
            self.into[self.rows] = self.tokens
        else:
            inputs.token_ids[self.rows] = self.tokens


@dataclass
class _Samples:
    """The token each sampled row of the last forward drew (rank 0 only), for the next feedback."""

    tokens: torch.Tensor  # int64[m] on the model's device, as soon as they are drawn
    host: np.ndarray  # the same, on the host (the RESULT's copy), once the readback is taken
    # `tokens`' own memory as an array, where the compiled pass wrote them (HostOutputs); else None.
    # The feed reads it: a tensor's numpy view cost 50-90 us right after an idle (change 111).
    array: np.ndarray | None = None


@dataclass
class _Readback:
    """One forward's sample on its way to the host: on a GPU, its one copy (pack_sampled: each copy
    waits for the device, and three waits between two forwards showed in the GPU check's trace)
    queued into pinned memory behind the sample, with an event after it, which take() waits for at
    once in the CPU's order and once the next forward is queued in the pipelined one; on the CPU,
    the sample itself."""

    inputs: StepInputs  # the forward's: the sequences its rows sampled for
    out: SampleOutput
    copy: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    made: HostOutputs | None = None  # a CPU's: where the compiled pass may have written `out`

    @classmethod
    def start(cls, inputs: StepInputs, out: SampleOutput, made: HostOutputs | None = None) -> _Readback:
        if made is not None or out.token_ids.device.type != "cuda":
            return cls(inputs, out, made=made)
        packed = pack_sampled(out)
        copy = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        copy.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(packed.device))
        return cls(inputs, out, copy, copied)

    def landed(self) -> bool:
        """Whether take() would return without waiting for the device. A device error counts as
        landed: take() then raises it, where the step it belongs to is failed."""
        if self.copied is None:
            return True
        try:
            return self.copied.query()
        except RuntimeError:
            return True

    def take(self) -> HostSample:
        if self.copy is None:
            return sampled_to_host(self.out, self.made)
        self.copied.synchronize()
        return unpack_sampled(self.copy, self.out.token_ids.shape[0])


@dataclass
class _OpenStep:
    """A step run whose answer is not given yet: its forwards' samples taken to the host so far,
    and the last one's readback while it is on its way (pipelined)."""

    step: int
    started: float
    gap_us: int
    inputs: StepInputs  # its last forward's
    samples: list[HostSample]
    readback: _Readback | None = None


class ReadbackError(TPRuntimeError, RuntimeError):
    """A step's sample could not be taken to the host: the device failed under that step."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(f"step {step}'s sample could not be read back: {cause}")
        self.step = step
        self.cause = cause


# How a step is answered: (step, its RESULT on rank 0, made when called, or None elsewhere, whether
# the next step's forward is already running on the model's thread). The link's thread makes the
# RESULT as it sends it, so that its ~15 us (cold) are not between two forwards.
Answer = Callable[[int, Callable[[], Result] | None, bool], None]


class StepRunner:
    def __init__(
        self, *, rank: int, world_size: int, model: StepModel, cache: KVCache, options: ExecutorOptions,
        grammars: GrammarEngine | None = None, is_cut: Callable[[int], bool] = lambda step: False,
        clear_ahead: ClearAhead | None = None, pipelined: bool | None = None, feedback: Feedback | None = None,
    ):
        if (feedback is None) != (world_size == 1):
            raise ValueError(f"a group of {world_size} ranks needs a feedback carrier exactly when it has several ranks")
        self.rank = rank
        self._feedback = feedback  # executor.feedback.open_feedback's
        self.model = model
        self.cache = cache
        self.options = options
        # Whether a sample is taken to the host only once the next forward is queued (the module says
        # why): by default where the device runs asynchronously; the tests force either order.
        self.pipelined = cache.device.type == "cuda" if pipelined is None else pipelined
        self._samples = _Samples(torch.zeros(0, dtype=torch.long, device=cache.device), np.zeros(0, dtype=np.int32))
        self.sampling_states = SamplingStates(grammars)  # rank 0's
        self._last_end: float | None = None
        self._is_cut = is_cut  # rank 0's: whether a CUT came for a step (SchedulerLink.is_cut)
        self._clear_ahead = clear_ahead
        self._open: _OpenStep | None = None

    def run(self, staged: StagedStep, answer: Answer, before_forward: Callable[[], None] | None = None) -> None:
        """Runs a step and answers it, and any step before it still open, through `answer`: its
        RESULT on rank 0, None elsewhere. Raises whatever the forward raises.

        A step of several forwards (Prepare.decode_steps) runs them back to back: each one's
        sequences decode the tokens rank 0 sampled in the forward before, broadcast to every rank
        as a step's feedback is, so that every rank runs the same collectives in the same order.
        A CUT for the step ends it after the forward running: rank 0 looks before each forward and
        sends its answer with the tokens, so that every rank stops at the same one.
        before_forward: called once the step's feed and cache operations are done, right before
        its first forward (the worker sends the step before's answer there).
        Pipelined, the step is still open when this returns: the next run() answers it once its own
        first forward is queued, or settle() does."""
        started = time.perf_counter()
        gap_us = 0 if self._last_end is None else int((started - self._last_end) * 1e6)
        inputs = staged.inputs
        if self.rank == 0:  # output grammars' matchers build on their own thread while the forward runs
            self.sampling_states.prefetch(staged.prepare)
        feeding = self._feed(staged)
        self._cache_operations(staged)
        if feeding is not None:
            feeding.land(staged.inputs)
        if self.sample_landed():  # pipelined: the step before goes out before this forward, as on the CPU
            self.settle(answer, next_running=True)
        if before_forward is not None:
            before_forward()
        opened = _OpenStep(staged.step, started, gap_us, inputs, [])
        try:
            for forward in range(staged.prepare.decode_steps):
                if forward:
                    tokens = self._next_tokens(staged.step, forward, inputs.num_seqs)
                    if tokens is None:
                        break
                    inputs = inputs.next_forward(tokens)
                logits = self.model.forward(inputs, self.cache)
                if forward == 0:  # pipelined: the step before is answered behind this forward
                    self.settle(answer, next_running=True)
                    self._open = opened
                else:
                    self._take(opened)
                opened.inputs = inputs
                if self.rank == 0:
                    opened.readback = self._sample(staged, inputs, logits, forward)
                if not self.pipelined:
                    self._take(opened)
        except BaseException:
            if self._open is opened:  # a failed step is refused, never answered
                self._open = None
            raise
        if not self.pipelined:
            self.settle(answer, next_running=False)
        self._last_end = time.perf_counter()

    @property
    def open_step(self) -> int | None:
        """The step run and not answered yet (pipelined only, between two run()s)."""
        return None if self._open is None else self._open.step

    def sample_landed(self) -> bool:
        """Whether the open step's last sample is on the host already, or nothing of it is awaited."""
        opened = self._open
        return opened is None or opened.readback is None or opened.readback.landed()

    def settle(self, answer: Answer, next_running: bool = False) -> None:
        """Answers the step still open (pipelined: the last one run, once its sample is on the host).
        Raises ReadbackError, naming that step, when taking its sample fails."""
        opened, self._open = self._open, None
        if opened is None:
            return
        self._take(opened)
        result = partial(_result, opened, time.perf_counter()) if self.rank == 0 else None
        answer(opened.step, result, next_running)

    def _take(self, opened: _OpenStep) -> None:
        """The open step's last sample on the host: the next feedback's host copy, and the tokens its
        sampling states count from now on."""
        readback, opened.readback = opened.readback, None
        if readback is None:
            return
        try:
            host = readback.take()
        except Exception as exc:
            # Best effort on a device: its errors stick to the whole context, so a fault of a
            # forward queued later may surface here and be named as this step's.
            raise ReadbackError(opened.step, exc) from exc
        self._samples.host = host.tokens
        self.sampling_states.append(readback.inputs.sample_seq_ids, host.tokens, host.finite)
        opened.samples.append(host)

    def _next_tokens(self, step: int, forward: int, rows: int) -> torch.Tensor | None:
        """Every rank's copy of the tokens rank 0 sampled in the forward just run (all rows
        sampled), for the next forward; None on every rank when rank 0 was told to cut the step."""
        cut, tokens = (self._is_cut(step), self._samples.tokens) if self.rank == 0 else (False, None)
        if self._feedback is None:
            return None if cut else tokens
        # A CPU group's rank 0 sends the sample's own array (change 111's; only rank 0 samples, so
        # elsewhere there is none): the tensor's numpy view was the carrier's first bridge after the
        # forward (change 114).
        sent = tokens if self._samples.array is None else self._samples.array
        # No rank launches a later forward before it knows that there is one (executor.feedback).
        got = self._feedback.later_forward(step, forward, rows, sent, cut)
        # Rank 0 decided the cut and holds the tokens as a tensor, whatever form it sent them in.
        return (None if cut else tokens) if self.rank == 0 else got

    def _feed(self, staged: StagedStep) -> _Feeding | None:
        """Starts the feedback rows' tokens on their way to every rank; the step's cache operations
        run while they travel (with two ranks on a CPU, gloo's broadcast waited ~0.5 ms for the peer's
        side), and _Feeding.land puts them in the step's inputs before its forward."""
        rows, on_device = staged.feedback_rows, staged.feedback_on_device
        if not rows.shape[0]:
            return None
        if on_device is None:
            # The CPU's through numpy, from the staged host arrays: its indexing of a few rows
            # costs ~1 us where torch's costs several right after a forward (bench_step at one
            # rank: _feed and land ~30 us through torch, ~10 through numpy).
            if self.rank == 0:
                samples = self._samples
                tokens = (samples.tokens.numpy() if samples.array is None else samples.array)[staged.feedback_sources]
            else:
                tokens = np.empty(rows.shape[0], dtype=np.int64)
            wait = self._feedback.start(staged.step, 0, tokens) if self._feedback is not None else None
            return _Feeding(rows, tokens, wait, staged.token_ids_host)
        if self.rank == 0:
            tokens = self._samples.tokens[on_device[1]]
        else:
            tokens = torch.empty(rows.shape[0], dtype=torch.long, device=self.cache.device)
        wait = self._feedback.start(staged.step, 0, tokens) if self._feedback is not None else None
        return _Feeding(on_device[0], tokens, wait)

    def _cache_operations(self, staged: StagedStep) -> None:
        prepare, cache, options = staged.prepare, self.cache, self.options
        if cache.calibration_pending:  # the first step run sets an fp8 cache's scales
            cache.begin_calibration()
        if prepare.offload_pages.size:
            cache.offload(prepare.offload_pages, prepare.offload_slots)
        if options.debug_poison_freed and prepare.poison_pages.size:
            cache.poison_pages(prepare.poison_pages)
        if prepare.restore_pages.size:
            cache.restore(prepare.restore_pages, prepare.restore_slots)
        if not options.debug_skip_clears and prepare.cleared_pages.size:
            staged.clears.claim(lambda: cache.clear_pages(prepare.cleared_pages))
        if self._clear_ahead is not None:
            self._clear_ahead.operated(staged.step)

    def _fed_tokens(self, staged: StagedStep) -> dict[int, int]:
        """The token each feedback row of the step receives, by sequence index (host side)."""
        rows = staged.prepare.feedback.nonzero()[0]
        return dict(zip(rows.tolist(), self._samples.host[staged.feedback_sources].tolist()))

    def _sample(self, staged: StagedStep, inputs: StepInputs, logits: torch.Tensor | None, forward: int) -> _Readback:
        """One forward's sample, on its way to the host. The step's sampling states are taken at
        its first forward and extended with every forward's tokens (_take), so a later forward's
        penalties and grammar masks count the ones before it."""
        if logits is None:
            raise RuntimeError("the model returned no logits on rank 0")
        prepare, states, params = staged.prepare, self.sampling_states, inputs.sampling
        rows = inputs.sample_rows.shape[0]
        if logits.shape[0] != rows:
            raise RuntimeError(f"the model returned {logits.shape[0]} logits rows for {rows} sampled rows")
        if not staged.touches_states:
            states.forget()
        else:
            if forward == 0:
                fed = self._fed_tokens(staged) if prepare.sampling_state.any() and prepare.feedback.any() else {}
                states.begin(prepare, fed)
            processing = states.processing(prepare, logits.device)
            if processing is not None:
                params = replace(params, processing=processing)
        made = staged.outputs[forward] if staged.outputs else None
        out = sample(logits, params, made)
        self._samples.tokens = out.token_ids
        self._samples.array = made.tokens if made is not None and made.wrote(out) else None
        return _Readback.start(inputs, out, made)


@dataclass(frozen=True)
class HostSample:
    """A step's SampleOutput on the host, as RESULT carries it."""

    tokens: np.ndarray  # int32[m]
    finite: np.ndarray  # uint8[m]
    logprobs: np.ndarray  # float32[m]
    top_ids: np.ndarray | None  # int32[m, k], None when no row asked for alternatives
    top_logprobs: np.ndarray | None  # float32[m, k]


def sampled_to_host(out: SampleOutput, made: HostOutputs | None = None) -> HostSample:
    """A CPU's sample as a HostSample, by numpy's casts (a torch call costs a few times one); a
    GPU's comes through pack_sampled's one copy (_Readback). Where the compiled pass wrote `out`
    into `made`, from its arrays: the tensors' way back to numpy took ~20 us more, cold."""
    alternatives = out.top_ids is not None
    if made is not None and made.wrote(out):
        tokens, finite, logprobs, top_ids, top_logprobs = made.tokens, made.finite, made.logprobs, made.top_ids, made.top_logprobs
    else:
        tokens, finite, logprobs = out.token_ids.numpy(), out.finite.numpy().view(np.uint8), out.logprobs.numpy()
        top_ids, top_logprobs = (out.top_ids.numpy(), out.top_logprobs.numpy()) if alternatives else (None, None)
    # The flags and logprobs as they are (bool's bytes are uint8's): nothing changes them once drawn.
    return HostSample(
        tokens.astype(np.int32), finite, logprobs.astype(np.float32, copy=False),
        top_ids.astype(np.int32) if alternatives else None, top_logprobs.astype(np.float32) if alternatives else None,
    )  # fmt: skip


def pack_sampled(out: SampleOutput) -> torch.Tensor:
    """Everything of the sample as one flat float64 tensor on its device, for one copy: tokens,
    finite flags, logprobs, then the alternatives' ids and logprobs row by row, if any (float64
    holds every token id exactly: ids < 2**53)."""
    parts = [out.token_ids, out.finite, out.logprobs]
    if out.top_ids is not None:
        parts += [out.top_ids.flatten(), out.top_logprobs.flatten()]
    return torch.cat([p.double() for p in parts])


def unpack_sampled(packed: torch.Tensor, rows: int) -> HostSample:
    """pack_sampled's tensor of a `rows`-row sample, copied to the host, as a HostSample."""
    flat = packed.numpy()
    k = (flat.shape[0] - 3 * rows) // (2 * rows) if rows else 0
    tokens, finite, logprobs = (flat[i * rows : (i + 1) * rows] for i in range(3))
    alternatives = flat[3 * rows :]
    return HostSample(
        tokens.astype(np.int32), finite.astype(np.uint8), logprobs.astype(np.float32),
        alternatives[: rows * k].reshape(rows, k).astype(np.int32) if k else None,
        alternatives[rows * k :].reshape(rows, k).astype(np.float32) if k else None,
    )  # fmt: skip


def _result(opened: _OpenStep, ended: float) -> Result:
    """The RESULT of a step's forwards, forward by forward (protocol.frames.Result); nothing of
    `opened` changes once it is answered."""
    inputs, samples = opened.inputs, opened.samples
    wanted = inputs.sampling.host.num_logprobs
    tops = [_alternatives(host, wanted) for host in samples]
    return Result(
        seq_ids=np.ascontiguousarray(inputs.sample_seq_ids, dtype=np.int64),
        token_ids=np.concatenate([host.tokens for host in samples]),
        logprobs=np.concatenate([host.logprobs for host in samples]),
        finite=np.concatenate([host.finite for host in samples]),
        step_time_us=int((ended - opened.started) * 1e6),
        gap_us=opened.gap_us,
        top_token_ids=np.concatenate([ids for ids, _ in tops]),
        top_logprobs=np.concatenate([lps for _, lps in tops]),
    )


def _alternatives(host: HostSample, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """RESULT's flat alternatives: each sampled row's first wanted[j] entries, row by row."""
    if host.top_ids is None:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
    take = np.arange(host.top_ids.shape[1])[None, :] < wanted[:, None]
    return host.top_ids[take], host.top_logprobs[take]
