"""Decode steps as AOTInductor-compiled layers: one C++ call per decoder layer, no Python per op.

An eager decode step of SmolLM2 runs ~40 small ops per layer, and on a 2-core CPU their fixed
costs (Python, dispatch, OpenMP fork/join) cost more than its weights take to read at batch 1
(docs/model.md). Here a layer (RMSNorm, QKV, rotary, the KV-cache write, paged attention over whole
pages, o_proj, RMSNorm, gate/up, SiLU, down, both residual adds) is exported with torch.export and
compiled by AOTInductor with its C++ wrapper into a shared library (executor/model/aot_layer.py),
once per machine and shape (`LayerSpec`), and cached on disk (executor/model/kernel_cache.py).
This module is the runtime side: which libraries a model needs (`_plan`), loading them, and
`CompiledDecode.run`, which calls them in place of the eager layer loop.

Building, by `TP_RUNTIME_COMPILE`: `auto` (the default) loads what is built and never builds at
start-up: a model whose libraries are missing decodes eager, and once this machine has spent
BUILD_AFTER_EAGER_S decoding models of that shape eagerly (over any number of runs), one detached,
lowest-priority process builds them for the next start. `wait` builds what is missing before the
first decode step (benchmarks, tests); `off` runs eager. Prefill and mixed steps always run eager.
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

from executor.disk_cache import digest, file_lock, write_atomically
from executor.inputs import StepInputs
from executor.model import kernel_cache
from executor.model.aot_layer import LayerSpec
from executor.model.layers import Linear

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
    try:
        return {spec: CompiledLayer(spec, kernel_cache.package_path(spec)) for spec in specs}
    except RuntimeError as exc:
        log.warning(f"compiled decode kernels in {kernel_cache.kernel_dir()} could not be loaded ({exc}); decode runs eager")
        return None


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
        self._usage = kernel_cache.kernel_dir() / "usage" / f"{digest({'specs': [spec.key() for spec in self.specs]})}.json"
        self._unreported = 0.0
        self._may_build = False

    @classmethod
    def attach(cls, model: LlamaModel, cache: KVCache, mode: str) -> CompiledDecode | None:
        """The compiled decode of this model over this cache's geometry, its libraries loaded
        where they are built (in `wait` mode built first); None where none can run (off, CUDA)."""
        if mode == "off" or model.device.type != "cpu":
            return None
        decode = cls(model, _plan(model, cache), mode)
        missing = [spec for spec in decode.specs if not kernel_cache.package_path(spec).is_file()]
        if missing and not _buildable(missing):
            return decode
        if missing and mode == "wait":
            begin = time.monotonic()
            log.warning(f"building compiled decode kernels for this CPU and model shape (log {kernel_cache.build_log()})")
            kernel_cache.start_build(missing, background=False).wait()
            missing = [spec for spec in missing if not kernel_cache.package_path(spec).is_file()]
            if missing:
                log.warning(f"building compiled decode kernels failed (see {kernel_cache.build_log()}); decode runs eager")
                return decode
            log.warning(f"compiled decode kernels built in {time.monotonic() - begin:.0f} s")
        if missing:
            decode._may_build = True
            log.info(
                f"decode runs eager: no compiled kernels for this CPU and model shape in {kernel_cache.kernel_dir()} yet; they "
                f"build in the background after {BUILD_AFTER_EAGER_S:.0f} s of eager decoding on this machine, "
                "or before the first step with TP_RUNTIME_COMPILE=wait"
            )
            return decode
        libraries = _load(decode.specs)
        if libraries is not None:
            decode._bind(libraries)
            log.info(f"decode runs compiled kernels from {kernel_cache.kernel_dir()} ({len(decode.specs)} libraries)")
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
        missing = [spec for spec in self.specs if not kernel_cache.package_path(spec).is_file()]
        started = kernel_cache.start_build(missing, background=True) if missing else None
        if started is not None:
            log.warning(
                f"this machine has decoded {total:.0f} s eagerly with a model of this shape: building compiled "
                f"decode kernels in the background (pid {started.pid}, log {kernel_cache.build_log()}); later starts use them"
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
