"""The building blocks: RMSNorm, rotary embedding, tensor-parallel linear/embedding/LM head."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

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


class Linear:
    """y = x W^T, with W [out, in] packed once at load for the kernels that run fastest here."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * weight.element_size()
        self.packed = _onednn_packs(weight)
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=PACK_ROWS)
        else:
            self.weight = weight

    def dense(self) -> torch.Tensor:
        """The [out, in] matrix as loaded, in a plain layout."""
        return self.weight.to_dense() if self.packed else self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


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
