"""How a matmul runs on this machine: which copy of a matrix a step reads, and through which kernel.

A matrix may be held as a dense copy in the compute dtype (oneDNN-packed on the CPU where oneDNN
can pack it), as torch's CPU int4 layout of GGUF 4-bit blocks, or both; `Matrix` holds them and
picks per call by the step's row count (the int4 copy up to the crossover the start-up probe
measured, executor/probe.py). `MatmulWeights` is the one copy a call reads, as named tensors:
the decoder layer (executor/model/decoder.py) calls `matmul` on it, eagerly and inside the
AOTInductor export alike.

This module sits below the model package and the probe (both import it; it imports neither).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._pytree import register_dataclass

from executor.gguf_file import Q4_BLOCK, Q4Blocks
from protocol.errors import TPRuntimeError

# The row count oneDNN lays packed weights out for. Measured on SmolLM2 (scripts/bench_model.py):
# a layout for 32 rows is within noise of the best one at 1, 8, 32 and 512 rows.
PACK_ROWS = 32

# Steps of at most this many rows use a matrix's int4 copy where it has one, unless the loader sets
# the crossover the start-up probe measured on this CPU (executor/probe.py). Measured on SmolLM2's
# layer matrices (30 layers, bf16 activations, 2 threads of an AVX-512 EPYC, docs/model.md): int4
# against oneDNN bf16 is 2.4x faster at 1-2 rows, 1.8x at 4, 1.16x at 6-8 and 0.9x from 10 rows on.
INT4_MAX_ROWS = 8


class DeterminismError(TPRuntimeError, RuntimeError):
    """This machine's kernels cannot give a row the same bits whatever its batch."""


def onednn_packs(weight: torch.Tensor) -> bool:
    """Every CPU weight oneDNN can pack is packed: a rule measured on one machine, not per weight.

    On CPUs torch's F.linear calls MKL, whose single-precision GEMM takes a generic path on
    non-Intel CPUs: on an AMD EPYC, packing took the matmuls of a SmolLM2 decode step from 68 to
    44 ms at batch 1 and from 242 to 124 ms at batch 32 (docs/model.md). oneDNN refuses bf16 without
    AVX-512 or AVX-NE-CONVERT; on CUDA F.linear calls cuBLAS, which needs no packing.
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def int4_packable(blocks: Q4Blocks) -> bool:
    """torch's CPU int4 kernel wants output rows in multiples of 16 and whole groups of 32."""
    rows, cols = blocks.q.shape
    return rows % 16 == 0 and cols % Q4_BLOCK == 0


def padded_rows(rows: int) -> int:
    """The row count a CPU dense matmul of `rows` rows runs at: exact up to 16, then rounded up to
    one of 8 sizes per doubling (at most 12.5% more rows; 56 sizes up to 512).

    oneDNN keeps state for every (rows, matrix) shape it has run, about 0.6 MB each, even with its
    primitive cache off: a server whose prefill chunks take every length up to 512 grew by 1.2-3
    MB per new length for SmolLM2, without end (docs/model.md). Rounding bounds the shapes it sees."""
    if rows <= 16:
        return rows
    shift = rows.bit_length() - 4
    return -(-rows >> shift) << shift


def dense_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T for W as Matrix holds it: oneDNN-packed or plain; on the CPU at a rounded row count."""
    if weight.device.type != "cpu":
        return F.linear(x, weight)
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    if weight.is_mkldnn:
        y = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    else:
        y = F.linear(x, weight)
    return y[:rows]


# A packed oneDNN weight is opaque to the compiler: inside an export the dense matmul is this
# custom op, which the compiled library calls back into.
@torch.library.custom_op("tp_runtime::dense_linear", mutates_args=())
def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return dense_matmul(x, weight)


@dense_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def warm_dense_linear() -> None:
    """Calls the custom op once. torch imports torch._dynamo on a custom op's first call (2.4 s on
    a loaded 2-core machine): done at load, before the rank's HELLO, it is not paid inside the first
    step that runs compiled layers, which is what a new group's step deadline measures."""
    dense_linear(torch.zeros(1, 1), torch.zeros(1, 1))


def int4_pack(blocks: Q4Blocks, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout of GGUF blocks and its per-group (scale, zero) in `dtype`."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(blocks.q.astype(np.int32)), 1)
    # The kernel computes (q - 8) * scale + zero per group: zero = low + 8 * scale.
    groups = np.stack((blocks.scale, blocks.low + 8.0 * blocks.scale), axis=-1).transpose(1, 0, 2)
    return packed, torch.from_numpy(np.ascontiguousarray(groups)).to(dtype)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, Q4_BLOCK, scales)


@dataclass(frozen=True)
class RowPlan:
    """How the deterministic mode runs a matmul's rows on this CPU so that each row gets the same
    bits whatever its batch (docs/invariance.md): in one call with its rows padded to a multiple of
    `multiple`, or (`block`) in calls of exactly that many rows, the last padded with zeros. row_plan
    measures which; a kernel whose rows agree at every count needs neither (multiple 1)."""

    multiple: int = 1
    block: int = 0

    def run(self, kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        step = self.block or self.multiple
        padded = max(-(-rows // step), 1) * step  # no rows: one padded call, for the output's shape
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        if not self.block:
            return kernel(x)[:rows]
        return torch.cat([kernel(x[start : start + self.block]) for start in range(0, padded, self.block)])[:rows]


# Tried in this order, cheapest first: one call at any count, then padded, then fixed blocks. On a
# 2-core Intel Xeon with AMX, oneDNN's packed bf16 matmul gave rows of SmolLM2's shapes other bits
# at every multiple below 64 (its kernels differ by row count), and agreed in fixed blocks of 16.
ROW_PLANS = tuple(RowPlan(multiple=m) for m in (1, 2, 4, 8, 16)) + tuple(RowPlan(block=b) for b in (16, 32, 64))
# The probe's rows: a reference product of _PROBE_ROWS, and the counts whose rows must agree with it.
_PROBE_ROWS = 160
_PROBE_COUNTS = (*range(1, 21), 31, 32, 33, 47, 48, 49, 63, 64, 95, 96, 97, 127, 128, 129)


def rows_agree(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: Iterable[int]) -> bool:
    """Whether `product` gives the rows of x[start : start + count], at each count and at the first
    and last offset, the bits it gives the same rows within x."""
    reference = product(x)
    total = x.shape[0]
    return all(
        torch.equal(product(x[start : start + count]), reference[start : start + count])
        for count in counts
        for start in (0, total - count)
    )


def first_agreeing_plan(kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> RowPlan | None:
    """The first of ROW_PLANS under which `kernel` gives the rows of x the same bits at every count
    of _PROBE_COUNTS and offset; None when none does."""
    return next((plan for plan in ROW_PLANS if rows_agree(functools.partial(plan.run, kernel), x, _PROBE_COUNTS)), None)


def order_sensitive(rows: int, out_features: int, depth: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, depth] and W [out_features, depth] (float32) whose products x W^T sum large terms
    that cancel in pairs (a quarter of the columns each side) and small ones: the sum is small and
    the large partial sums' rounding shows in it, so two kernels that add in other orders give
    other bits even in a bf16 output. On random values they mostly agree after the output's
    rounding: a 1-row bf16 product that differs from the same row in 4 at one output in 96 of a
    real model passed a probe of random values (docs/invariance.md)."""
    x = torch.randn(rows, depth, generator=generator) * 2**-4
    weight = torch.randn(out_features, depth, generator=generator) * 2**-4
    columns = torch.randperm(depth, generator=generator)
    half = depth // 4
    plus, minus = columns[:half], columns[half : 2 * half]
    x[:, plus] = x[:, minus] = torch.randn(rows, half, generator=generator) * 2**4
    large = torch.randn(out_features, half, generator=generator) * 2**4
    weight[:, plus], weight[:, minus] = large, -large
    return x, weight


@functools.cache
def row_plan(kind: str, shape: tuple[int, int], dtype: torch.dtype) -> RowPlan:
    """The first of ROW_PLANS under which the kernel of `kind` ("dense": the packed or plain dense
    matmul as Matrix holds it; "int4") gives a [rows, in] x [out, in]^T product's rows the same bits
    at every count and offset, measured once per process, kernel and shape on order_sensitive
    values (which kernel runs depends on the shape, the dtype and the layout, not on the values)."""
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(0)
    x, weight = order_sensitive(_PROBE_ROWS, out_features, in_features, generator)
    x = x.to(dtype)
    if kind == "int4":  # its weights are 4-bit codes: the order-sensitive values are x's alone
        q = torch.randint(0, 16, shape, generator=generator, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scales = torch.rand(in_features // Q4_BLOCK, out_features, 2, generator=generator).to(dtype)
        kernel = functools.partial(int4_matmul, packed=packed, scales=scales)
    else:
        weight = weight.to(dtype)
        if onednn_packs(weight):
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=PACK_ROWS)
        kernel = functools.partial(dense_matmul, weight=weight)
    plan = first_agreeing_plan(kernel, x)
    if plan is not None:
        return plan
    raise DeterminismError(
        f"the {kind} matmul of a {out_features} x {in_features} {dtype} matrix gives rows other bits by their batch "
        f"under every row plan tried ({', '.join(map(str, ROW_PLANS))}) on this CPU: the deterministic mode cannot run here"
    )


@dataclass
class MatmulWeights:
    """The one copy of a matrix a call reads: dense (`weight`) or int4 (`int4` and its scales), and
    in the deterministic mode how its rows run (`rows`; None otherwise)."""

    weight: torch.Tensor | None = None
    int4: torch.Tensor | None = None
    int4_scales: torch.Tensor | None = None
    rows: RowPlan | None = None

    @property
    def kind(self) -> str:
        return "int4" if self.int4 is not None else "dense"


# `rows` stays out of the exported tree: the deterministic mode runs no compiled layers (and
# aot_layer's `_static` walks the dataclass's fields, which a RowPlan there would break).
register_dataclass(
    MatmulWeights, field_names=["weight", "int4", "int4_scales"], drop_field_names=["rows"],
    serialized_type_name="executor.kernels.MatmulWeights",
)  # fmt: skip


@dataclass(frozen=True)
class SplitMatmulWeights:
    """A matrix whose input columns are cut at fixed places: `parts[i]` reads columns
    [bounds[i], bounds[i + 1]). Its product is the parts' float32 partial sums added left to right.

    This is how a row-parallel matrix computes the same sum at every tensor-parallel size: cut where
    two ranks would cut it, one rank forms the two partial sums two ranks form, and adds them as
    the two-rank all-reduce does (a + b, exact either way round). Eager only: the deterministic
    mode runs no compiled layers."""

    parts: tuple[MatmulWeights, ...]
    bounds: tuple[int, ...]  # len(parts) + 1 column offsets, from 0 to the matrix's width

    @property
    def kind(self) -> str:
        return self.parts[0].kind


def matmul(x: torch.Tensor, w: MatmulWeights | SplitMatmulWeights) -> torch.Tensor:
    """x W^T through the kernel of the copy w holds. Inside an export (torch.compiler) the dense
    kernel is the custom op; eagerly it is called directly (a custom op costs ~20 us of Python).
    A split matrix (SplitMatmulWeights) returns its float32 sum."""
    if isinstance(w, SplitMatmulWeights):
        total = None
        for part, start, stop in zip(w.parts, w.bounds, w.bounds[1:]):
            partial = matmul(x[:, start:stop].contiguous(), part).float()
            total = partial if total is None else total + partial
        return total
    if w.rows is not None:
        return w.rows.run(functools.partial(_product, w=w), x)
    return _product(x, w)


def _product(x: torch.Tensor, w: MatmulWeights) -> torch.Tensor:
    if w.int4 is not None:
        return int4_matmul(x, w.int4, w.int4_scales)
    if torch.compiler.is_compiling():
        return torch.ops.tp_runtime.dense_linear(x, w.weight)
    return dense_matmul(x, w.weight)


class Matrix:
    """y = x W^T, with W [out, in] packed once at load for the kernels that run fastest here.

    A matrix may hold a dense copy (`weight`, in the compute dtype), an int4 copy of GGUF 4-bit
    blocks (torch's CPU int4 kernel, groups of 32 = GGUF's blocks, so the file's values are kept up
    to the scales' rounding to the compute dtype), or both: then a step of at most `int4_max_rows`
    rows takes the int4 copy and a larger one the dense copy.
    """

    def __init__(
        self,
        weight: torch.Tensor | None,
        q4: Q4Blocks | None = None,
        *,
        dtype: torch.dtype | None = None,
        int4_max_rows: int = INT4_MAX_ROWS,
        deterministic: bool = False,
    ) -> None:
        """deterministic: each copy's rows run under the RowPlan measured for its kernel and shape
        (row_plan), so that a row's bits do not depend on its batch."""
        if weight is None and q4 is None:
            raise ValueError("a matrix needs a dense weight, 4-bit blocks, or both")
        self.int4_max_rows = int4_max_rows
        self.dtype = weight.dtype if weight is not None else dtype
        self.shape = tuple(weight.shape) if weight is not None else tuple(q4.q.shape)
        self.nbytes = weight.numel() * weight.element_size() if weight is not None else 0
        self.packed = weight is not None and onednn_packs(weight)
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=PACK_ROWS)
        else:
            self.weight = weight
        self.int4: torch.Tensor | None = None
        self.int4_scales: torch.Tensor | None = None
        self.int4_nbytes = 0
        if q4 is not None:
            self.int4, self.int4_scales = int4_pack(q4, self.dtype)
            self.int4_nbytes = self.int4.numel() + self.int4_scales.numel() * self.int4_scales.element_size()
        planned = deterministic and (weight is None or weight.device.type == "cpu")  # the int4 copy is a CPU one
        self._dense_copy = MatmulWeights(
            weight=self.weight, rows=row_plan("dense", self.shape, self.dtype) if planned and weight is not None else None
        )
        self._int4_copy = MatmulWeights(
            int4=self.int4, int4_scales=self.int4_scales,
            rows=row_plan("int4", self.shape, self.dtype) if planned and self.int4 is not None else None,
        )  # fmt: skip

    def uses_int4(self, rows: int) -> bool:
        return self.int4 is not None and (self.weight is None or rows <= self.int4_max_rows)

    def weights_for(self, rows: int) -> MatmulWeights:
        """The copy a call of `rows` rows reads."""
        return self._int4_copy if self.uses_int4(rows) else self._dense_copy

    def bytes_read(self, rows: int) -> int:
        """Weight bytes one call with `rows` rows reads."""
        return self.int4_nbytes if self.uses_int4(rows) else self.nbytes

    def dense(self) -> torch.Tensor:
        """The [out, in] matrix in a plain layout (from the int4 copy where that is all there is)."""
        if self.weight is None:
            identity = torch.eye(self.shape[1], dtype=self.dtype)
            return int4_matmul(identity, self.int4, self.int4_scales).t().contiguous()
        return self.weight.to_dense() if self.packed else self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        return matmul(x, self.weights_for(x.shape[0]))


class SplitMatrix:
    """A matrix held as column slices (`Matrix` each, cut at `bounds`), whose product is their
    float32 partial sums added left to right (SplitMatmulWeights): one rank computing what two
    ranks would, in their order. It answers what a Matrix answers for its parts together."""

    def __init__(self, parts: list[Matrix], bounds: tuple[int, ...]) -> None:
        if len(bounds) != len(parts) + 1 or bounds[0] != 0:
            raise ValueError(f"{len(parts)} parts need {len(parts) + 1} bounds from 0, got {bounds}")
        self.parts = parts
        self.bounds = bounds
        self.dtype = parts[0].dtype
        self.shape = (parts[0].shape[0], bounds[-1])
        self.nbytes = sum(part.nbytes for part in parts)
        self.int4 = parts[0].int4
        self.int4_max_rows = parts[0].int4_max_rows
        self.bias = None

    def uses_int4(self, rows: int) -> bool:
        return self.parts[0].uses_int4(rows)

    def weights_for(self, rows: int) -> SplitMatmulWeights:
        return SplitMatmulWeights(tuple(part.weights_for(rows) for part in self.parts), self.bounds)

    def bytes_read(self, rows: int) -> int:
        return sum(part.bytes_read(rows) for part in self.parts)

    def dense(self) -> torch.Tensor:
        return torch.cat([part.dense() for part in self.parts], dim=1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x.to(self.dtype), self.weights_for(x.shape[0]))


@functools.cache
def bmm_row_multiple(depth: int, width: int, dtype: torch.dtype = torch.float32) -> int:
    """The row multiple at which torch.bmm gives each row of a [rows, depth] x [depth, width]
    product the same bits whatever the row count and the row's place: the deterministic attention
    pads its rows to it (executor/model/attention.py).

    BLAS kernels compute rows in panels and a panel's leftover rows by another path: MKL's fp32
    gemm on an AVX2 EPYC gives rows of 1-3-row products, and the last 1-3 rows of a product of 5-11,
    other bits than the same rows among 4 or more (4-row panels). Measured here, once per process
    and shape, rather than assumed: the smallest of 1, 2, 4, 8 and 16 under which rows at every
    count up to 64 and at both end offsets agree with the same rows of a _PROBE_ROWS-row product."""
    a, w = order_sensitive(_PROBE_ROWS, width, depth, torch.Generator().manual_seed(0))
    a, b = a.to(dtype), w.t().contiguous().unsqueeze(0).to(dtype)

    def product(rows: torch.Tensor) -> torch.Tensor:
        return torch.bmm(rows.unsqueeze(0), b).squeeze(0)

    for multiple in (1, 2, 4, 8, 16):
        if rows_agree(product, a, range(multiple, 65, multiple)):
            return multiple
    raise DeterminismError(
        f"torch.bmm gives rows of a [rows, {depth}] x [{depth}, {width}] {dtype} product other bits at every "
        "row multiple up to 16 on this CPU: the deterministic mode cannot run here"
    )
