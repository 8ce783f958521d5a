"""The decoder layer as AOTInductor compiles it: `LayerSpec` (what a library depends on, its cache
key), the modules that trace executor/model/decoder.py's blocks, and `build`, which exports one with
torch.export and compiles it with AOTInductor's C++ wrapper into one package.

Nothing of the layer is written here: the modules call `attention_block` and `mlp_block`, the code
the eager forward runs, with the attention of their kind of step:
- `decode`: every row one sequence's new token: executor.model.attention.decode_attention;
- `mixed`: the first rows decodes (decode_attention over their tables), the rest one sequence's
  prefill chunk (masked_chunk_attention over its pages), the step a server at high concurrency
  runs most.

The weights are inputs, not constants: one library serves every layer of a model and every
checkpoint of the same shape. Inputs are the decoder's dataclasses (pytree nodes), flattened in
field order. Rows, table widths and the cache's page count are dynamic. Attention reads every slot
of every page in each table, masked by an added -inf: the clearing rule stays load-bearing
(tests/model/test_runners.py runs the NaN cases through every library kind).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils._pytree import register_dataclass, tree_flatten

from executor import cache, kernels
from executor.cache import from_storage
from executor.disk_cache import cpu_identity, digest
from executor.gguf_file import Q4_BLOCK
from executor.kernels import MatmulWeights
from executor.model import attention, decoder
from executor.model.attention import chunk_bias, decode_attention, decode_bias, gather_kv, masked_chunk_attention
from executor.model.decoder import AttentionWeights, LayerShape, MlpWeights, StepTensors, attention_block, mlp_block

# A library holds the code it was traced from: an edit to any of these files makes every key new.
_SOURCE_DIGEST = hashlib.sha256(
    b"".join(Path(module.__file__).read_bytes() for module in (attention, decoder, cache, kernels))
    + Path(__file__).read_bytes()
).hexdigest()

STEP_KINDS = ("decode", "mixed")
PARTS = ("layer", "attention", "mlp")


@dataclass(frozen=True)
class LayerSpec:
    """Everything a compiled library depends on besides the CPU and torch: the cache key.

    `part` is `layer` (a whole decoder layer: world size 1), or `attention` / `mlp`, the halves
    around the two all-reduces of a tensor-parallel layer. `step` is the kind of step (above).
    `matmuls` names the kernel of QKV, o_proj, gate/up and down: `int4` or `dense`.
    """

    part: str
    step: str
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
    qkv_bias: bool
    window: int | None
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

    @property
    def shape(self) -> LayerShape:
        return LayerShape(
            self.hidden, self.q_heads, self.kv_heads, self.head_dim, self.ffn, self.rms_eps, self.torch_dtype, self.window
        )

    def matrix_shapes(self) -> tuple[tuple[int, int], ...]:
        """[out, in] of QKV, o_proj, gate/up and down."""
        d = self.head_dim
        return (
            ((self.q_heads + 2 * self.kv_heads) * d, self.hidden),
            (self.hidden, self.q_heads * d),
            (2 * self.ffn, self.hidden),
            (self.hidden, self.ffn),
        )


@dataclass
class DecodeRows:
    """The decode rows' attention inputs: their page tables [d, W] and context lengths [d]."""

    table: torch.Tensor
    context: torch.Tensor


@dataclass
class ChunkRows:
    """A prefill chunk's: its sequence's page table [1, W] and the step's positions [T] (the
    chunk's rows are the last T - d)."""

    table: torch.Tensor
    positions: torch.Tensor


for _cls in (DecodeRows, ChunkRows):
    register_dataclass(_cls, serialized_type_name=f"{_cls.__module__}.{_cls.__qualname__}")


def _attend(spec: LayerSpec, step: StepTensors, layer: torch.Tensor, decodes: DecodeRows, chunk: ChunkRows | None):
    """The attention of this kind of step, as `attention_block` takes it."""
    shape = spec.shape

    def attend(q: torch.Tensor) -> torch.Tensor:
        d = decodes.table.shape[0]
        bias = decode_bias(decodes.context, decodes.table.shape[1] * spec.page_size, shape.q_heads, shape.kv_heads, shape.window)
        decoded = decode_attention(q[:d], step.kv, layer, decodes.table, bias, step.scales)
        if chunk is None:
            return decoded
        k_scale, v_scale = step.scales[layer][0]
        k, v = gather_kv(step.kv, layer, chunk.table)
        k, v = from_storage(k, k_scale, shape.dtype), from_storage(v, v_scale, shape.dtype)
        group = shape.q_heads // shape.kv_heads
        positions = chunk.positions[d:]
        mask = chunk_bias(positions, chunk.table.shape[1] * spec.page_size, shape.window, shape.dtype, group)
        return torch.cat((decoded, masked_chunk_attention(q[d:], k, v, mask, shape.kv_heads)))

    return attend


class _Layer(torch.nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, x, attention_w, mlp_w, step, layer, decodes, chunk=None):  # noqa: ANN001, ANN201
        shape = self.spec.shape
        x = x + attention_block(shape, x, attention_w, step, layer, _attend(self.spec, step, layer, decodes, chunk))
        return x + mlp_block(shape, x, mlp_w)


class _AttentionHalf(torch.nn.Module):
    """The previous layer's all-reduced MLP output added in, then attention up to o_proj's partial sum."""

    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, x, delta, attention_w, step, layer, decodes, chunk=None):  # noqa: ANN001, ANN201
        x = x + delta
        return x, attention_block(self.spec.shape, x, attention_w, step, layer, _attend(self.spec, step, layer, decodes, chunk))


class _MlpHalf(torch.nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, x, delta, mlp_w):  # noqa: ANN001, ANN201
        x = x + delta
        return x, mlp_block(self.spec.shape, x, mlp_w)


_MODULES = {"layer": _Layer, "attention": _AttentionHalf, "mlp": _MlpHalf}


def flat_inputs(*args: object) -> list[torch.Tensor]:
    """The library's inputs in the order export flattened them (pytree leaves, None fields left out)."""
    return tree_flatten(args)[0]


def _static(tree: object) -> object:
    """A dynamic-shapes entry for an input whose every dimension is static: None per tensor, and a
    list of its set fields' entries for a dataclass (a pytree node without its None fields), as
    torch.export matches them."""
    if isinstance(tree, torch.Tensor):
        return None
    return [_static(getattr(tree, name)) for name in tree.__dataclass_fields__ if getattr(tree, name) is not None]


def _example_inputs(spec: LayerSpec) -> tuple[tuple, tuple]:
    """Inputs of the right dtypes and layouts (their values never matter) and their dynamic dims.

    The examples avoid sizes 0 and 1, which torch.export would specialize on, and no two are the
    same tensor: export would take them for one input. A range of one row count is static."""
    from torch.export import Dim

    static = spec.min_rows == spec.max_rows
    decodes_n, chunk_n = (2, 3) if spec.step == "mixed" else (max(2, spec.min_rows), 0)
    rows = spec.min_rows if static else decodes_n + chunk_n
    width, num_pages, dtype = 3, 5, spec.torch_dtype
    # A mixed step's rows are its decodes and its chunk: export derives guards that relate the two
    # (a chunk of at least 2 rows), which only Dim.DYNAMIC lets it record rather than refuse.
    if static:
        row_dim = None
    elif spec.step == "mixed":
        row_dim = Dim.DYNAMIC
    else:
        row_dim = Dim("rows", min=spec.min_rows, max=spec.max_rows)
    pages_dim = Dim("pages_per_seq", min=1, max=1 << 20)

    def matrix(kind: str, out_features: int, in_features: int) -> MatmulWeights:
        if kind == "int4":
            q = torch.zeros(out_features, in_features, dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            return MatmulWeights(int4=packed, int4_scales=torch.zeros(in_features // Q4_BLOCK, out_features, 2, dtype=dtype))
        return MatmulWeights(weight=torch.zeros(out_features, in_features, dtype=dtype))

    shapes, kinds = spec.matrix_shapes(), spec.matmuls
    bias = torch.zeros(shapes[0][0], dtype=dtype) if spec.qkv_bias else None
    attention_w = AttentionWeights(torch.ones(spec.hidden), matrix(kinds[0], *shapes[0]), matrix(kinds[1], *shapes[1]), bias)
    mlp_w = MlpWeights(torch.ones(spec.hidden), matrix(kinds[2], *shapes[2]), matrix(kinds[3], *shapes[3]))
    x = torch.randn(rows, spec.hidden)
    index = lambda *shape: torch.zeros(shape, dtype=torch.int64)  # noqa: E731
    step = StepTensors(
        torch.ones(rows, 1, spec.head_dim),
        torch.zeros(rows, 1, spec.head_dim),
        index(rows),
        index(rows),
        torch.zeros(num_pages, spec.num_layers, 2, spec.page_size, spec.kv_heads, spec.head_dim, dtype=spec.storage_dtype),
        torch.ones(spec.num_layers, 2),
    )
    row = {0: row_dim}
    step_dims = [row, row, row, row, {0: Dim("pages", min=2, max=1 << 30)}, None]
    if spec.step == "decode":
        decodes = DecodeRows(index(rows, width), torch.full((rows,), 2, dtype=torch.int64))
        decode_dims, chunk, chunk_dims = [{0: row_dim, 1: pages_dim}, row], None, None
    else:
        decode_dim = Dim.DYNAMIC
        decodes = DecodeRows(index(decodes_n, width), torch.full((decodes_n,), 2, dtype=torch.int64))
        decode_dims = [{0: decode_dim, 1: pages_dim}, {0: decode_dim}]
        chunk = ChunkRows(index(1, width + 1), torch.arange(rows, dtype=torch.int64))
        chunk_dims = [{1: Dim("chunk_pages", min=1, max=1 << 20)}, row]
    layer = index(1)
    tail = (step, layer, decodes) + ((chunk,) if chunk is not None else ())
    tail_dims = (step_dims, None, decode_dims) + ((chunk_dims,) if chunk is not None else ())
    if spec.part == "layer":
        return (x, attention_w, mlp_w, *tail), (row, _static(attention_w), _static(mlp_w), *tail_dims)
    if spec.part == "attention":
        return (x, torch.zeros_like(x), attention_w, *tail), (row, row, _static(attention_w), *tail_dims)
    return (x, torch.zeros_like(x), mlp_w), (row, row, _static(mlp_w))


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
