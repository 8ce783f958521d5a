"""The building blocks: RMSNorm, rotary embedding, tensor-parallel linear/embedding/LM head."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from executor.gguf_file import Q4_BLOCK, Q4Blocks
from executor.model.config import ModelConfig, RopeScaling
from executor.model.sharding import ShardPlan


def all_reduce(x: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(x)
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (the residual stream is float32), returning float32."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rotary_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    return inv_freq.float()


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class Rotary:
    """Half-split rotary embedding (Hugging Face convention; GGUF Q/K are un-permuted to it)."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = rotary_inv_freq(config).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim], each half repeated and the sin's first half negated, so
        that `apply` is two multiplies and an add for every layer of the step."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (Q and K heads together: one call per layer) -> contiguous."""
        x1, x2 = x.chunk(2, dim=-1)
        return (x * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)


# The row count oneDNN lays packed weights out for. Measured on SmolLM2 (scripts/bench_model.py):
# a layout for 32 rows is within noise of the best one at 1, 8, 32 and 512 rows.
PACK_ROWS = 32


def _onednn_packs(weight: torch.Tensor) -> bool:
    """Every CPU weight oneDNN can pack is packed: a rule measured on one machine, not per weight.

    On CPUs torch's F.linear calls MKL, whose single-precision GEMM takes a generic path on
    non-Intel CPUs: on this AMD EPYC, packing took the matmuls of a SmolLM2 decode step from 68 to
    44 ms at batch 1 and from 242 to 124 ms at batch 32 (docs/model.md). oneDNN refuses bf16 without
    AVX-512 or AVX-NE-CONVERT; on CUDA F.linear calls cuBLAS, which needs no packing.
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Steps of at most this many rows use a matrix's int4 copy where it has one, unless the loader sets
# the crossover the start-up probe measured on this CPU (executor/probe.py). Measured on SmolLM2's
# layer matrices (30 layers, bf16 activations, 2 threads of an AVX-512 EPYC, docs/model.md): int4
# against oneDNN bf16 is 2.4x faster at 1-2 rows, 1.8x at 4, 1.16x at 6-8 and 0.9x from 10 rows on.
INT4_MAX_ROWS = 8


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
    """x W^T for W as Linear holds it: oneDNN-packed or plain; on the CPU at a rounded row count."""
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


class Linear:
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
    ) -> None:
        if weight is None and q4 is None:
            raise ValueError("a Linear needs a dense weight, 4-bit blocks, or both")
        self.int4_max_rows = int4_max_rows
        self.dtype = weight.dtype if weight is not None else dtype
        self.shape = tuple(weight.shape) if weight is not None else tuple(q4.q.shape)
        self.nbytes = weight.numel() * weight.element_size() if weight is not None else 0
        self.packed = weight is not None and _onednn_packs(weight)
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=PACK_ROWS)
        else:
            self.weight = weight
        self.int4: torch.Tensor | None = None
        self.int4_scales: torch.Tensor | None = None
        self.int4_nbytes = 0
        if q4 is not None:
            self.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.from_numpy(q4.q.astype(np.int32)), 1
            )
            # The kernel computes (q - 8) * scale + zero per group: zero = low + 8 * scale.
            groups = np.stack((q4.scale, q4.low + 8.0 * q4.scale), axis=-1).transpose(1, 0, 2)
            self.int4_scales = torch.from_numpy(np.ascontiguousarray(groups)).to(self.dtype)
            self.int4_nbytes = self.int4.numel() + self.int4_scales.numel() * self.int4_scales.element_size()

    def uses_int4(self, rows: int) -> bool:
        return self.int4 is not None and (self.weight is None or rows <= self.int4_max_rows)

    def bytes_read(self, rows: int) -> int:
        """Weight bytes one call with `rows` rows reads."""
        return self.int4_nbytes if self.uses_int4(rows) else self.nbytes

    def dense(self) -> torch.Tensor:
        """The [out, in] matrix in a plain layout (from the int4 copy where that is all there is)."""
        if self.weight is None:
            identity = torch.eye(self.shape[1], dtype=self.dtype)
            return self._int4_matmul(identity).t().contiguous()
        return self.weight.to_dense() if self.packed else self.weight

    def _int4_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4, Q4_BLOCK, self.int4_scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.uses_int4(x.shape[0]):
            return self._int4_matmul(x)
        return dense_matmul(x, self.weight)


class VocabParallelEmbedding:
    """Each rank holds rows [start, stop) of the table; ids outside them contribute zeros."""

    def __init__(self, weight: torch.Tensor, plan: ShardPlan) -> None:
        self.weight = weight
        self.start, self.stop = plan.vocab
        self.world_size = plan.world_size

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return F.embedding(token_ids, self.weight).float()
        local = (token_ids >= self.start) & (token_ids < self.stop)
        rows = F.embedding((token_ids - self.start).clamp_(0, self.stop - self.start - 1), self.weight)
        out = rows.float() * local[:, None]
        return all_reduce(out, self.world_size)


class VocabParallelLMHead:
    """Local logits for this rank's vocabulary rows, gathered to full rows on rank 0 only."""

    def __init__(self, weight: torch.Tensor, plan: ShardPlan, vocab_size: int) -> None:
        self.linear = Linear(weight)
        self.plan = plan
        self.vocab_size = vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = self.linear(hidden).float()
        if self.plan.world_size == 1:
            return local
        chunk = self.plan.vocab_chunk
        if local.shape[1] < chunk:
            local = F.pad(local, (0, chunk - local.shape[1]))
        if self.plan.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.plan.world_size)]
            dist.gather(local, gather_list=parts, dst=0)
            return torch.cat(parts, dim=1)[:, : self.vocab_size]
        dist.gather(local, dst=0)
        return None
