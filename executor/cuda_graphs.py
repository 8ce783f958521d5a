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
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from executor.cache import KVCache
from executor.inputs import Pad, StepInputs
from protocol.errors import TPRuntimeError
from protocol.frames import CacheGeometry, Prepare

def unpaddable_fields(inputs_type: type = StepInputs) -> list[str]:
    """The fields of `inputs_type` that declare no padding rule (executor.inputs.Pad). A field added
    to StepInputs without one would replay with a stale buffer: the runner refuses to start."""
    return [f.name for f in fields(inputs_type) if not isinstance(f.metadata.get("pad"), Pad)]


class CudaGraphError(TPRuntimeError, RuntimeError):
    """The decode forward cannot be captured as CUDA graphs."""


class StaticDecodeBatch:
    """Static StepInputs buffers of one (batch size, table width), and the copy of a real decode
    step into them."""

    def __init__(self, size: int, width: int, geometry: CacheGeometry, cache: KVCache) -> None:
        self.size = size
        self.width = width
        self.geometry = geometry
        self.pad_page = cache.pad_page
        self.page_size = cache.page_size
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

    def fills(self) -> dict[Pad, int]:
        """The value of a padding row, by rule: the longest context a table of this width holds,
        its last position, the pad page it writes into."""
        context = min(self.width * self.page_size, self.geometry.max_model_len)
        last = context - 1
        return {
            Pad.ZERO: 0,
            Pad.LAST_POSITION: last,
            Pad.FULL_CONTEXT: context,
            Pad.PAD_PAGE: self.pad_page,
            Pad.LAST_SLOT: last % self.page_size,
        }

    def load(self, real: StepInputs) -> None:
        """Copy a decode step into the static buffers and re-pad the rows it does not use."""
        if not self.fits(real):
            raise CudaGraphError(
                f"a step of {real.num_seqs} sequences, {real.page_table.shape[1]} pages wide, does not "
                f"fit the graph of {self.size} x {self.width}"
            )
        n = real.num_seqs
        width = real.page_table.shape[1]
        fill = self.fills()
        for f in fields(StepInputs):
            rule = f.metadata["pad"]
            static, given = getattr(self.inputs, f.name), getattr(real, f.name)
            if rule is Pad.PAGE_TABLE:
                static[:n, :width].copy_(given)
                static[:n, width:].fill_(self.pad_page)
                static[n:].fill_(self.pad_page)
            elif rule in fill:
                static[:n].copy_(given)
                static[n:].fill_(fill[rule])
            # SAME, SAMPLER, CHECKED and LATER fields are not copied: see executor.inputs.Pad.


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
        unknown = unpaddable_fields()
        if unknown:
            raise CudaGraphError(
                f"StepInputs has fields without a padding rule (executor.inputs.Pad): {', '.join(unknown)}"
            )
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
            return None if logits is None else logits[: inputs.num_seqs]
        captured.graph.replay()
        if captured.logits is None:  # ranks other than 0 return no logits
            return None
        return captured.logits[: inputs.num_seqs]
