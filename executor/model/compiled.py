"""Steps as AOTInductor-compiled layers: one C++ call per decoder layer, no Python per op.

An eager step of SmolLM2 runs ~40 small ops per layer, and on a 2-core CPU their fixed costs
(Python, dispatch, OpenMP fork/join, and a descheduled thread at every barrier when the machine is
shared) cost more than its weights take to read at batch 1 (docs/model.md). Here the decoder layer
(executor/model/decoder.py, the code the eager forward runs) is exported with torch.export and
compiled by AOTInductor with its C++ wrapper into a shared library (executor/model/aot_layer.py),
once per machine, shape and kind of step (`LayerSpec`: decode steps, and mixed steps of decodes
beside one prefill chunk, or that chunk alone), and cached on disk (executor/model/kernel_cache.py).
This module is the runtime side: which libraries a model needs (`_plan`), loading them, and
`CompiledLayers.run`, which calls them in place of the eager layer loop. Which runner serves a step
is executor/model/runner.py's choice.

Building, by `TP_RUNTIME_COMPILE`: `auto` (the default) loads what is built and never builds at
start-up: a model whose libraries are missing decodes eager, and once this machine has spent
BUILD_AFTER_EAGER_S decoding models of that shape eagerly (over any number of runs), one detached,
lowest-priority process builds them for the next start. `wait` builds what is missing before the
first step they serve (benchmarks, tests); `off` runs eager.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import executor.model.kernel_cache as kernel_cache
from executor import kernels
from executor.cache import KVCache
from executor.disk_cache import digest, file_lock, write_atomically
from executor.inputs import StepInputs
from executor.model.aot_layer import ChunkRows, DecodeRows, LayerSpec, flat_inputs
from executor.model.decoder import LayerShape, StepTensors

if TYPE_CHECKING:
    from executor.model.llama import LayerWeights

log = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "wait", "off")
MAX_ROWS = 1 << 14
# `auto` builds once this machine has spent this long decoding a model of one shape eagerly, over
# any number of runs. A build costs about as much (a minute or two of one core, measured in
# docs/model.md): the ski-rental rule, rent until the rent paid equals the price, then buy. Short
# runs (a test suite's toy models, a few `generate`s) never pay for a build they would not use.
BUILD_AFTER_EAGER_S = 60.0
REPORT_EVERY_S = 5.0  # eager decode time is added to the count on disk in pieces this long


def compile_mode() -> str:
    mode = os.environ.get("TP_RUNTIME_COMPILE", "auto")
    if mode not in COMPILE_MODES:
        log.warning(f"TP_RUNTIME_COMPILE={mode!r} is not one of {', '.join(COMPILE_MODES)}; running eager")
        return "off"
    return mode


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
    previous = os.environ.get("TMPDIR")
    # The loader unpacks each package under TMPDIR (read when it runs): into this process's folder
    # of the cache, which the next process to load removes once this one is gone.
    os.environ["TMPDIR"] = str(kernel_cache.unpack_dir())
    try:
        return {spec: CompiledLayer(spec, kernel_cache.package_path(spec)) for spec in specs}
    except RuntimeError as exc:
        log.warning(f"compiled decode kernels in {kernel_cache.kernel_dir()} could not be loaded ({exc}); decode runs eager")
        return None
    finally:
        if previous is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = previous


def _buildable(missing: list[LayerSpec]) -> bool:
    """Whether a build may be started: a compiler is there and none of these failed before (a
    failed build is not retried for the same key; its log stays beside the cache entry)."""
    failed = [spec for spec in missing if kernel_cache.failure_log(spec).is_file()]
    if failed:
        log.warning(
            f"compiled decode kernels failed to build on this machine before (see {kernel_cache.failure_log(failed[0])}); "
            "decode runs eager. Delete that file to try again."
        )
        return False
    if not kernel_cache.compiler_available():
        log.warning("no C++ compiler (g++ or clang++) on PATH: decode runs eager, without compiled kernels")
        return False
    return True


class CompiledLayers:
    """The compiled layers of one model over one KV cache: `run` replaces the eager layer loop of a
    step that a loaded library covers (`covers`): a decode step, or a mixed step (decodes, then one
    prefill chunk last, as the scheduler orders them; a chunk alone too).

    A mixed-format model has two row ranges, as its matrices do: int4 up to the probe's crossover,
    dense above it. Every layer of a file usually has the same kinds of matrices and window and so
    shares one library per range and kind of step; a layer that differs (a GGUF mixing quantization
    types, Qwen2's windowed layers) gets its own.

    Without its libraries (mode `auto`, not built yet) the model runs eager and reports the time it
    spent on steps these layers would serve (`eager_ran`): once this machine has spent
    BUILD_AFTER_EAGER_S so on a model of this shape, over any number of runs, a background build
    starts."""

    def __init__(self, layers: list[LayerWeights], world_size: int, plan: list[_Range], mode: str) -> None:
        self.world_size = world_size
        self.plan = plan
        self.specs = list(dict.fromkeys(spec for r in plan for specs in r.layers for spec in specs))
        self.mode = mode
        self.ranges: list[tuple[_Range, list[list[_LayerCall]]]] = []
        self._layers = layers
        self._usage = kernel_cache.kernel_dir() / "usage" / f"{digest({'specs': [spec.key() for spec in self.specs]})}.json"
        self._unreported = 0.0
        self._may_build = False

    @classmethod
    def attach(
        cls, layers: list[LayerWeights], shapes: list[LayerShape], world_size: int, cache: KVCache, mode: str
    ) -> CompiledLayers | None:
        """The compiled layers of this model over this cache's geometry, their libraries loaded
        where they are built (in `wait` mode built first); None where none can run (off, CUDA)."""
        if mode == "off" or cache.device.type != "cpu":
            return None
        compiled = cls(layers, world_size, _plan(layers, shapes, world_size, cache), mode)
        missing = [spec for spec in compiled.specs if not kernel_cache.package_path(spec).is_file()]
        if missing and not _buildable(missing):
            return compiled
        if missing and mode == "wait":
            begin = time.monotonic()
            log.warning(f"building compiled layers for this CPU and model shape (log {kernel_cache.build_log()})")
            kernel_cache.start_build(missing, background=False).wait()
            missing = [spec for spec in missing if not kernel_cache.package_path(spec).is_file()]
            if missing:
                log.warning(f"building compiled layers failed (see {kernel_cache.build_log()}); steps run eager")
                return compiled
            log.warning(f"compiled layers built in {time.monotonic() - begin:.0f} s")
        if missing:
            compiled._may_build = True
            log.info(
                f"steps run eager: no compiled layers for this CPU and model shape in {kernel_cache.kernel_dir()} yet; they "
                f"build in the background after {BUILD_AFTER_EAGER_S:.0f} s of eager steps on this machine, "
                "or before the first step with TP_RUNTIME_COMPILE=wait"
            )
            return compiled
        libraries = _load(compiled.specs)
        if libraries is not None:
            compiled._bind(libraries)
            kernels.warm_dense_linear()
            log.info(f"steps run compiled layers from {kernel_cache.kernel_dir()} ({len(compiled.specs)} libraries)")
        return compiled

    def _bind(self, libraries: dict[LayerSpec, CompiledLayer]) -> None:
        for r in self.plan:
            calls = []
            for layer, specs in zip(self._layers, r.layers):
                attention_w, mlp_w = layer.blocks(r.low)
                if len(specs) == 1:
                    calls.append([_LayerCall(libraries[specs[0]], flat_inputs(attention_w, mlp_w))])
                else:
                    calls.append([
                        _LayerCall(libraries[specs[0]], flat_inputs(attention_w)),
                        _LayerCall(libraries[specs[1]], flat_inputs(mlp_w)),
                    ])
            self.ranges.append((r, calls))

    @staticmethod
    def step_kind(inputs: StepInputs) -> str | None:
        """`decode`, `mixed` (decodes, then one sequence of several new tokens last), or None.

        A prefill chunk with no decode beside it runs eager: the library computes every column of
        its chunk's scores, where the eager CPU path skips the causal upper triangle with the
        flash kernel; a 1024-token prefill took 2.4x as long compiled (docs/model.md). Several
        chunks in one step run eager too."""
        if inputs.is_decode:
            return "decode"
        chunks = inputs.query_lens_host > 1
        if inputs.num_seqs > 1 and chunks[-1] and not chunks[:-1].any():
            return "mixed"
        return None

    def _calls(self, inputs: StepInputs) -> list[list[_LayerCall]] | None:
        kind, rows = self.step_kind(inputs), inputs.num_tokens
        return next((calls for r, calls in self.ranges if r.kind == kind and r.low <= rows <= r.high), None)

    def covers(self, inputs: StepInputs) -> bool:
        return self._calls(inputs) is not None

    def would_cover(self, inputs: StepInputs) -> bool:
        """A step of a kind these layers serve once built."""
        kind, rows = self.step_kind(inputs), inputs.num_tokens
        return any(r.kind == kind and r.low <= rows <= r.high for r in self.plan)

    def eager_ran(self, seconds: float) -> None:
        """Account eager time on steps these layers would serve, on disk (every few seconds);
        start the build when it is due."""
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
        missing = [spec for spec in self.specs if not kernel_cache.package_path(spec).is_file()]
        started = kernel_cache.start_build(missing, background=True) if missing else None
        if started is not None:
            log.warning(
                f"this machine has run {total:.0f} s of eager steps with a model of this shape: building compiled "
                f"layers in the background (pid {started.pid}, log {kernel_cache.build_log()}); later starts use them"
            )

    def run(self, x: torch.Tensor, step: StepTensors, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """The residual stream after every layer of a step that `covers` holds for."""
        calls = self._calls(inputs)
        tail = [*flat_inputs(step), None, *flat_inputs(*_attention_rows(inputs, cache.page_size))]
        # The libraries assume the layouts they were compiled for: all of these are contiguous.
        if not all(t.is_contiguous() for t in (x, *tail) if t is not None):
            raise RuntimeError("compiled layers need contiguous inputs")
        at = tail.index(None)
        if self.world_size == 1:
            for layer_id, (call,) in zip(cache.layer_ids, calls):
                tail[at] = layer_id
                x = call.library.run([x, *call.weights, *tail])[0]
            return x
        delta = torch.zeros_like(x)
        for layer_id, (attention, mlp) in zip(cache.layer_ids, calls):
            tail[at] = layer_id
            x, partial = attention.library.run([x, delta, *attention.weights, *tail])
            dist.all_reduce(partial)
            x, delta = mlp.library.run([x, partial, *mlp.weights])
            dist.all_reduce(delta)
        return x + delta


def _attention_rows(inputs: StepInputs, page_size: int) -> tuple[DecodeRows, ...] | tuple[DecodeRows, ChunkRows]:
    """The attention inputs of a decode or mixed step, each table as wide as its rows need."""
    if inputs.is_decode:
        return (DecodeRows(inputs.page_table, inputs.context_lens),)
    decodes = inputs.num_seqs - 1
    pages = -(-inputs.context_lens_host // page_size)
    width = int(pages[:decodes].max()) if decodes else 1
    return (
        DecodeRows(inputs.page_table[:decodes, :width].contiguous(), inputs.context_lens[:decodes].contiguous()),
        ChunkRows(inputs.page_table[decodes:, : int(pages[-1])].contiguous(), inputs.positions),
    )


@dataclass(frozen=True)
class _Range:
    """One kind of step over a range of row counts, and each layer's library specs (one, or two
    halves at TP > 1)."""

    kind: str
    low: int
    high: int
    layers: list[list[LayerSpec]]


def _plan(layers: list[LayerWeights], shapes: list[LayerShape], world_size: int, cache: KVCache) -> list[_Range]:
    linears = [layer.matrices for layer in layers]
    threshold = linears[0][0].int4_max_rows
    mixed = any(m.int4 is not None and m.weight is not None for layer in linears for m in layer)
    bounds = [(1, threshold), (threshold + 1, MAX_ROWS)] if mixed else [(1, MAX_ROWS)]
    parts = ("layer",) if world_size == 1 else ("attention", "mlp")
    plan = []
    for kind in ("decode", "mixed"):
        for low, high in bounds:
            # A mixed step has a chunk of at least two rows.
            low = max(low, 2) if kind == "mixed" else low
            if low > high:
                continue
            layer_specs = []
            for layer, shape in zip(linears, shapes):
                spec = LayerSpec(
                    part=parts[0],
                    step=kind,
                    hidden=shape.hidden,
                    q_heads=shape.q_heads,
                    kv_heads=shape.kv_heads,
                    head_dim=shape.head_dim,
                    ffn=shape.ffn,
                    rms_eps=shape.rms_eps,
                    num_layers=cache.num_layers,
                    page_size=cache.page_size,
                    dtype=str(shape.dtype).removeprefix("torch."),
                    kv_dtype=str(cache.storage_dtype).removeprefix("torch."),
                    matmuls=tuple("int4" if m.uses_int4(low) else "dense" for m in layer),
                    qkv_bias=layer[0].bias is not None,
                    window=shape.window,
                    min_rows=low,
                    max_rows=high,
                    threads=torch.get_num_threads(),
                )
                layer_specs.append([replace(spec, part=part) for part in parts])
            plan.append(_Range(kind, low, high, layer_specs))
    return plan


@dataclass
class _LayerCall:
    library: CompiledLayer
    weights: list[torch.Tensor]
