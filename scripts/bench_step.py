"""Executor benchmarks: clear_pages against memory bandwidth, and the step loop's own overhead.

    python scripts/bench_step.py [--json] [--ranks 1,2,3] [--steps 200] [--loop-only] [--forward-ms 10]
                                 [--rows 16,256] [--forward sleep,gil,device,model] [--steady continue,prepare]
                                 [--readback at-once,pipelined]
    python scripts/bench_step.py --frames --rows 16,256    # a steady step's frame both ways, in-process
    python scripts/bench_step.py --loop-only ... --baseline DIR --rounds 5   # this tree against another, alternately

1. Memory bandwidth of this machine: a large tensor copy (bytes read + written per second) and a
   byte fill (bytes written per second), measured here, side by side with
2. clear_pages on a SmolLM2-shaped bf16 cache (30 layers, 3 KV heads of 64, pages of 16 slots):
   the cost per page when every page is its own run, and per run of 8 and 64 contiguous pages.
3. The step loop itself at 1, 2 and 3 ranks: PREPARE -> validate + stage -> READY -> GO -> forward
   -> RESULT/DONE, with a forward that is one all_reduce and --forward-ms of sleep (a GPU model's
   thread, waiting with the GIL released) or of tiny torch ops (`--forward gil`: a CPU model's many
   small ops, which hold the GIL between kernels) or of a simulated asynchronous device's time
   (`--forward device`: the forward is queued and the call returns, a sample's readback waits for
   the device's clock, and the forwards are stamped on that clock, so that the model thread's order,
   `--readback at-once` as the CPU runs it or `pipelined` as a CUDA device does, shows in the
   device's idle time; what the stand-in leaves out is in SimulatedDevice), and fixed peaked logits
   on rank 0, so what is
   measured is the protocol, the staging and the sampler, not a model. `--forward model` runs the
   embedded default model's real forward instead (the dtype `serve` would pick here, --forward-ms
   unused), so that what a real forward leaves behind shows: its vocabulary's sampling, the
   OpenMP team still spinning after its matmuls, its GIL traffic with the link's thread. Steps after the first are a server's
   steady decode steps of --rows rows (feedback tokens, page tables held), sent as the engine sends
   them (--steady continue: CONTINUE, and a PREPARE every PAGE_SIZE steps, when the rows' pages are
   full and their context starts again) or each as a whole PREPARE (--steady prepare). Per run: the step
   (median, p90), and the gap between two forwards (median, p90): from the end of forward N on the
   last rank to finish it to the start of forward N+1 on the last rank to start it, which each
   rank's model stamps itself; and rank 0's model thread idle between two steps (RESULT.gap_us:
   the gap less sampling and the cache operations).
   Each world size runs serially (the next PREPARE after the RESULT) and overlapped (the next
   PREPARE as soon as GO is out, as --async-scheduling does): the gap is what overlapping saves.
   The executors are started and stopped by scripts/harness/executors.py.
Also the in-process pieces of one step (validate_prepare, StepInputs.from_prepare, sample), and
(--frames) a steady step's encode, decode and validation as a PREPARE and as a CONTINUE.
--baseline DIR runs the loop of this tree and of another checkout's, in turn (--rounds times, the
order swapped each round), and reports each run and the median of the rounds' differences: on a
shared machine the rounds drift by as much as a change moves the gap, and a pair shares its drift.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import zmq

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from executor.allocator import retain_freed_memory  # noqa: E402
from executor.cache import KVCache, page_runs  # noqa: E402
from executor.inputs import StepInputs  # noqa: E402
from executor.link import link_thread_name  # noqa: E402
from executor.options import READBACK_ORDERS, ExecutorOptions  # noqa: E402
from executor.sampler import SamplingBatch, argmax_rows, sample  # noqa: E402
from protocol.codec import decode, encode, to_message  # noqa: E402
from protocol.continuation import expand  # noqa: E402
from protocol.frames import (  # noqa: E402
    LAYOUT_VERSION,
    PROTOCOL_VERSION,
    CacheGeometry,
    Continue,
    Frame,
    Prepare,
    Ready,
    max_decode_steps,
    plain_sampling,
)
from protocol.validate import validate_continued, validate_prepare  # noqa: E402
from tp_runtime.config import DEFAULT_SCHEDULER_STEPS  # noqa: E402

# SmolLM2-135M's cache shape, the default model's.
LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16
BENCH_VOCAB = 256  # the loop benchmark's logits width: small, so sampling does not dominate
DECODE_SEQS = 16
BENCH_KEY = bytes(range(32))  # message_costs' frames: any key of the right length


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


# -- bandwidth and clear_pages -----------------------------------------------------------------


def bandwidth(nbytes: int = 256 << 20, repeats: int = 7) -> dict[str, float]:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_us = median_us(lambda: dst.copy_(src), repeats)
    fill_us = median_us(lambda: dst.fill_(0), repeats)
    return {
        "copy_read_plus_write_gb_s": 2 * nbytes / copy_us / 1e3,
        "fill_write_gb_s": nbytes / fill_us / 1e3,
    }


def clear_cost(num_kv_pages: int = 512, repeats: int = 7) -> dict[str, float]:
    cache = KVCache(
        num_kv_pages=num_kv_pages,
        page_size=PAGE_SIZE,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        kv_dtype="bf16",
        device=torch.device("cpu"),
    )
    cache.data.view(torch.uint8).fill_(1)
    out: dict[str, float] = {"page_bytes": cache.page_bytes, "cache_bytes": cache.data.numel() * 2}
    scattered = np.arange(0, num_kv_pages, 2, dtype=np.int32)  # every page its own run
    us = median_us(lambda: cache.clear_pages(scattered), repeats)
    out["single_page_runs_us_per_page"] = us / scattered.size
    out["single_page_runs_gb_s"] = scattered.size * cache.page_bytes / us / 1e3
    for run in (8, 64):
        starts = np.arange(0, num_kv_pages - run + 1, 2 * run)
        pages = (starts[:, None] + np.arange(run)[None, :]).reshape(-1).astype(np.int32)
        if len(page_runs(pages)) != starts.size:
            raise RuntimeError(f"the benchmark meant {starts.size} runs of {run} pages")
        us = median_us(lambda: cache.clear_pages(pages), repeats)
        out[f"runs_of_{run}_us_per_run"] = us / starts.size
        out[f"runs_of_{run}_us_per_page"] = us / pages.size
        out[f"runs_of_{run}_gb_s"] = pages.size * cache.page_bytes / us / 1e3
    return out


# -- the step ------------------------------------------------------------------------------------


PAGES_PER_SEQ = 8
STEADY_KINDS = ("continue", "prepare")


def bench_geometry(rows: int = DECODE_SEQS) -> CacheGeometry:
    """SmolLM2's cache shape, with room for `rows` decoding sequences of PAGES_PER_SEQ pages each
    and 64 pages more for the step's clears."""
    return CacheGeometry(
        num_kv_pages=max(512, rows * PAGES_PER_SEQ + 64),
        page_size=PAGE_SIZE,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        kv_dtype="bf16",
        vocab_size=BENCH_VOCAB,
        max_model_len=2048,
        max_num_seqs=max(64, rows),
        max_num_batched_tokens=max(1024, rows),
    )


# A decode step's context: its last page's first slot, so that PAGE_SIZE - 1 CONTINUEs fit in the
# pages before the context starts again.
START_CONTEXT = (PAGES_PER_SEQ - 1) * PAGE_SIZE + 1


def decode_prepare(step: int, seqs: int = DECODE_SEQS, steady: bool = False, forwards: int = 1) -> Prepare:
    """A decode step of `seqs` sequences, PAGES_PER_SEQ pages each, one freshly cleared page per step.
    `steady`: as a server's steps after the first: every row's token is the one its sequence sampled
    at the step before (feedback) and the ranks hold the page tables already (an empty delta).
    `forwards`: the frame's decode_steps (--num-scheduler-steps), within the last page."""
    i32 = np.int32
    context = np.full(seqs, START_CONTEXT, dtype=i32)
    base = PAGES_PER_SEQ if steady else 0
    table = np.zeros(0, dtype=i32) if steady else np.arange(seqs * PAGES_PER_SEQ, dtype=i32)
    return Prepare(
        seq_ids=np.arange(seqs, dtype=np.int64),
        query_lens=np.ones(seqs, dtype=i32),
        context_lens=context,
        token_ids=np.full(seqs, 7, dtype=i32),
        positions=context - 1,
        page_table_lens=np.full(seqs, PAGES_PER_SEQ, dtype=i32),
        page_table_base=np.full(seqs, base, dtype=i32),
        page_table=table,
        sample=np.ones(seqs, dtype=np.uint8),
        temperature=np.full(seqs, 0.7, dtype=np.float32),
        top_p=np.full(seqs, 0.9, dtype=np.float32),
        top_k=np.zeros(seqs, dtype=i32),
        seeds=np.full(seqs, -1, dtype=np.int64),
        cleared_pages=np.array([seqs * PAGES_PER_SEQ + step % 64], dtype=i32),
        restore_pages=np.zeros(0, dtype=i32),
        restore_slots=np.zeros(0, dtype=i32),
        offload_pages=np.zeros(0, dtype=i32),
        offload_slots=np.zeros(0, dtype=i32),
        poison_pages=np.zeros(0, dtype=i32),
        feedback=np.full(seqs, int(steady), dtype=np.uint8),
        **plain_sampling(seqs),
        decode_steps=forwards,
    )


def step_pieces(repeats: int = 200) -> dict[str, float]:
    g = bench_geometry()
    prepare = decode_prepare(1)
    inputs = StepInputs.from_prepare(prepare, pad_page=g.num_kv_pages, page_size=g.page_size, device="cpu")
    # Peaked rows (an LLM's usual case) keep the nucleus in the first 256 candidates; flat ones
    # (std 1 over 49152 tokens) need the 4096-wide fallback.
    peaked = torch.randn(DECODE_SEQS, 49152, generator=torch.Generator().manual_seed(0)) * 4
    flat = peaked / 4
    # As the runtime samples: the PREPARE's rows on the host beside the tensors.
    params = inputs.sampling
    greedy = SamplingBatch(
        torch.zeros_like(params.temperature), params.top_p, params.top_k,
        replace(params.host, temperature=np.zeros(params.temperature.shape[0], dtype=np.float32)),
    )  # fmt: skip
    lone = SamplingBatch.of([0.0], [1.0], [0], [-1], [0])
    return {
        "validate_prepare_us": median_us(lambda: validate_prepare(prepare, g), repeats),
        "inputs_from_prepare_us": median_us(
            lambda: StepInputs.from_prepare(prepare, pad_page=g.num_kv_pages, page_size=g.page_size, device="cpu"),
            repeats,
        ),
        "sample_16x49152_greedy_us": median_us(lambda: sample(peaked, greedy), 20),
        "sample_1x49152_greedy_us": median_us(lambda: sample(peaked[:1], lone), 50),
        # The greedy token: torch's argmax against the sampler's (numpy's, vectorized, on the CPU).
        "argmax_16x49152_torch_us": median_us(lambda: peaked.argmax(dim=-1), 20),
        "argmax_16x49152_sampler_us": median_us(lambda: argmax_rows(peaked), 20),
        "sample_16x49152_top_p_peaked_us": median_us(lambda: sample(peaked, params), 20),
        "sample_16x49152_top_p_flat_us": median_us(lambda: sample(flat, params), 20),
    }


def steady_frame_costs(rows: int, repeats: int = 300) -> dict[str, float]:
    """One steady decode step of `rows` sequences on the wire both ways, in this process (warm
    caches): the scheduler's encode, a rank's decode and validation, for the whole PREPARE and for
    the CONTINUE that says it (with its expansion after the step before's PREPARE)."""
    g = bench_geometry(rows)
    driver = _LoopDriver(None, 1, 2, rows, "continue")
    held, _ = driver.next_step(1)
    whole, brief = driver.next_step(2)

    def frame(body: object) -> Frame:
        return Frame(PROTOCOL_VERSION, LAYOUT_VERSION, "bench", 2, 1, body)

    wire_whole, wire_brief = encode(frame(whole), BENCH_KEY), encode(frame(brief), BENCH_KEY)
    got_held = decode(encode(frame(held), BENCH_KEY), BENCH_KEY).body
    got_whole, got_brief = decode(wire_whole, BENCH_KEY).body, decode(wire_brief, BENCH_KEY).body
    expanded = expand(got_held, got_brief)
    return {
        "prepare_encode_us": median_us(lambda: encode(frame(whole), BENCH_KEY), repeats),
        "continue_encode_us": median_us(lambda: encode(frame(brief), BENCH_KEY), repeats),
        "prepare_decode_us": median_us(lambda: decode(wire_whole, BENCH_KEY), repeats),
        "continue_decode_us": median_us(lambda: decode(wire_brief, BENCH_KEY), repeats),
        "continue_expand_us": median_us(lambda: expand(got_held, got_brief), repeats),
        "prepare_validate_us": median_us(lambda: validate_prepare(got_whole, g), repeats),
        "continue_validate_us": median_us(lambda: validate_continued(expanded, g), repeats),
    }


def message_costs(repeats: int = 2000) -> dict[str, float]:
    """Send + receive of one frame over an inproc pair of sockets: its three sections as three
    ZeroMQ parts (protocol version 4) against one message (version 5), alone and while another
    thread runs tiny torch ops (a CPU model's forward: pyzmq gives up the GIL around every part, and
    taking it back from that thread is what a part costs beyond its copy). Means, which carry the
    waits, and medians."""
    frames = {
        "ready": encode(Frame(PROTOCOL_VERSION, LAYOUT_VERSION, "bench", 1, 1, Ready(0)), BENCH_KEY),
        "prepare_16": encode(Frame(PROTOCOL_VERSION, LAYOUT_VERSION, "bench", 1, 1, decode_prepare(3, steady=True)), BENCH_KEY),
    }
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    stop = threading.Event()
    try:
        receiver.bind("inproc://bench-messages")
        sender.connect("inproc://bench-messages")

        def once(parts: list[bytes]) -> float:
            started = time.perf_counter()
            sender.send_multipart(parts)
            receiver.recv_multipart(copy=False)
            return time.perf_counter() - started

        def ops() -> None:
            scratch = torch.zeros(64)
            while not stop.is_set():
                scratch.add_(1.0)

        report: dict[str, float] = {}
        for beside in ("alone", "beside_torch_ops"):
            if beside != "alone":
                threading.Thread(target=ops, daemon=True).start()
            for name, sections in frames.items():
                layouts = {"3_parts": sections, "1_message": [to_message(sections)]}
                times: dict[str, list[float]] = {layout: [] for layout in layouts}
                for _ in range(repeats):  # interleaved, so that both see the same moments of the machine
                    for layout, parts in layouts.items():
                        times[layout].append(once(parts))
                for layout, got in times.items():
                    report[f"{name}_{layout}_{beside}_mean_us"] = float(np.mean(got) * 1e6)
                    report[f"{name}_{layout}_{beside}_median_us"] = float(np.median(got) * 1e6)
        return report
    finally:
        stop.set()
        sender.close(0)
        receiver.close(0)
        context.term()


@dataclass(frozen=True)
class CollectiveConfig:
    vocab_size: int = BENCH_VOCAB
    num_layers: int = LAYERS
    num_kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    max_position_embeddings: int = 8192
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CollectiveShard:
    local_kv_heads: int


# Where each rank's model writes when each forward started and ended (perf_counter: CLOCK_MONOTONIC,
# one clock for every process of the machine), and at its start the CPU time so far of the rank's
# model thread and of its link thread (STAMP_COLUMNS), and for how many forwards.
TIMES_DIR_ENV = "BENCH_STEP_FORWARD_TIMES"
TIMES_CAPACITY_ENV = "BENCH_STEP_FORWARD_CAPACITY"
# How long each forward takes besides its all_reduce: a real model's step, during which a planned
# ahead PREPARE can be staged.
FORWARD_MS_ENV = "BENCH_STEP_FORWARD_MS"
# How the forward spends that time: `sleep` leaves the GIL to the link thread the whole time (a GPU
# model's thread waiting on its stream); `gil` runs tiny torch ops back to back, holding the GIL for
# each op's Python dispatch and leaving it for each op's kernel, as a CPU model's many small ops
# do: then the link thread's Python work and the model's contend for the GIL, and the gap shows it.
# `device` stands in an asynchronous device (SimulatedDevice): the forward is queued and the call
# returns, and each sample's readback waits for the device's clock, so that the model thread's order
# (--readback) shows in the device's idle time, with what the stand-in leaves out (SimulatedDevice).
FORWARD_KIND_ENV = "BENCH_STEP_FORWARD_KIND"
FORWARD_KINDS = ("sleep", "gil", "device")
REAL_FORWARD = "model"  # --forward model: the default model's forward, through load_stamped
# The real model's loader ("module:function") that load_stamped wraps.
INNER_LOAD_ENV = "BENCH_STEP_INNER_LOAD"
REAL_LOAD = "executor.model:load_model"


STAMP_COLUMNS = ("start", "end", "model_thread_cpu", "link_thread_cpu")


def forward_times_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.npy"


def _stamps(rank: int) -> np.ndarray:
    capacity = int(os.environ[TIMES_CAPACITY_ENV])
    times = np.lib.format.open_memmap(
        forward_times_path(os.environ[TIMES_DIR_ENV], rank), mode="w+", dtype=np.float64,
        shape=(capacity, len(STAMP_COLUMNS)),
    )  # fmt: skip
    times[:] = np.nan
    return times


_WAKE_MARGIN_S = 0.0003


class SimulatedDevice:
    """A device's clock for the `device` forward: each forward is queued behind the work before it
    and takes forward_s; its span is on the device, not the host. A sample's readback (the runner's
    _Readback, replaced in this process by `read_back_behind`) lands when the forward it samples
    ends: the host waits for that in the CPU's order, and may queue the next forward first in the
    pipelined one. What it leaves out: the host's cost of launching a forward (nothing here; a CUDA
    graph's replay is tens of microseconds, an eager forward's launches milliseconds), the device's
    time for sampling, syncs inside a real device path (the sampler runs on host logits here), and
    at several ranks any tie between the ranks' devices beyond the hosts' collectives (the forward's
    all_reduce, the feedback broadcast); within a frame of several forwards a GPU's other ranks
    would also wait for rank 0's sample, which here they get from its host at once."""

    def __init__(self, forward_s: float) -> None:
        self.forward_s = forward_s
        self.free_at = 0.0

    def queue_forward(self) -> tuple[float, float]:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + self.forward_s
        return start, self.free_at

    def read_back_behind(self) -> None:
        """Every sample of this process read back behind an event on this clock (both orders)."""
        from executor import steps

        device = self

        class Landing:
            def __init__(self) -> None:
                self.at = device.free_at

            def query(self) -> bool:
                return time.perf_counter() >= self.at

            def synchronize(self) -> None:
                # A sleep wakes ~0.1 ms late here, where a device's sync returns within microseconds:
                # asleep until just before, then looking, the GIL given up between looks.
                time.sleep(max(0.0, self.at - time.perf_counter() - _WAKE_MARGIN_S))
                while time.perf_counter() < self.at:
                    time.sleep(0)

        def start(inputs: StepInputs, out: object, made: object = None) -> object:  # a device's copy, not the host's arrays
            return steps._Readback(inputs, out, steps.pack_sampled(out), Landing())

        steps._Readback.start = staticmethod(start)


class CollectiveOnlyModel:
    """A forward that is one all_reduce (the peers' rendezvous), --forward-ms of sleep, of tiny
    torch ops or of a simulated device's time, and zero logits on rank 0."""

    fingerprint = "bench-collective-only"

    def __init__(self, rank: int, world_size: int, forward_s: float, kind: str) -> None:
        if kind not in FORWARD_KINDS:
            raise ValueError(f"{FORWARD_KIND_ENV}={kind!r}: expected one of {FORWARD_KINDS}")
        self.rank = rank
        self.forward_s = forward_s
        self.kind = kind
        self.world_size = world_size
        self.config = CollectiveConfig()
        self.shard = CollectiveShard(local_kv_heads=len(range(rank, KV_HEADS, world_size)))
        self.token = torch.zeros(1)
        self._scratch = torch.zeros(64)
        # A model's rows are peaked (a few likely tokens), which the sampler's top-p takes by its fast
        # path; zeros would be its flat worst case, a cost of the sampler, not of the control plane.
        self._logits = torch.randn(DECODE_SEQS, BENCH_VOCAB, generator=torch.Generator().manual_seed(0)) * 4
        self.device = SimulatedDevice(forward_s) if kind == "device" else None
        self.span: tuple[float, float] | None = None  # the last forward's, on the device's clock

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None:
        started = time.perf_counter()
        if self.world_size > 1:
            torch.distributed.all_reduce(self.token)
        if self.device is not None:
            self.span = self.device.queue_forward()
        elif self.kind == "sleep":
            time.sleep(self.forward_s)
        else:
            end = started + self.forward_s
            while time.perf_counter() < end:
                self._scratch.add_(1.0)
        if self.rank != 0:
            return None
        rows = inputs.sample_rows.shape[0]
        return self._logits.repeat(-(-rows // DECODE_SEQS), 1)[:rows]


class StampedModel:
    """Any step model, with the start and end of each forward and the CPU clocks of the rank's model
    and link threads (STAMP_COLUMNS) written into a memory-mapped file, which the benchmark reads
    once the ranks have exited: no frame carries them."""

    def __init__(self, inner: object, times: np.ndarray, rank: int) -> None:
        self.inner = inner
        self.fingerprint = inner.fingerprint
        self.config = inner.config
        self.shard = inner.shard
        self.times = times
        self.forwards = 0
        self._link_thread = link_thread_name(rank)
        self._link_clock: int | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None:
        started = time.perf_counter()
        stamped = self.forwards < len(self.times)
        # The CPU clocks are read, and the row stored, inside the forward's span: after the end
        # stamp, the gap that follows counted them as the runtime's (~25 us after a sleeping
        # forward on the Xeon VM: docs/control_plane.md, change 107).
        if stamped:
            self.times[self.forwards] = (started, np.nan, time.thread_time(), self._link_cpu())
        logits = self.inner.forward(inputs, cache)
        ended = time.perf_counter()
        if stamped:
            # A simulated device's forward is stamped where it runs, on the device's clock.
            span = getattr(self.inner, "span", None)
            if span is None:
                self.times[self.forwards, 1] = ended
            else:
                self.times[self.forwards, :2] = span
        self.forwards += 1
        return logits

    def _link_cpu(self) -> float:
        if self._link_clock is None:
            link = next(t for t in threading.enumerate() if t.name == self._link_thread)
            self._link_clock = time.pthread_getcpuclockid(link.ident)
        return time.clock_gettime(self._link_clock)


def load_collective_only(path, *, rank, world_size, dtype, device, weight_format, progress, deterministic=False) -> StampedModel:
    # No kernels to make deterministic: the forward is a collective and a wait.
    forward_s = float(os.environ.get(FORWARD_MS_ENV, "0")) / 1000
    inner = CollectiveOnlyModel(rank, world_size, forward_s, os.environ.get(FORWARD_KIND_ENV, "sleep"))
    if inner.device is not None:
        inner.device.read_back_behind()
    return StampedModel(inner, _stamps(rank), rank)


def load_stamped(path, **kwargs: object) -> StampedModel:
    """The loader named by BENCH_STEP_INNER_LOAD, its model's forwards stamped."""
    import importlib

    module, _, function = os.environ[INNER_LOAD_ENV].partition(":")
    inner = getattr(importlib.import_module(module), function)(path, **kwargs)
    rank = int(kwargs["rank"])
    return StampedModel(inner, _stamps(rank), rank)


def forward_gaps(times_by_rank: list[np.ndarray], forwards: int) -> np.ndarray:
    """Seconds from the end of forward N on the last rank to finish it to the start of forward N+1
    on the last rank to start it: the time in which no forward can run, for N = 1 .. forwards-1."""
    stacked = np.stack([t[:forwards] for t in times_by_rank])  # [rank, forward, (start, end)]
    if np.isnan(stacked).any():
        raise RuntimeError(f"a rank recorded fewer than {forwards} forwards")
    last_start, last_end = stacked[:, :, 0].max(axis=0), stacked[:, :, 1].max(axis=0)
    return last_start[1:] - last_end[:-1]


def frame_gaps(gaps: np.ndarray, first: int, forwards: int) -> tuple[np.ndarray, np.ndarray]:
    """forward_gaps' gaps from the one after forward `first` on, in frames of `forwards` forwards:
    those inside a frame and those between two (after a frame's last forward)."""
    between = (np.arange(first, first + gaps.shape[0]) + 1) % forwards == 0
    return gaps[~between], gaps[between]


def quantiles_us(seconds: list[float] | np.ndarray) -> dict[str, float]:
    values = np.asarray(seconds) * 1e6
    return {"median": float(np.median(values)), "p90": float(np.percentile(values, 90))}


@dataclass(frozen=True)
class LoopSpec:
    """One run of the step loop: world size, steps, rows per decode step, the fake forward, and
    serial (max_inflight 1) or overlapped (2) planning, how steady steps travel (STEADY_KINDS), and
    the forwards each step's frame runs (decode_steps, --num-scheduler-steps)."""

    world_size: int = 1
    steps: int = 100
    rows: int = DECODE_SEQS
    forward_ms: float = 5.0
    forward: str = "sleep"
    max_inflight: int = 2
    steady: str = "continue"
    readback: str = "at-once"  # a name of READBACK_ORDERS: the model thread's order
    forwards: int = 1


def loop_options(rows: int = DECODE_SEQS, readback: str = "at-once") -> ExecutorOptions:
    g = bench_geometry(rows)
    return ExecutorOptions(
        pipelined_readback=READBACK_ORDERS[readback],
        model="bench",
        num_kv_pages=g.num_kv_pages,
        page_size=g.page_size,
        max_num_seqs=g.max_num_seqs,
        max_num_batched_tokens=g.max_num_batched_tokens,
        max_model_len=g.max_model_len,
        device="cpu",
        peer_timeout_s=60.0,
        heartbeat_interval_s=30.0,  # out of the way of the measurement; the driver is never idle long
    )


class _LoopDriver:
    """The scheduler's side of the step loop, driven as the engine drives it through the
    protocol's conversation, with the time of each phase of every step."""

    def __init__(self, endpoint: object, world_size: int, max_inflight: int, rows: int, steady: str, forwards: int = 1) -> None:
        from protocol.conversation import SchedulerConversation

        self.endpoint = endpoint
        # As the engine's step loop: a group of one rank runs on its READY (protocol/frames.py Welcome).
        self.conv = SchedulerConversation(
            world_size=world_size, run_id="bench", max_inflight=max_inflight, ready_is_go=world_size == 1
        )
        self.max_inflight = max_inflight
        self.rows = rows
        self.steady = steady
        self.forwards = forwards
        self.held: Prepare | None = None  # the step before's PREPARE, as the ranks expand a CONTINUE after it
        self.sent: dict[int, float] = {}
        self.ready_at: dict[int, float] = {}
        self.go_at: dict[int, float] = {}
        self.phases: dict[str, list[float]] = {"step": [], "prepare_to_all_ready": [], "go_to_all_done": []}
        self.model_gaps_us: list[int] = []  # rank 0's RESULT.gap_us: its model thread idle between steps
        self.rode: set[int] = set()  # steps whose READY came in the RESULT of the step before

    def next_step(self, step: int) -> tuple[Prepare, Continue | None]:
        """The step's PREPARE, and the CONTINUE that says it when --steady continue and the rows'
        pages have room for the frame's tokens (their context starts again in a PREPARE after)."""
        held, forwards = self.held, self.forwards
        if self.steady == "continue" and held is not None and int(held.final_context_lens[0]) + forwards <= PAGES_PER_SEQ * PAGE_SIZE:
            i32 = np.int32
            cleared = np.array([self.rows * PAGES_PER_SEQ + step % 64], dtype=i32)
            brief = Continue(np.full(self.rows, -1, dtype=i32), cleared, np.zeros(0, dtype=i32), decode_steps=forwards)
            body = expand(held, brief)
        else:
            brief, body = None, decode_prepare(step, self.rows, steady=step > 1, forwards=forwards)
        self.held = body
        return body, brief

    def events(self, timeout_ms: int = 100) -> list[object]:
        got = self.endpoint.recv(timeout_ms)
        return [] if got is None else self.conv.receive(got.rank, got.frame or got.error, time.monotonic())

    def handshake(self, timeout_s: float = 120) -> None:
        from protocol.conversation import HandshakeComplete, Phase

        deadline = time.monotonic() + timeout_s
        while self.conv.phase is Phase.HANDSHAKE and time.monotonic() < deadline:
            for event in self.events():
                if not isinstance(event, HandshakeComplete):
                    raise RuntimeError(f"the handshake failed: {event}")
        self.endpoint.version = self.conv.version
        self.endpoint.send_all(self.conv.ranks, *self.conv.welcome())

    def run(self, steps: int) -> None:
        """PREPARE to all, every READY, GO to all, every RESULT/DONE; with max_inflight 2 the next
        PREPARE goes out as soon as GO is out, as the engine does with async scheduling. Steps
        after the first are steady ones (feedback rows, held page tables), as a server's are."""
        from protocol.conversation import StepDone, StepReady

        conv, endpoint = self.conv, self.endpoint
        finished = 0
        while finished < steps:
            while conv.next_step <= steps and conv.staged is None and len(conv.in_flight) < self.max_inflight:
                step = conv.next_step
                endpoint.send_all(conv.ranks, *conv.prepare(step, *self.next_step(step)))
                self.sent[step] = time.perf_counter()
            for event in self.events():
                now = time.perf_counter()
                if isinstance(event, StepReady):
                    self.ready_at[event.step] = now
                    go = conv.go(event.step)
                    if go is not None:
                        endpoint.send_all(conv.ranks, *go)
                    self.go_at[event.step] = time.perf_counter()
                elif isinstance(event, StepDone):
                    finished += 1
                    n = event.step
                    self.phases["step"].append(now - self.sent[n])
                    if n not in self.rode:
                        self.phases["prepare_to_all_ready"].append(self.ready_at[n] - self.sent[n])
                    self.phases["go_to_all_done"].append(now - self.go_at[n])
                    self.model_gaps_us.append(event.result.gap_us)
                    if event.next_ready:  # a lone rank's READY for n + 1 rode in this RESULT
                        self.rode.add(n + 1)
                        self.ready_at[n + 1] = now
                        conv.go(n + 1)
                        self.go_at[n + 1] = time.perf_counter()
                else:
                    raise RuntimeError(f"the step loop broke: {event}")
        endpoint.send_all(conv.ranks, *conv.shutdown("bench done"))


def real_forward_options(rows: int, readback: str) -> ExecutorOptions:
    """The loop's options with the embedded default model in the dtype `serve` picks on this machine."""
    from executor.default_model import default_model_path
    from executor.probe import probe_cpu

    return replace(loop_options(rows, readback), model=str(default_model_path()), dtype=probe_cpu().dtype)


def measure_loop(spec: LoopSpec) -> dict[str, object]:
    """The step loop as `spec` says, with executors started by scripts/harness/executors.py: the time
    each step spends outside its forward, and the gap between two forwards. A fake forward
    (load_collective_only), or with spec.forward REAL_FORWARD the default model's (load_stamped)."""
    from protocol.auth import new_key
    from protocol.transport import SchedulerEndpoint, ipc_address
    from scripts.harness.executors import ExecutorCluster
    from scripts.harness.processes import cpu_seconds
    from tp_runtime.launcher import rank_threads

    real = spec.forward == REAL_FORWARD
    options = real_forward_options(spec.rows, spec.readback) if real else loop_options(spec.rows, spec.readback)
    load = "scripts.bench_step:load_stamped" if real else "scripts.bench_step:load_collective_only"
    key = new_key()
    endpoint = SchedulerEndpoint(ipc_address(), key, "bench")
    driver = _LoopDriver(endpoint, spec.world_size, spec.max_inflight, spec.rows, spec.steady, spec.forwards)
    forwards = spec.steps * spec.forwards
    try:
        with tempfile.TemporaryDirectory(prefix="bench-step-") as times_dir:
            cluster = ExecutorCluster(
                spec.world_size,
                address=endpoint.address,
                key=key,
                run_id="bench",
                options=options,
                load=load,
                collective_timeout_s=60.0,
                log_level="WARNING",
                env={
                    TIMES_DIR_ENV: times_dir,
                    TIMES_CAPACITY_ENV: str(forwards),
                    FORWARD_MS_ENV: str(spec.forward_ms),
                    FORWARD_KIND_ENV: spec.forward,
                    # A real forward on each rank's share of the cores, as served (and with them its sampler's threads).
                    **({INNER_LOAD_ENV: REAL_LOAD, "OMP_NUM_THREADS": str(rank_threads(spec.world_size))} if real else {}),
                },
            )
            with cluster:
                driver.handshake()
                pids = cluster.pids()
                cpu_before = {rank: cpu_seconds(pid) for rank, pid in pids.items()}
                driver_before = time.process_time()
                driver.run(spec.steps)
                driver_cpu = time.process_time() - driver_before
                cpu = {f"rank{rank}": (cpu_seconds(pid) or 0.0) - (cpu_before[rank] or 0.0) for rank, pid in pids.items()}
                codes = cluster.stop(grace_s=30.0)
            if any(codes.values()):
                raise RuntimeError(f"the executors exited with codes {codes}")
            times = [np.load(forward_times_path(times_dir, rank)) for rank in range(spec.world_size)]
    finally:
        endpoint.close()
    warmup = min(10, spec.steps // 4)
    gaps = forward_gaps(times, forwards)[warmup * spec.forwards :]
    within, between = frame_gaps(gaps, warmup * spec.forwards, spec.forwards)
    warm = {name: values[warmup:] for name, values in driver.phases.items()}
    return {
        "median_step_us": statistics.median(warm["step"]) * 1e6,
        "p90_step_us": float(np.percentile(warm["step"], 90) * 1e6),
        "steps": len(warm["step"]),
        "forward_gap_us": quantiles_us(gaps),
        # Several forwards a frame (--num-scheduler-steps, a server's steady decode): the gaps inside
        # a frame (rank 0's sample and its feedback, no frame between) and those between two frames.
        **(
            {"forward_gap_within_frame_us": quantiles_us(within), "forward_gap_between_frames_us": quantiles_us(between)}
            if spec.forwards > 1
            else {}
        ),
        # Rank 0's model thread from the end of a step (its samples drawn) to the start of the
        # next one (its feedback tokens): the forward gap less the sampling and the cache work.
        "model_idle_us": quantiles_us(np.asarray(driver.model_gaps_us[warmup + 1 :]) / 1e6),
        # Over the steps whose READY came in a frame of its own: a lone rank's READY for a step it
        # receives while the one before runs rides in that step's RESULT (protocol version 8).
        "prepare_to_all_ready_us": quantiles_us(warm["prepare_to_all_ready"]) if warm["prepare_to_all_ready"] else None,
        "ready_in_result_share": len([n for n in driver.rode if n > warmup]) / max(1, len(warm["step"])),
        "go_to_all_done_us": quantiles_us(warm["go_to_all_done"]),
        # CPU time (all threads) per step: the driver is the scheduler's side of the protocol (no
        # planning); a rank's includes its forward when that is `gil`. Unlike the times above, it
        # barely moves when other processes load the machine.
        "cpu_us_per_step": {
            "driver": driver_cpu / spec.steps * 1e6,
            **{name: seconds / spec.steps * 1e6 for name, seconds in cpu.items()},
            # From the stamps, over the warm steps: the model thread (sampling and the cache work
            # between forwards, and the forward when it is `gil`) and the link thread (receiving,
            # checking and staging each step, sending its answers), apart.
            **{
                f"rank{rank}_{thread}": float(np.diff(stamps[[warmup * spec.forwards, forwards - 1], STAMP_COLUMNS.index(f"{thread}_cpu")])[0])
                / (forwards - 1 - warmup * spec.forwards) * spec.forwards * 1e6
                for rank, stamps in enumerate(times)
                for thread in ("model_thread", "link_thread")
            },
        },
    }


# The figures of a loop run that --baseline compares, by their path in measure_loop's report.
# Frames of several forwards (--num-scheduler-steps) add their gaps within a frame and between two:
# a change to a later forward's path shows in the former alone (docs/control_plane.md, change 114).
COMPARED = (
    ("forward_gap_us", "median"), ("forward_gap_us", "p90"), ("forward_gap_within_frame_us", "median"),
    ("forward_gap_between_frames_us", "median"), ("prepare_to_all_ready_us", "median"),
)
THIS_TREE, BASELINE = "this", "baseline"
# Options of this run that a baseline's run does not take: it runs the loop alone, as JSON, once.
_NOT_PASSED_ON = {"--baseline": 1, "--rounds": 1, "--json": 0, "--loop-only": 0}


def loop_argv(argv: list[str]) -> list[str]:
    """This run's options less those _NOT_PASSED_ON (with their values): the loop each tree runs."""
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name, has_value, _ = arg.partition("=")
        if name in _NOT_PASSED_ON:
            skip = 0 if has_value else _NOT_PASSED_ON[name]
            continue
        kept.append(arg)
    return kept


# Set in a compared tree's run: a run that compares is never started by one (no loop of runs).
COMPARED_RUN_ENV = "BENCH_STEP_COMPARED_RUN"
# A compared run that takes longer than this has a rank hung: the comparison ends with an error.
COMPARED_RUN_S = 1800


def loop_in(tree: Path, argv: list[str]) -> dict[str, dict]:
    """The loop report of `tree`'s bench_step (it puts its own tree first on sys.path)."""
    command = [sys.executable, str(tree / "scripts" / "bench_step.py"), "--loop-only", "--json", *argv]
    env = os.environ | {COMPARED_RUN_ENV: "1"}
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False, timeout=COMPARED_RUN_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"bench_step in {tree} ran past {COMPARED_RUN_S} s") from exc
    if done.returncode:
        raise RuntimeError(f"bench_step in {tree} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)["loop"]


def sampler_missing(tree: Path) -> str | None:
    """Why `tree`'s own executor would not sample with its compiled sampler, or None where it
    would: a checkout where it was never built samples in torch and numpy, and would be compared on
    another sampler than this tree's (and one whose executor is not its own is not that tree)."""
    probe = (
        "import os, sys; sys.path.insert(0, os.getcwd()); import executor.sampler as s; "
        "own = os.path.dirname(s.__file__) == os.path.join(os.getcwd(), 'executor'); "
        "print('built' if own and s._sampling is not None else 'not built' if own else 'executor from ' + s.__file__)"
    )
    try:
        done = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True, check=False, timeout=120)
    except subprocess.TimeoutExpired:
        return "its executor did not import within 120 s"
    if done.returncode:
        return f"its executor does not import: {done.stderr.strip()[-500:]}"
    said = done.stdout.strip()
    return None if said == "built" else f"its compiled sampler (executor/_sampling) is {said}"


def compare_trees(argv: list[str], baseline: Path, rounds: int) -> dict[str, object]:
    """Both trees' loops, `rounds` times each, alternately (this tree first in the odd rounds)."""
    missing = {REPO: sampler_missing(REPO), baseline: sampler_missing(baseline)}
    if (missing[REPO] is None) != (missing[baseline] is None):
        tree, why = next((tree, why) for tree, why in missing.items() if why is not None)
        raise RuntimeError(
            f"{tree}: {why}, where the other tree's is built; build it there, "
            "`python -c 'from setuptools import setup; setup()' build_ext --inplace`, so that both trees sample alike"
        )
    runs: dict[str, list[dict[str, dict]]] = {THIS_TREE: [], BASELINE: []}
    for round_ in range(rounds):
        for tree in (THIS_TREE, BASELINE) if round_ % 2 == 0 else (BASELINE, THIS_TREE):
            runs[tree].append(loop_in(REPO if tree == THIS_TREE else baseline, argv))
    return {"rounds": rounds, "baseline": str(baseline), "runs": runs, "paired": paired(runs)}


def paired(runs: dict[str, list[dict[str, dict]]]) -> dict[str, dict[str, dict[str, object]]]:
    """Per run of the loop and COMPARED figure: each tree's values round by round, their medians,
    and the median of the rounds' differences (this tree's less the baseline's). A figure that a
    round lacks (PREPARE to every READY at one rank) is left out."""
    report: dict[str, dict[str, dict[str, object]]] = {}
    for case in runs[THIS_TREE][0]:
        for phase, quantile in COMPARED:
            pairs = [
                (mine[case][phase][quantile], theirs[case][phase][quantile])
                for mine, theirs in zip(runs[THIS_TREE], runs[BASELINE])
                if case in theirs and mine[case].get(phase) and theirs[case].get(phase)
            ]
            if pairs:
                report.setdefault(case, {})[f"{phase}.{quantile}"] = {
                    THIS_TREE: [round(a, 1) for a, _ in pairs],
                    BASELINE: [round(b, 1) for _, b in pairs],
                    f"{THIS_TREE}_median": round(statistics.median(a for a, _ in pairs), 1),
                    f"{BASELINE}_median": round(statistics.median(b for _, b in pairs), 1),
                    "difference_median": round(statistics.median(a - b for a, b in pairs), 1),
                }
    return report


def main() -> None:
    # No abbreviations: a baseline's run gets this run's options less --baseline and --rounds by
    # their full names (loop_argv).
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--ranks", default="1,2,3", help="world sizes for the loop benchmark")
    parser.add_argument("--steps", type=int, default=200, help="steps per world size")
    parser.add_argument("--loop-only", action="store_true", help="only the step loop (for before/after runs)")
    parser.add_argument("--messages", action="store_true", help="only a frame's send + receive, three parts against one message")
    parser.add_argument(
        "--frames", action="store_true", help="only a steady step's encode, decode and validation, as PREPARE and CONTINUE"
    )
    parser.add_argument(
        "--forward-ms", type=float, default=10.0,
        help="each forward's length besides its all_reduce (default 10: a small model's decode step on a CPU)",
    )
    parser.add_argument(
        "--modes", default="serial,overlap",
        help="serial: the next PREPARE after the RESULT; overlap: after the GO, as --async-scheduling does",
    )
    parser.add_argument("--rows", default=str(DECODE_SEQS), help="rows per decode step (comma-separated: several runs)")
    parser.add_argument(
        "--forward", default="sleep", help=f"the forward: {' or '.join((*FORWARD_KINDS, REAL_FORWARD))} (comma-separated: several runs)"
    )
    parser.add_argument(
        "--readback", default="at-once",
        help=f"the model thread's order: {' or '.join(READBACK_ORDERS)} (comma-separated: several runs; pipelined is a "
        "CUDA device's, and shows with --forward device)",
    )
    parser.add_argument(
        "--num-scheduler-steps", default="1", metavar="N",
        help="forwards each step's frame runs (decode_steps; vLLM's flag, the server's default is "
        f"{DEFAULT_SCHEDULER_STEPS}; comma-separated: several runs)",
    )
    parser.add_argument(
        "--steady", default="continue",
        help=f"how steady decode steps travel: {' or '.join(STEADY_KINDS)} (comma-separated: several runs)",
    )
    parser.add_argument(
        "--baseline", type=Path, default=None, metavar="DIR",
        help="another checkout: its loop and this tree's in turn, with the rounds' differences (with --loop-only)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: runs of each tree (default 3)")
    args = parser.parse_args()
    if args.baseline is not None:
        if os.environ.get(COMPARED_RUN_ENV):
            parser.error("--baseline in a run that a comparison started")
        if not args.loop_only:
            parser.error("--baseline compares the step loop: give --loop-only")
        if not (args.baseline / "scripts" / "bench_step.py").is_file():
            parser.error(f"--baseline {args.baseline}: no scripts/bench_step.py there")
        if args.rounds < 1:
            parser.error("--rounds takes 1 or more")
        compared = compare_trees(loop_argv(sys.argv[1:]), args.baseline.resolve(), args.rounds)
        if args.json:
            print(json.dumps(compared, indent=2))
            return
        for case, figures in compared["paired"].items():
            for figure, values in figures.items():
                print(
                    f"{case} {figure}: this {values[f'{THIS_TREE}_median']:.0f} us, baseline "
                    f"{values[f'{BASELINE}_median']:.0f} us (medians of {len(values[THIS_TREE])}); "
                    f"the rounds' differences' median {values['difference_median']:+.0f} us"
                )
        return
    retain_freed_memory()  # as the executor does: the sampler's timings depend on it
    torch.set_num_threads(1)
    report: dict[str, object] = {}
    if args.messages or args.frames:
        if args.messages:
            report["messages"] = message_costs()
        if args.frames:
            report["steady_frames"] = {f"rows={rows}": steady_frame_costs(int(rows)) for rows in args.rows.split(",")}
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            for part in report.values():
                for name, value in part.items():
                    print(f"{name}: {value}" if isinstance(value, dict) else f"{name}: {value:.1f}")
        return
    if not args.loop_only:
        report |= {"bandwidth": bandwidth(), "clear_pages_bf16_smollm2_pages": clear_cost(), "step_pieces": step_pieces()}
    inflight = {"serial": 1, "overlap": 2}
    steadies = args.steady.split(",")
    if set(steadies) - set(STEADY_KINDS):
        parser.error(f"--steady takes {' or '.join(STEADY_KINDS)}")
    if set(args.forward.split(",")) - {*FORWARD_KINDS, REAL_FORWARD}:
        parser.error(f"--forward takes {' or '.join((*FORWARD_KINDS, REAL_FORWARD))}")
    readbacks = args.readback.split(",")
    if set(readbacks) - set(READBACK_ORDERS):
        parser.error(f"--readback takes {' or '.join(READBACK_ORDERS)}")
    frames = args.num_scheduler_steps.split(",")
    if not all(f.isdigit() and 1 <= int(f) <= max_decode_steps(PAGE_SIZE) for f in frames):
        parser.error(f"--num-scheduler-steps takes whole numbers from 1 to {max_decode_steps(PAGE_SIZE)}")
    report["loop"] = {
        f"{mode}/{w}/rows={rows}/{forward}" + (f"/{steady}" if len(steadies) > 1 else "")
        + (f"/{readback}" if len(readbacks) > 1 else "")
        + (f"/forwards={f}" if frames != ["1"] else ""): measure_loop(
            LoopSpec(int(w), args.steps, int(rows), args.forward_ms, forward, inflight[mode], steady, readback, int(f))
        )
        for w in args.ranks.split(",")
        for rows in args.rows.split(",")
        for forward in args.forward.split(",")
        for mode in args.modes.split(",")
        for steady in steadies
        for readback in readbacks
        for f in frames
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    if not args.loop_only:
        print_pieces(report)
    for run, loop in report["loop"].items():
        gap, idle = loop["forward_gap_us"], loop["model_idle_us"]
        ready, done = loop["prepare_to_all_ready_us"], loop["go_to_all_done_us"]
        ready_alone = "-" if ready is None else f"{ready['median']:.0f} us"
        print(
            f"loop {run}: median {loop['median_step_us']:.0f} us/step, p90 {loop['p90_step_us']:.0f}; "
            f"gap between two forwards median {gap['median']:.0f} us, p90 {gap['p90']:.0f}; "
            f"model thread idle median {idle['median']:.0f} us, p90 {idle['p90']:.0f} "
            f"(PREPARE to every READY {ready_alone}, READY in the RESULT before "
            f"{loop['ready_in_result_share']:.0%} of steps, GO to every RESULT/DONE {done['median']:.0f} us)"
        )


def print_pieces(report: dict) -> None:
    bw = report["bandwidth"]
    print(f"memory copy {bw['copy_read_plus_write_gb_s']:.1f} GB/s (read+write), fill {bw['fill_write_gb_s']:.1f} GB/s")
    clear = report["clear_pages_bf16_smollm2_pages"]
    print(f"clear_pages, {clear['page_bytes']} B pages:")
    print(
        f"  one page per run: {clear['single_page_runs_us_per_page']:.1f} us/page "
        f"({clear['single_page_runs_gb_s']:.1f} GB/s)"
    )
    for run in (8, 64):
        print(
            f"  runs of {run}: {clear[f'runs_of_{run}_us_per_run']:.1f} us/run, "
            f"{clear[f'runs_of_{run}_us_per_page']:.1f} us/page ({clear[f'runs_of_{run}_gb_s']:.1f} GB/s)"
        )
    for name, value in report["step_pieces"].items():
        print(f"{name}: {value:.1f}")


if __name__ == "__main__":
    main()
