"""A decoder layer as AOTInductor compiles it: `LayerSpec` (what a library depends on, its cache
key), the layer's graph, and `build`, which exports it with torch.export and compiles it with
AOTInductor's C++ wrapper into one package.

The weights are inputs, not constants: one library serves every layer of a model and every
checkpoint of the same shape. The row count, the page-table width and the cache's page count are
dynamic.

Matmuls inside the library: torch's CPU int4 kernel as an extern call, and for dense weights the
oneDNN-packed matmul of executor.model.layers through the custom op `tp_runtime::dense_linear`
(a packed oneDNN weight is opaque to the compiler, so it is passed through untouched).

Attention in the library reads every slot of every page in each sequence's table, masked by an
additive -inf past its length: the clearing rule stays load-bearing (tests/model/test_compiled.py
runs the NaN cases through it).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from executor.disk_cache import cpu_identity, digest
from executor.gguf_file import Q4_BLOCK
from executor.model.layers import dense_matmul

# A library holds this file's code: an edit to it makes every key new.
_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


@torch.library.custom_op("tp_runtime::dense_linear", mutates_args=())
def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return dense_matmul(x, weight)


@dense_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@dataclass(frozen=True)
class LayerSpec:
    """Everything a compiled library depends on besides the CPU and torch: the cache key.

    `part` is `layer` (a whole decoder layer: world size 1), or `attention` / `mlp`, the halves
    around the two all-reduces of a tensor-parallel layer. `matmuls` names the kernel of QKV,
    o_proj, gate/up and down: `int4` or `dense`.
    """

    part: str
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rms_eps: float
    num_layers: int
    page_size: int
    dtype: str
    kv_dtype: str
    matmuls: tuple[str, str, str, str]
    min_rows: int
    max_rows: int
    threads: int  # OpenMP threads: Inductor writes the count into each parallel loop

    def key(self) -> str:
        return digest({**asdict(self), **cpu_identity(), "source": _SOURCE_DIGEST})

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)

    def matrix_shapes(self) -> tuple[tuple[int, int], ...]:
        """[out, in] of QKV, o_proj, gate/up and down."""
        d = self.head_dim
        return (
            ((self.q_heads + 2 * self.kv_heads) * d, self.hidden),
            (self.hidden, self.q_heads * d),
            (2 * self.ffn, self.hidden),
            (self.hidden, self.ffn),
        )


def _matmul(kind: str, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    if kind == "int4":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weights[0], Q4_BLOCK, weights[1])
    return torch.ops.tp_runtime.dense_linear(x, weights[0])


def _attention(spec: LayerSpec, x: torch.Tensor, w: list[torch.Tensor], step: list[torch.Tensor]) -> torch.Tensor:
    """o_proj(attention(rotary(QKV(RMSNorm(x))))), writing this step's K and V into the cache.

    w: attn_norm, QKV's tensors, o_proj's. step: cos, sin, kv (the whole cache), the layer index
    [1], write pages and offsets [n], page tables [n, W], context lengths [n], the cache's scales
    [num_layers, 2] (fp8: K and V per layer, inputs so that calibrating them needs no rebuild).
    """
    cos, sin, kv, layer, write_pages, write_offsets, table, context, scales = step
    n, dtype = x.shape[0], spec.torch_dtype
    hq, hkv, d, page = spec.q_heads, spec.kv_heads, spec.head_dim, spec.page_size
    qkv_n, o_n = _tensor_count(spec.matmuls[0]), _tensor_count(spec.matmuls[1])
    h = F.rms_norm(x, (spec.hidden,), w[0], spec.rms_eps).to(dtype)
    qkv = _matmul(spec.matmuls[0], h, w[1 : 1 + qkv_n])
    qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
    first, second = qk.chunk(2, dim=-1)
    qk = (qk * cos + torch.cat((second, first), dim=-1) * sin).to(dtype)
    q, k = qk.split([hq, hkv], dim=1)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    layers = layer.expand(n)
    k_scale, v_scale = scales[layer][0]
    kv.index_put_((write_pages, layers, torch.zeros_like(write_pages), write_offsets), _to_storage(spec, k, k_scale))
    kv.index_put_((write_pages, layers, torch.ones_like(write_pages), write_offsets), _to_storage(spec, v, v_scale))
    pages = kv[table, layer]  # [n, W, 2, page, Hkv, D]: every slot of every page in the table
    slots = table.shape[1] * page
    keys = _from_storage(spec, pages[:, :, 0], k_scale).reshape(n, slots, hkv, d).float()
    values = _from_storage(spec, pages[:, :, 1], v_scale).reshape(n, slots, hkv, d).float()
    group = q.reshape(n, hkv, hq // hkv, d).float()
    # -inf added, not written: a NaN score (NaN in K) stays NaN, and exp(-inf) = 0 times a NaN
    # in V is NaN. Either way a slot the clears missed reaches the output.
    bias = torch.where(torch.arange(slots, device=x.device)[None, :] < context[:, None], 0.0, float("-inf"))
    scores = (group[:, :, :, None, :] * keys.permute(0, 2, 1, 3)[:, :, None]).sum(-1) * d**-0.5
    weights = torch.softmax(scores + bias[:, None, None, :], dim=-1)
    attended = (weights[..., None] * values.permute(0, 2, 1, 3)[:, :, None]).sum(-2)
    return _matmul(spec.matmuls[1], attended.to(dtype).reshape(n, hq * d), w[1 + qkv_n : 1 + qkv_n + o_n])


def _mlp(spec: LayerSpec, x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """down(SiLU(gate) * up) of RMSNorm(x). w: ffn_norm, gate/up's tensors, down's."""
    gate_up_n = _tensor_count(spec.matmuls[2])
    h = F.rms_norm(x, (spec.hidden,), w[0], spec.rms_eps).to(spec.torch_dtype)
    gate, up = _matmul(spec.matmuls[2], h, w[1 : 1 + gate_up_n]).split(spec.ffn, dim=-1)
    return _matmul(spec.matmuls[3], F.silu(gate) * up, w[1 + gate_up_n :])


def _to_storage(spec: LayerSpec, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if spec.storage_dtype == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return x.to(spec.storage_dtype)


def _from_storage(spec: LayerSpec, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if spec.storage_dtype == torch.float8_e4m3fn:
        return x.to(spec.torch_dtype) * scale
    return x.to(spec.torch_dtype)


def _tensor_count(kind: str) -> int:
    return 2 if kind == "int4" else 1


def _attention_weight_count(spec: LayerSpec) -> int:
    return 1 + _tensor_count(spec.matmuls[0]) + _tensor_count(spec.matmuls[1])


class _Layer(torch.nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, x: torch.Tensor, weights: list[torch.Tensor], step: list[torch.Tensor]) -> torch.Tensor:
        split = _attention_weight_count(self.spec)
        x = x + _attention(self.spec, x, weights[:split], step)
        return x + _mlp(self.spec, x, weights[split:])


class _AttentionHalf(torch.nn.Module):
    """The previous layer's all-reduced MLP output added in, then attention up to o_proj's partial sum."""

    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor, weights: list[torch.Tensor], step: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        # Float32 partial sums, as the eager layers all-reduce them.
        return x, _attention(self.spec, x, weights, step).float()


class _MlpHalf(torch.nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor, weights: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, _mlp(self.spec, x, weights).float()


_MODULES = {"layer": _Layer, "attention": _AttentionHalf, "mlp": _MlpHalf}


def _example_inputs(spec: LayerSpec) -> tuple[tuple, dict]:
    """Inputs of the right dtypes and layouts (their values never matter) and their dynamic dims.

    The examples avoid sizes 0 and 1, which torch.export would specialize on, and no two are the
    same tensor: export would take them for one input. A range of one row count is static."""
    from torch.export import Dim

    static = spec.min_rows == spec.max_rows
    rows = spec.min_rows if static else max(2, spec.min_rows)
    width, num_pages = 3, 5
    dtype = spec.torch_dtype
    row_dim = None if static else Dim("rows", min=spec.min_rows, max=spec.max_rows)

    def matrix(kind: str, out_features: int, in_features: int) -> list[torch.Tensor]:
        if kind == "int4":
            q = torch.zeros(out_features, in_features, dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            return [packed, torch.zeros(in_features // Q4_BLOCK, out_features, 2, dtype=dtype)]
        return [torch.zeros(out_features, in_features, dtype=dtype)]

    shapes = spec.matrix_shapes()
    attention_w = [torch.ones(spec.hidden), *matrix(spec.matmuls[0], *shapes[0]), *matrix(spec.matmuls[1], *shapes[1])]
    mlp_w = [torch.ones(spec.hidden), *matrix(spec.matmuls[2], *shapes[2]), *matrix(spec.matmuls[3], *shapes[3])]
    x = torch.randn(rows, spec.hidden)
    index = lambda *shape: torch.zeros(shape, dtype=torch.int64)  # noqa: E731
    step = [
        torch.ones(rows, 1, spec.head_dim),
        torch.zeros(rows, 1, spec.head_dim),
        torch.zeros(num_pages, spec.num_layers, 2, spec.page_size, spec.kv_heads, spec.head_dim, dtype=spec.storage_dtype),
        index(1),
        index(rows),
        index(rows),
        index(rows, width),
        torch.full((rows,), 2, dtype=torch.int64),
        torch.ones(spec.num_layers, 2),
    ]
    row = {0: row_dim}
    step_dims = [
        row,
        row,
        {0: Dim("pages", min=2, max=1 << 30)},
        None,
        row,
        row,
        {0: row_dim, 1: Dim("pages_per_seq", min=1, max=1 << 20)},
        row,
        None,
    ]
    if spec.part == "layer":
        weights = attention_w + mlp_w
        return (x, weights, step), (row, [None] * len(weights), step_dims)
    if spec.part == "attention":
        return (x, torch.zeros_like(x), attention_w, step), (row, row, [None] * len(attention_w), step_dims)
    return (x, torch.zeros_like(x), mlp_w), (row, row, [None] * len(mlp_w))


def build(spec: LayerSpec, path: Path) -> None:
    """Export and compile one library to `path` (written whole or not at all)."""
    module = _MODULES[spec.part](spec)
    args, dynamic = _example_inputs(spec)
    with torch.no_grad():
        program = torch.export.export(module, args, dynamic_shapes=dynamic)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as scratch:
        package = Path(scratch) / path.name
        torch._inductor.aoti_compile_and_package(program, package_path=str(package))
        os.replace(package, path)
