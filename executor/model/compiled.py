"""Decode steps as AOTInductor-compiled layers: one C++ call per decoder layer, no Python per op.

An eager decode step of SmolLM2 runs ~40 small ops per layer, and on a 2-core CPU their fixed
costs (Python, dispatch, OpenMP fork/join) cost more than its weights take to read at batch 1
(docs/model.md). Here a layer (RMSNorm, QKV, rotary, the KV-cache write, paged attention over whole
pages, o_proj, RMSNorm, gate/up, SiLU, down, both residual adds) is exported with torch.export and
compiled by AOTInductor with its C++ wrapper into a shared library, once per machine and shape
(`LayerSpec`), and cached on disk (executor/disk_cache.py). The weights are inputs, not constants:
one library serves every layer of a model and every checkpoint of the same shape. The row count,
the page-table width and the cache's page count are dynamic.

Matmuls inside the library: torch's CPU int4 kernel as an extern call, and for dense weights the
oneDNN-packed matmul of executor.model.layers through the custom op `tp_runtime::dense_linear`
(a packed oneDNN weight is opaque to the compiler, so it is passed through untouched).

Attention in the library reads every slot of every page in each sequence's table, masked by an
additive -inf past its length: the clearing rule stays load-bearing (tests/model/test_compiled.py
runs the NaN cases through it).

Building, by `TP_RUNTIME_COMPILE`: `auto` (the default) loads what is built and never builds at
start-up: a model whose libraries are missing decodes eager, and once this machine has spent
BUILD_AFTER_EAGER_S decoding models of that shape eagerly (over any number of runs), one detached,
lowest-priority process builds them for the next start. `wait` builds what is missing before the
first decode step (benchmarks, tests); `off` runs eager. Prefill and mixed steps always run eager.
The cache: kernel_dir(), one package of ~2 MB per library (a model needs one per row range and,
at TP > 1, two per range and rank) and Inductor's own cache of compiler checks and headers beside.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from executor.disk_cache import cache_root, cpu_identity, digest, file_lock, write_atomically
from executor.gguf_file import Q4_BLOCK
from executor.inputs import StepInputs
from executor.model.layers import Linear, dense_matmul

if TYPE_CHECKING:
    from executor.cache import KVCache
    from executor.model.llama import LlamaModel

log = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "wait", "off")
MAX_ROWS = 1 << 14
# `auto` builds once this machine has spent this long decoding a model of one shape eagerly, over
# any number of runs. A build costs about as much (a minute or two of one core, measured in
# docs/model.md): the ski-rental rule, rent until the rent paid equals the price, then buy. Short
# runs (a test suite's toy models, a few `generate`s) never pay for a build they would not use.
BUILD_AFTER_EAGER_S = 60.0
REPORT_EVERY_S = 5.0  # eager decode time is added to the count on disk in pieces this long
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


def kernel_dir() -> Path:
    return cache_root() / "kernels"


def compile_mode() -> str:
    mode = os.environ.get("TP_RUNTIME_COMPILE", "auto")
    if mode not in COMPILE_MODES:
        log.warning(f"TP_RUNTIME_COMPILE={mode!r} is not one of {', '.join(COMPILE_MODES)}; running eager")
        return "off"
    return mode


def compiler_available() -> bool:
    """AOTInductor compiles C++ with $CXX or the first of g++ / clang++ on PATH."""
    return any(shutil.which(name) for name in filter(None, (os.environ.get("CXX"), "g++", "clang++", "c++")))


class CompiledLayer:
    """A loaded library: `run(inputs)` is one C++ call."""

    def __init__(self, spec: LayerSpec, path: Path) -> None:
        self.spec = spec
        self.path = path
        # The loader alone, not torch._inductor.aoti_load_package: that imports Inductor (~1.5 s
        # of start-up) to wrap the same object in pytree handling the caller does not need.
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._loader.run(inputs)


def _load(specs: list[LayerSpec]) -> dict[LayerSpec, CompiledLayer] | None:
    try:
        return {spec: CompiledLayer(spec, _package(spec)) for spec in specs}
    except RuntimeError as exc:
        log.warning(f"compiled decode kernels in {kernel_dir()} could not be loaded ({exc}); decode runs eager")
        return None


def _buildable(missing: list[LayerSpec]) -> bool:
    """Whether a build may be started: a compiler is there and none of these failed before (a
    failed build is not retried for the same key; its log stays beside the cache entry)."""
    failed = [spec for spec in missing if _failure_log(spec).is_file()]
    if failed:
        log.warning(
            f"compiled decode kernels failed to build on this machine before (see {_failure_log(failed[0])}); "
            "decode runs eager. Delete that file to try again."
        )
        return False
    if not compiler_available():
        log.warning("no C++ compiler (g++ or clang++) on PATH: decode runs eager, without compiled kernels")
        return False
    return True


class CompiledDecode:
    """The compiled layers of one model over one KV cache: `run` replaces the eager layer loop of a
    decode step whose row count a loaded library covers (`covers`).

    A mixed-format model has two row ranges, as its matrices do: int4 up to the probe's crossover,
    dense above it. Every layer of a file usually has the same kinds of matrices and so shares one
    library per range; a layer that differs (a GGUF mixing quantization types) gets its own.

    Without its libraries (mode `auto`, not built yet) the model decodes eager and reports the time
    it spent (`eager_decoded`): once this machine has spent BUILD_AFTER_EAGER_S decoding a model of
    this shape eagerly, over any number of runs, a background build starts."""

    def __init__(self, model: LlamaModel, plan: list[tuple[int, int, list[list[LayerSpec]]]], mode: str) -> None:
        self.world_size = model.shard.world_size
        self.layer_ids = [torch.tensor([index]) for index in range(model.config.num_layers)]
        self.plan = plan
        self.specs = list(dict.fromkeys(spec for _, _, layers in plan for specs in layers for spec in specs))
        self.mode = mode
        self.ranges: list[tuple[int, int, list[list[_LayerCall]]]] = []
        self._model = model
        self._usage = kernel_dir() / "usage" / f"{digest({'specs': [spec.key() for spec in self.specs]})}.json"
        self._unreported = 0.0
        self._may_build = False

    @classmethod
    def attach(cls, model: LlamaModel, cache: KVCache, mode: str) -> CompiledDecode | None:
        """The compiled decode of this model over this cache's geometry, its libraries loaded
        where they are built (in `wait` mode built first); None where none can run (off, CUDA)."""
        if mode == "off" or model.device.type != "cpu":
            return None
        decode = cls(model, _plan(model, cache), mode)
        missing = [spec for spec in decode.specs if not _package(spec).is_file()]
        if missing and not _buildable(missing):
            return decode
        if missing and mode == "wait":
            begin = time.monotonic()
            log.warning(f"building compiled decode kernels for this CPU and model shape (log {_build_log()})")
            _start_build(missing, background=False).wait()
            missing = [spec for spec in missing if not _package(spec).is_file()]
            if missing:
                log.warning(f"building compiled decode kernels failed (see {_build_log()}); decode runs eager")
                return decode
            log.warning(f"compiled decode kernels built in {time.monotonic() - begin:.0f} s")
        if missing:
            decode._may_build = True
            log.info(
                f"decode runs eager: no compiled kernels for this CPU and model shape in {kernel_dir()} yet; they "
                f"build in the background after {BUILD_AFTER_EAGER_S:.0f} s of eager decoding on this machine, "
                "or before the first step with TP_RUNTIME_COMPILE=wait"
            )
            return decode
        libraries = _load(decode.specs)
        if libraries is not None:
            decode._bind(libraries)
            log.info(f"decode runs compiled kernels from {kernel_dir()} ({len(decode.specs)} libraries)")
        return decode

    def _bind(self, libraries: dict[LayerSpec, CompiledLayer]) -> None:
        for low, high, layers in self.plan:
            calls = []
            for layer, specs in zip(self._model.layers, layers):
                kinds = specs[0].matmuls
                attention_w = [layer.attn_norm, *_inputs_of(layer.qkv, kinds[0]), *_inputs_of(layer.o, kinds[1])]
                mlp_w = [layer.ffn_norm, *_inputs_of(layer.gate_up, kinds[2]), *_inputs_of(layer.down, kinds[3])]
                if len(specs) == 1:
                    calls.append([_LayerCall(libraries[specs[0]], attention_w + mlp_w)])
                else:
                    calls.append([_LayerCall(libraries[specs[0]], attention_w), _LayerCall(libraries[specs[1]], mlp_w)])
            self.ranges.append((low, high, calls))

    def covers(self, rows: int) -> bool:
        return any(low <= rows <= high for low, high, _ in self.ranges)

    def eager_decoded(self, seconds: float) -> None:
        """Account eager decode time on disk (every few seconds); start the build when it is due."""
        if not self._may_build:
            return
        self._unreported += seconds
        if self._unreported < REPORT_EVERY_S:
            return
        with file_lock(self._usage.with_suffix(".lock")):
            try:
                total = json.loads(self._usage.read_text())["eager_decode_s"]
            except (OSError, ValueError, KeyError):
                total = 0.0
            total += self._unreported
            write_atomically(self._usage, json.dumps({"eager_decode_s": total}).encode())
        self._unreported = 0.0
        if total < BUILD_AFTER_EAGER_S:
            return
        self._may_build = False
        missing = [spec for spec in self.specs if not _package(spec).is_file()]
        started = _start_build(missing, background=True) if missing else None
        if started is not None:
            log.warning(
                f"this machine has decoded {total:.0f} s eagerly with a model of this shape: building compiled "
                f"decode kernels in the background (pid {started.pid}, log {_build_log()}); later starts use them"
            )

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """The residual stream after every layer of a decode step of x.shape[0] rows."""
        rows = x.shape[0]
        calls = next(layers for low, high, layers in self.ranges if low <= rows <= high)
        step = [
            cos, sin, cache.data, None, inputs.write_pages, inputs.write_offsets, inputs.page_table, inputs.context_lens,
            cache.scales,
        ]
        # The libraries assume the layouts they were compiled for: all of these are contiguous.
        if not all(t.is_contiguous() for t in (x, *step[:3], *step[4:])):
            raise RuntimeError("compiled decode layers need contiguous inputs")
        if self.world_size == 1:
            for layer_id, (call,) in zip(self.layer_ids, calls):
                step[3] = layer_id
                x = call.library.run([x, *call.weights, *step])[0]
            return x
        delta = torch.zeros_like(x)
        for layer_id, (attention, mlp) in zip(self.layer_ids, calls):
            step[3] = layer_id
            x, partial = attention.library.run([x, delta, *attention.weights, *step])
            dist.all_reduce(partial)
            x, delta = mlp.library.run([x, partial, *mlp.weights])
            dist.all_reduce(delta)
        return x + delta


def _plan(model: LlamaModel, cache: KVCache) -> list[tuple[int, int, list[list[LayerSpec]]]]:
    """Row ranges and, for each, every layer's library specs (one, or two halves at TP > 1)."""
    config, shard = model.config, model.shard
    linears = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in model.layers]
    threshold = linears[0][0].int4_max_rows
    mixed = any(m.int4 is not None and m.weight is not None for layer in linears for m in layer)
    bounds = [(1, threshold), (threshold + 1, MAX_ROWS)] if mixed else [(1, MAX_ROWS)]
    parts = ("layer",) if shard.world_size == 1 else ("attention", "mlp")
    plan = []
    for low, high in bounds:
        base = LayerSpec(
            part=parts[0],
            hidden=config.hidden_size,
            q_heads=shard.local_q_heads,
            kv_heads=shard.local_kv_heads,
            head_dim=config.head_dim,
            ffn=model.ffn_width,
            rms_eps=config.rms_eps,
            num_layers=config.num_layers,
            page_size=cache.page_size,
            dtype=str(model.dtype).removeprefix("torch."),
            kv_dtype=str(cache.storage_dtype).removeprefix("torch."),
            matmuls=("dense",) * 4,
            min_rows=low,
            max_rows=high,
            threads=torch.get_num_threads(),
        )
        kinds = [tuple("int4" if m.uses_int4(low) else "dense" for m in layer) for layer in linears]
        plan.append((low, high, [[replace(base, part=part, matmuls=k) for part in parts] for k in kinds]))
    return plan


@dataclass
class _LayerCall:
    library: CompiledLayer
    weights: list[torch.Tensor]


def _inputs_of(linear: Linear, kind: str) -> list[torch.Tensor]:
    return [linear.int4, linear.int4_scales] if kind == "int4" else [linear.weight]


def _package(spec: LayerSpec) -> Path:
    return kernel_dir() / f"{spec.key()}.pt2"


def _failure_log(spec: LayerSpec) -> Path:
    return kernel_dir() / f"{spec.key()}.failed.log"


def _build_log() -> Path:
    return kernel_dir() / "build.log"


def _start_build(specs: list[LayerSpec], *, background: bool) -> subprocess.Popen | None:
    """A build of `specs` in its own process (`python -m executor.model.compiled`).

    In the background it is detached (it outlives a short `generate`, as `git gc --auto` does) and
    runs at the lowest priority; it is not started while another build holds the machine's build
    lock (None). Builds take the lock in turn, so the ranks of one launch, which each ask for their
    own shapes, build one after the other."""
    if background:
        with file_lock(kernel_dir() / "build.lock", blocking=False) as free:
            if not free:
                return None
    request = kernel_dir() / f".request-{os.getpid()}-{time.monotonic_ns()}.json"
    write_atomically(request, json.dumps([asdict(spec) for spec in specs]).encode())
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    with open(_build_log(), "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _BUILD_MAIN, str(request), *(["--nice"] if background else [])],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=background,
        )


# The build process's entry: not `-m executor.model.compiled`, which would run this module a second
# time as __main__ beside the copy that the package import brings in.
_BUILD_MAIN = "import sys; from executor.model.compiled import build_main; sys.exit(build_main(sys.argv[1:]))"


def build_main(argv: list[str]) -> int:
    """The build process: each spec of the request that is not in the cache yet, under the lock."""
    if "--nice" in argv:
        os.nice(19)
    request = Path(argv[0])
    specs = [LayerSpec(**{**fields, "matmuls": tuple(fields["matmuls"])}) for fields in json.loads(request.read_text())]
    request.unlink()
    with file_lock(kernel_dir() / "build.lock"):
        # Inductor's own cache (compiler checks, precompiled headers: a build after the first takes
        # half the time) lives beside the packages.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(kernel_dir() / "inductor")
        status = 0
        for spec in specs:
            path = _package(spec)
            if path.is_file():
                continue
            begin = time.monotonic()
            torch.set_num_threads(spec.threads)
            print(f"building {path.name}: {json.dumps(asdict(spec))}", flush=True)
            try:
                build(spec, path)
            except Exception as exc:  # recorded, and not retried on every start
                write_atomically(_failure_log(spec), f"{json.dumps(asdict(spec))}\n{exc!r}\n".encode())
                print(f"failed: {exc!r}", flush=True)
                status = 1
                continue
            print(f"built {path.name} in {time.monotonic() - begin:.1f} s", flush=True)
        return status
