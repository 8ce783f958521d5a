"""CUDA graph capture of the decode forward for a set of batch sizes and page-table widths.

A decode step of n sequences whose page tables are w pages wide is padded to the smallest captured
(size B >= n, width W >= w): its inputs are copied into static buffers and that graph is replayed.
Widths are powers of two up to geometry.max_pages_per_seq, because attention cost grows with the
table width: one graph at the longest context would make every short decode pay for it. Padding
rows and columns read only the pad page; padding rows write their K/V into it, and every captured
graph ends by zeroing the pad page again, so it stays all zero as KVCache promises.

Requirements on the model's decode path (all of them hold for a forward that derives shapes from
its tensors): no host synchronization, no shape taken from host copies.

Steps that are not pure decode, or larger than the largest size, or that sample fewer rows than
they have sequences, run eagerly, and so does the step that calibrates an fp8 cache's scales (its
writes go through KVCache.write, which sets them). The graphs read the scales from the cache's
device tensor at replay, so the calibrated values are the ones they use.
Nothing here imports CUDA until a runner is built.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

import numpy as np
import torch

from executor.cache import KVCache
from executor.inputs import StepInputs
from protocol.errors import TPRuntimeError
from protocol.frames import CacheGeometry, Prepare

class CudaGraphError(TPRuntimeError, RuntimeError):
    """The decode forward cannot be captured as CUDA graphs."""


class Pad(Enum):
    """How the graph of one (size B, width W) serves a decode step of n <= B sequences through one
    StepInputs field."""

    ROWS = "copied into the static buffer's first n rows; the other rows get the field's fill"
    TABLE = "copied into the first n rows and w columns; every other entry is the pad page"
    SHAPE = "the same for every decode step of B sequences: set when the buffers are made"
    SAMPLER = "read from the step's own inputs by the sampler after the replay, never by the graph"
    HOST = "a host copy that the decode forward does not read, so a replay never depends on it"


@dataclass(frozen=True)
class FieldPadding:
    pad: Pad
    # Pad.ROWS: the value of a padding row, given the static batch (its pad page, its context).
    fill: Callable[[StaticDecodeBatch], int] | None = None


# One rule for every StepInputs field. A field without one would replay with a stale buffer, so
# the runner refuses to start (check_padding_rules), and tests/executor/test_graph_padding.py
# runs that check, and each rule, on the CPU.
FIELD_PADDING: dict[str, FieldPadding] = {
    "token_ids": FieldPadding(Pad.ROWS, lambda b: 0),
    "positions": FieldPadding(Pad.ROWS, lambda b: b.context - 1),
    "query_lens": FieldPadding(Pad.SHAPE),
    "query_start": FieldPadding(Pad.SHAPE),
    "context_lens": FieldPadding(Pad.ROWS, lambda b: b.context),
    "page_table": FieldPadding(Pad.TABLE),
    "write_pages": FieldPadding(Pad.ROWS, lambda b: b.pad_page),
    "write_offsets": FieldPadding(Pad.ROWS, lambda b: (b.context - 1) % b.page_size),
    "sample_rows": FieldPadding(Pad.SHAPE),
    "sample_seq_ids": FieldPadding(Pad.SAMPLER),
    "temperature": FieldPadding(Pad.SAMPLER),
    "top_p": FieldPadding(Pad.SAMPLER),
    "top_k": FieldPadding(Pad.SAMPLER),
    "seeds": FieldPadding(Pad.SAMPLER),
    "sample_positions": FieldPadding(Pad.SAMPLER),
    "num_logprobs_host": FieldPadding(Pad.SAMPLER),
    "num_logprobs": FieldPadding(Pad.SAMPLER),
    "is_decode": FieldPadding(Pad.SHAPE),
    "num_seqs": FieldPadding(Pad.SHAPE),
    "num_tokens": FieldPadding(Pad.SHAPE),
    "query_lens_host": FieldPadding(Pad.SHAPE),
    "context_lens_host": FieldPadding(Pad.HOST),
}


def check_padding_rules(declared: Iterable[str], rules: Mapping[str, FieldPadding] = FIELD_PADDING) -> None:
    """Refuses StepInputs fields without a padding rule, and rules for fields that do not exist."""
    declared = set(declared)
    missing, stale = sorted(declared - set(rules)), sorted(set(rules) - declared)
    if missing or stale:
        raise CudaGraphError(
            "the CUDA graph runner's padding rules do not match StepInputs: "
            + "; ".join(
                part
                for part in (
                    f"no rule for {', '.join(missing)}" if missing else "",
                    f"rules for fields it does not have: {', '.join(stale)}" if stale else "",
                )
                if part
            )
        )
    for name, rule in rules.items():
        if (rule.fill is None) == (rule.pad is Pad.ROWS):
            raise CudaGraphError(f"the padding rule of StepInputs.{name} must have a fill exactly when it pads rows")


class StaticDecodeBatch:
    """Static StepInputs buffers of one (batch size, table width), and the copy of a real decode
    step into them, field by field as FIELD_PADDING says."""

    def __init__(self, size: int, width: int, geometry: CacheGeometry, cache: KVCache) -> None:
        self.size = size
        self.width = width
        self.geometry = geometry
        self.pad_page = cache.pad_page
        self.page_size = cache.page_size
        # Every padding row gets the longest context such a table holds.
        self.context = min(width * cache.page_size, geometry.max_model_len)
        self.inputs = StepInputs.from_prepare(
            padding_prepare(size, width, geometry, cache.pad_page),
            pad_page=cache.pad_page,
            page_size=cache.page_size,
            device=cache.device,
        )

    def fits(self, real: StepInputs) -> bool:
        return (
            real.is_decode
            and real.num_seqs <= self.size
            and real.sample_rows.shape[0] == real.num_seqs
            and real.page_table.shape[1] <= self.width
        )

    def load(self, real: StepInputs) -> None:
        """Copy a decode step into the static buffers and re-pad the rows it does not use."""
        if not self.fits(real):
            raise CudaGraphError(
                f"a step of {real.num_seqs} sequences, {real.page_table.shape[1]} pages wide, does not "
                f"fit the graph of {self.size} x {self.width}"
            )
        n = real.num_seqs
        for name, rule in FIELD_PADDING.items():
            if rule.pad is Pad.ROWS:
                static = getattr(self.inputs, name)
                static[:n].copy_(getattr(real, name))
                static[n:].fill_(rule.fill(self))
            elif rule.pad is Pad.TABLE:
                static, width = getattr(self.inputs, name), getattr(real, name).shape[1]
                static[:n, :width].copy_(getattr(real, name))
                static[:n, width:].fill_(self.pad_page)
                static[n:].fill_(self.pad_page)


@dataclass
class CapturedGraph:
    batch: StaticDecodeBatch  # the static buffers the graph reads
    graph: Any  # torch.cuda.CUDAGraph; None when the runner does not capture
    logits: torch.Tensor | None  # the static buffer the graph writes, [size, vocab]; None off rank 0


MIN_GRAPH_WIDTH = 16  # pages; narrower tables are padded up to it


def graph_widths(geometry: CacheGeometry) -> list[int]:
    """Page-table widths to capture: powers of two from MIN_GRAPH_WIDTH, and the widest table."""
    widest = geometry.max_pages_per_seq
    widths = []
    width = MIN_GRAPH_WIDTH
    while width < widest:
        widths.append(width)
        width *= 2
    return [*widths, widest]


def padding_prepare(batch_size: int, width: int, geometry: CacheGeometry, pad_page: int) -> Prepare:
    """A decode step of batch_size sequences, tables `width` pages wide, touching only the pad page.

    Every row gets the longest context such a table holds, so the static buffers have the shapes of
    any decode step up to that width.
    """
    context = min(width * geometry.page_size, geometry.max_model_len)
    return Prepare.greedy_decode(
        context_lens=np.full(batch_size, context),
        token_ids=np.zeros(batch_size),
        page_table_lens=np.full(batch_size, width),
        page_table=np.full(batch_size * width, pad_page),
    )


class DecodeGraphRunner:
    """Wraps a model: forward() replays a captured graph for decode steps, runs eagerly otherwise.

    capture=False runs each decode step eagerly on the padded static buffers a graph would read,
    with no CUDA: what the graphs compute, checkable on the CPU against the plain forward.
    """

    def __init__(
        self,
        model: Any,
        cache: KVCache,
        *,
        geometry: CacheGeometry,
        batch_sizes: tuple[int, ...],
        warmup_iters: int = 2,
        capture: bool = True,
    ) -> None:
        if capture and cache.device.type != "cuda":
            raise CudaGraphError(f"CUDA graphs need the cache on a CUDA device, not {cache.device}")
        check_padding_rules(f.name for f in fields(StepInputs))
        self.model = model
        self.fingerprint = model.fingerprint
        self.config = model.config
        self.cache = cache
        self.geometry = geometry
        self.sizes = sorted(set(b for b in batch_sizes if b <= geometry.max_num_seqs))
        if not self.sizes:
            raise CudaGraphError(
                f"no CUDA graph batch size in {batch_sizes} fits max_num_seqs {geometry.max_num_seqs}"
            )
        self.widths = graph_widths(geometry)
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.captured = capture
        if capture:
            self._capture_all(warmup_iters)
        else:
            for size, width in ((b, w) for b in self.sizes for w in self.widths):
                self.graphs[(size, width)] = CapturedGraph(StaticDecodeBatch(size, width, geometry, cache), None, None)

    def __getattr__(self, name: str) -> Any:
        # Everything else (shard, ...) is the wrapped model's.
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def _capture_all(self, warmup_iters: int) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then reuse the largest one's memory from the shared pool.
        for size, width in sorted(((b, w) for b in self.sizes for w in self.widths), reverse=True):
            batch = StaticDecodeBatch(size, width, self.geometry, self.cache)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup_iters):
                    self.model.forward(batch.inputs, self.cache)
                self._zero_pad_page()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.forward(batch.inputs, self.cache)
                self._zero_pad_page()
            self.graphs[(size, width)] = CapturedGraph(batch, graph, logits)
        torch.cuda.synchronize()

    def _zero_pad_page(self) -> None:
        self.cache.data[self.cache.pad_page].zero_()

    def graph_for(self, inputs: StepInputs) -> CapturedGraph | None:
        at = bisect.bisect_left(self.sizes, inputs.num_seqs)
        wide = bisect.bisect_left(self.widths, inputs.page_table.shape[1])
        if at == len(self.sizes) or wide == len(self.widths):
            return None
        captured = self.graphs[(self.sizes[at], self.widths[wide])]
        return captured if captured.batch.fits(inputs) else None

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None:
        if cache is not self.cache:
            raise CudaGraphError("the graphs were captured against another KVCache")
        captured = None if cache.calibrating else self.graph_for(inputs)
        if captured is None:
            return self.model.forward(inputs, cache)
        captured.batch.load(inputs)
        if not self.captured:
            logits = self.model.forward(captured.batch.inputs, cache)
            self._zero_pad_page()
            return None if logits is None else logits[: inputs.num_seqs]
        captured.graph.replay()
        if captured.logits is None:  # ranks other than 0 return no logits
            return None
        return captured.logits[: inputs.num_seqs]
