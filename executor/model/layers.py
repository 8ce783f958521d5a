"""The building blocks: RMSNorm, rotary embedding, and the model's matrices named by their
tensor-parallel role, as vLLM and nano-vllm name them (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding and the LM head). How a matmul runs on this machine
(oneDNN packing, int4, the probe's crossover) is executor/kernels.py's."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from executor.kernels import Matrix, SplitMatrix
from executor.model.config import ModelConfig, RopeScaling
from executor.model.sharding import ShardPlan


def all_reduce(x: torch.Tensor, world_size: int, *, ordered: bool = False) -> torch.Tensor:
    """x summed over the ranks, in place. `ordered`: every element added in rank order, whatever
    the tensor's size: a ring all-reduce of 3 or more ranks adds each chunk of the tensor in
    another order, and which chunk an element falls in depends on the step's rows (2 ranks add
    a + b, the same either way round)."""
    if world_size == 1:
        return x
    if ordered and world_size > 2:
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return x.copy_(total)
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
    """Half-split rotary embedding (Hugging Face convention; GGUF Q/K are un-permuted to it).

    With `by_position`, cos and sin are looked up in a table built in fixed chunks of positions
    rather than computed for the step's positions: torch computes cos and sin by vector code and a
    step's last few values by scalar code, which may differ in the last bit, so a position's value
    would depend on how many rows the step has (the deterministic mode)."""

    TABLE_CHUNK = 1024  # positions per table chunk, each computed alone in the same shape

    def __init__(self, config: ModelConfig, device: torch.device, *, by_position: bool = False) -> None:
        self.inv_freq = rotary_inv_freq(config).to(device)
        self.by_position = by_position
        self._cos = torch.empty(0, config.head_dim, device=device)
        self._sin = torch.empty(0, config.head_dim, device=device)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim], each half repeated and the sin's first half negated, so that
        `apply` is two multiplies and an add for every layer of the step."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim] of the step's positions."""
        if not self.by_position:
            cos, sin = self._compute(positions)
            return cos[:, None, :], sin[:, None, :]
        needed = int(positions.max()) + 1 if positions.numel() else 0
        while self._cos.shape[0] < needed:
            start = self._cos.shape[0]
            cos, sin = self._compute(torch.arange(start, start + self.TABLE_CHUNK, device=self.inv_freq.device))
            self._cos, self._sin = torch.cat((self._cos, cos)), torch.cat((self._sin, sin))
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]


class Linear(Matrix):
    """A matrix of the model (executor.kernels.Matrix: which copy and kernel a call takes) whose
    output is whole on this rank: replicated, or column-parallel (each rank computes its own
    output rows and nothing is summed), with an optional bias of its output rows. `reduce`
    completes a partial output: nothing to do here."""

    def __init__(self, weight, q4=None, *, bias: torch.Tensor | None = None, **kwargs) -> None:  # noqa: ANN001
        super().__init__(weight, q4, **kwargs)
        self.bias = bias

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial


class QKVParallelLinear(Linear):
    """Q, K and V of this rank's heads as one matrix, column-parallel by KV group (sharding.py):
    [(local q + 2 local kv) * head_dim, hidden], with Qwen2's q/k/v biases of the same rows."""


class MergedColumnParallelLinear(Linear):
    """Gate and up of this rank's FFN columns as one matrix: [2 * local ffn, hidden]."""


class RowParallelLinear(Linear):
    """A matrix whose input columns are split over the ranks (o_proj, down): each rank's product
    is a partial sum, all-reduced in float32 (the residual stream's dtype) to the whole output.
    Called, it does both; `reduce` sums a partial computed elsewhere (inside a decoder block or a
    compiled library, which cannot hold a collective)."""

    def __init__(self, weight, q4=None, *, world_size: int = 1, ordered: bool = False, **kwargs) -> None:  # noqa: ANN001
        if kwargs.get("bias") is not None:
            raise ValueError("a row-parallel matrix has no bias: each rank would add it to its partial sum")
        super().__init__(weight, q4, **kwargs)
        self.world_size = world_size
        self.ordered = ordered  # the deterministic mode: all_reduce in rank order

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce(partial, self.world_size, ordered=self.ordered)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(super().__call__(x).float())


class SplitRowParallelLinear(SplitMatrix):
    """A row-parallel matrix on one rank, held as the column slices two ranks would hold
    (executor.kernels.SplitMatrix): its float32 product is their partial sums added as the
    two ranks' all-reduce adds them, so TP=1 gives TP=2's bits (the deterministic mode)."""

    world_size = 1

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x).float()


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

    def __init__(self, weight: torch.Tensor, plan: ShardPlan, vocab_size: int, *, deterministic: bool = False) -> None:
        self.linear = Linear(weight, deterministic=deterministic)
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
