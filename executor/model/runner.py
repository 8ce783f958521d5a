"""The one place that picks how a step runs: a CUDA graph, the compiled layers, or eagerly.

By the step's shape and the machine: on CUDA, a decode step that fits a captured graph replays it
(executor/cuda_graphs.py); on the CPU, a step the compiled layers cover (a decode step, or decodes
beside one prefill chunk; executor/model/compiled.py) runs them; everything else, and the step that
calibrates an fp8 cache's scales (its K and V must pass through KVCache.observe), and every step
of the deterministic mode (docs/invariance.md), runs the eager layer loop. `last_runner` says which
served the last step, so that tests can tell a silent fall-back to eager from the runner they
meant to exercise.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from executor.cache import KVCache
from executor.inputs import StepInputs
from executor.model.compiled import CompiledLayers
from executor.model.llama import LlamaModel

if TYPE_CHECKING:
    from executor.cuda_graphs import DecodeGraphRunner

RUNNERS = ("eager", "compiled", "cuda_graph")


class ModelRunner:
    """A LlamaModel as the executor's step loop runs it (executor.steps.StepModel)."""

    def __init__(self, model: LlamaModel, *, graphs: DecodeGraphRunner | None = None) -> None:
        self.model = model
        self.fingerprint = model.fingerprint
        self.config = model.config
        self.shard = model.shard
        self.graphs = graphs
        self.last_runner: str | None = None
        self._compiled: dict[tuple, CompiledLayers | None] = {}

    def compiled(self, cache: KVCache) -> CompiledLayers | None:
        """The compiled layers over this cache's geometry, attached on first use (the libraries
        depend on the page size, the storage dtype and the layer count)."""
        geometry = (cache.page_size, cache.storage_dtype, cache.num_layers)
        if geometry not in self._compiled:
            model = self.model
            self._compiled[geometry] = CompiledLayers.attach(
                model.layers, model.shapes, model.shard.world_size, cache, model.compile_mode
            )
        return self._compiled[geometry]

    def pick(self, inputs: StepInputs, cache: KVCache) -> str:
        """Which runner serves this step."""
        if cache.calibrating or self.model.deterministic:
            # The deterministic mode runs one code path for every step: a token decoded by a
            # compiled layer and recomputed after a preemption by the eager one would differ.
            return "eager"
        if self.graphs is not None and self.graphs.graph_for(inputs) is not None:
            return "cuda_graph"
        compiled = self.compiled(cache)
        if compiled is not None and compiled.covers(inputs):
            return "compiled"
        return "eager"

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor | None:
        """Float32 logits [m, vocab] of the sampled rows on rank 0; None on the other ranks."""
        runner = self.last_runner = self.pick(inputs, cache)
        if runner == "cuda_graph":
            return self.graphs.forward(inputs, cache)
        model = self.model
        x = model.embed(inputs.token_ids)
        step = model.step_tensors(inputs, cache)
        if runner == "compiled":
            x = self.compiled(cache).run(x, step, inputs, cache)
        else:
            begin = time.perf_counter()
            x = model.eager_layers(x, step, inputs, cache)
            compiled = None if cache.calibrating or model.deterministic else self.compiled(cache)
            if compiled is not None and compiled.would_cover(inputs):
                compiled.eager_ran(time.perf_counter() - begin)
        return model.logits(x, inputs)

    def __getattr__(self, name: str) -> Any:
        # Everything else (dtype, device, layers, ...) is the model's.
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)
