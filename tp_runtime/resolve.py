"""What a launch derives from the model's files and this machine before any rank starts: the dtype,
the context length, the number of KV pages, and the executors' options.

Every rank computes the same answer from the same files, so plain torchrun (without the convenience
launcher) agrees with itself too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from protocol.frames import max_decode_steps
from tp_runtime.config import DEFAULT_SCHEDULER_STEPS, ConfigError, RuntimeConfig

if TYPE_CHECKING:
    from executor.model.config import ModelConfig


def read_model_config(config: RuntimeConfig) -> ModelConfig:
    """The model's shape from its files' metadata, without reading weights; a weight format that
    this model, dtype and device cannot run is refused here, before any rank starts."""
    import torch

    from executor.model import TORCH_DTYPES, resolve_weight_format
    from executor.model.load import open_source

    source = open_source(config.model)
    device = torch.device("cuda" if uses_cuda(config) else "cpu")
    # Each rank resolves `auto` again as it loads; it alone knows which of its slices int4 takes.
    resolve_weight_format(config.weight_format, TORCH_DTYPES[config.dtype], device, source)
    return source.config

def uses_cuda(config: RuntimeConfig) -> bool:
    import torch

    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())

def pick_dtype(config: RuntimeConfig) -> str:
    """`auto`: bf16 on GPUs; on the CPU whichever of bf16 and fp32 the start-up probe timed faster
    on this machine (executor/probe.py: measured once, kept, the reason logged)."""
    if config.dtype != "auto":
        return config.dtype
    if uses_cuda(config):
        return "bf16"
    from executor.probe import probe_cpu

    return probe_cpu().dtype

def resolve(config: RuntimeConfig) -> RuntimeConfig:
    """Fills in what derives from the model and the machine: the dtype, the context length, the
    number of KV pages, and the forwards per steady decode step the page size allows."""
    from executor.model.sharding import ShardingError, ShardPlan

    config = replace(config, dtype=pick_dtype(config))
    model = read_model_config(config)
    world = config.tensor_parallel_size
    try:
        plans = [ShardPlan.build(model, rank, world) for rank in range(world)]
    except ShardingError as exc:
        raise ConfigError(f"--tensor-parallel-size {world} cannot split {config.model}: {exc}") from None
    max_len = config.max_model_len or model.max_position_embeddings
    if max_len > model.max_position_embeddings:
        raise ConfigError(f"--max-model-len {max_len} exceeds the model's context of {model.max_position_embeddings} tokens")
    kv_bytes = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8-e4m3": 1}[config.resolved_kv_dtype]
    local_heads = max(p.local_kv_heads for p in plans)
    page_bytes = model.num_layers * 2 * config.page_size * local_heads * model.head_dim * kv_bytes
    pages = config.num_kv_pages or _kv_pool_bytes(config, model) // page_bytes
    if pages * config.page_size < max_len:
        raise ConfigError(
            f"the KV cache holds {pages} pages of {config.page_size} tokens, fewer than one sequence of "
            f"--max-model-len {max_len} needs; raise --kv-cache-memory or --num-kv-pages, or lower --max-model-len"
        )
    if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
        raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be at least 1")
    return replace(
        config, max_model_len=max_len, num_kv_pages=int(pages), num_host_pages=int(config.swap_space // page_bytes),
        num_scheduler_steps=config.num_scheduler_steps or min(DEFAULT_SCHEDULER_STEPS, max_decode_steps(config.page_size)),
    )

def _kv_pool_bytes(config: RuntimeConfig, model: ModelConfig) -> int:
    if not config.gpu_memory_utilization:
        return config.kv_cache_memory
    from tp_runtime.memory_budget import kv_cache_bytes

    return kv_cache_bytes(config, model, uses_cuda(config))

def executor_options(config: RuntimeConfig, use_cuda: bool):  # -> ExecutorOptions, imported late
    from executor.options import ExecutorOptions

    return ExecutorOptions(
        model=config.model,
        dtype=config.dtype,
        weight_format=config.weight_format,
        kv_cache_dtype=config.resolved_kv_dtype,
        kv_cache_scales=config.kv_cache_scales,
        num_kv_pages=config.num_kv_pages,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        num_host_pages=config.num_host_pages,
        device="cuda" if use_cuda else "cpu",
        cuda_graphs=not config.enforce_eager,
        pipelined_readback=config.pipelined_readback,
        debug_poison_cache=config.debug_poison_kv_cache,
        debug_poison_freed=config.debug_poison_freed_pages,
        debug_skip_clears=config.debug_skip_clears,
        deterministic=config.deterministic,
        seed=config.seed,
    )
