"""The decoder layer, written once: functions over named tensors that the eager forward calls and
the AOTInductor export traces (executor/model/aot_layer.py).

A layer is two blocks around the two tensor-parallel sums: `attention_block` (RMSNorm, QKV with
Qwen2's biases, rotary, the KV-cache write, attention, o_proj) and `mlp_block` (RMSNorm, gate/up,
SiLU, down). Each returns its float32 partial sum; the caller adds it to the residual stream after
the all-reduce (RowParallelLinear's, eagerly; between two library calls, compiled). Attention is the
one part that differs by step: the caller passes it as `attend(q)`, which reads the cache after this
step's K and V are written (executor/model/attention.py: the same decode attention serves eager
decode rows and the compiled layers; a prefill chunk uses the causal kernel).

Everything a feature needs lives here once: Qwen2's biases are a field of AttentionWeights, Mistral's
window a field of LayerShape, fp8 scales are the cache's (executor.cache.store_kv), and whatever
comes next (Qwen3's q/k norms would be two more fields and two lines) reaches every runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import register_dataclass

from executor.cache import store_kv
from executor.kernels import MatmulWeights, matmul


@dataclass(frozen=True)
class LayerShape:
    """The static sizes of one layer on one rank: what a compiled library is specialized on."""

    hidden: int
    q_heads: int  # local
    kv_heads: int  # local
    head_dim: int
    ffn: int  # local intermediate width
    rms_eps: float
    dtype: torch.dtype  # the matmuls' activation dtype
    window: int | None = None  # a query sees the last `window` positions (Mistral, Qwen2 layers)

    @property
    def q_width(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass
class AttentionWeights:
    norm: torch.Tensor  # float32 [hidden]
    qkv: MatmulWeights  # [(q + 2 kv) * head_dim, hidden]
    o: MatmulWeights  # [hidden, q * head_dim]
    qkv_bias: torch.Tensor | None = None  # Qwen2: [(q + 2 kv) * head_dim]


@dataclass
class MlpWeights:
    norm: torch.Tensor  # float32 [hidden]
    gate_up: MatmulWeights  # [2 * ffn, hidden]
    down: MatmulWeights  # [hidden, ffn]


@dataclass
class StepTensors:
    """What every layer of a step reads besides its weights: rotary tables of the step's positions,
    where each new token's K and V go, and the whole cache with its per-layer scales."""

    cos: torch.Tensor  # float32 [T, 1, head_dim]
    sin: torch.Tensor  # float32 [T, 1, head_dim]
    write_pages: torch.Tensor  # long [T]
    write_offsets: torch.Tensor  # long [T]
    kv: torch.Tensor  # the cache [pages + 1, layers, 2, page_size, kv_heads, head_dim]
    scales: torch.Tensor  # float32 [layers, 2]


# Pytree nodes, so that torch.export takes them as inputs (named for its serialized programs).
for _cls in (AttentionWeights, MlpWeights, StepTensors):
    register_dataclass(_cls, serialized_type_name=f"{_cls.__module__}.{_cls.__qualname__}")

Attend = Callable[[torch.Tensor], torch.Tensor]  # q [T, Hq, D] -> [T, Hq * D], after the write
Observe = Callable[[torch.Tensor, torch.Tensor], None]  # an fp8 calibration's look at K and V


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding of x [T, heads, head_dim]; sin's first half comes negated
    (layers.Rotary.cos_sin), so this is two multiplies and an add."""
    first, second = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((second, first), dim=-1) * sin).to(x.dtype)


def attention_block(
    shape: LayerShape,
    x: torch.Tensor,
    w: AttentionWeights,
    step: StepTensors,
    layer: torch.Tensor,
    attend: Attend,
    observe: Observe | None = None,
) -> torch.Tensor:
    """o_proj(attention(rotary(QKV(RMSNorm(x))))) as a float32 partial sum, this step's K and V
    written to the cache (layer: long[1]) before attention reads it."""
    tokens, d = x.shape[0], shape.head_dim
    h = F.rms_norm(x, (shape.hidden,), w.norm, shape.rms_eps).to(shape.dtype)
    qkv = matmul(h, w.qkv)
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias
    qk_width = shape.q_width + shape.kv_width
    qk = rotate(qkv[:, :qk_width].view(tokens, shape.q_heads + shape.kv_heads, d), step.cos, step.sin)
    q, k = qk.split([shape.q_heads, shape.kv_heads], dim=1)
    v = qkv[:, qk_width:].view(tokens, shape.kv_heads, d)
    if observe is not None:
        observe(k, v)
    store_kv(step.kv, layer, step.write_pages, step.write_offsets, k, v, step.scales)
    return matmul(attend(q), w.o).float()


def mlp_block(shape: LayerShape, x: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    """down(SiLU(gate) * up) of RMSNorm(x), as a float32 partial sum."""
    h = F.rms_norm(x, (shape.hidden,), w.norm, shape.rms_eps).to(shape.dtype)
    gate, up = matmul(h, w.gate_up).split(shape.ffn, dim=-1)
    return matmul(F.silu(gate) * up, w.down).float()
