"""--gpu-memory-utilization, with vLLM's meaning: the share of a device's total memory that one rank
may use for everything (weights, activations, the KV pool), the pool getting what is left.

vLLM measures the weights and a profiling forward on the device; this runtime sizes the pool before
any rank starts (every rank must agree on it, and plain torchrun re-derives it on each), so both are
estimated from the model's shape: the rank's share of the weights in --dtype (the largest shard;
vocabulary-parallel embedding and head), and the activations of one step of --max-num-batched-tokens
(the residual stream, the attention and MLP intermediates, and the logits of --max-num-seqs rows in
fp32), doubled for the allocator's slack. On the CPU the memory is the host's, shared by the ranks on
the host: each gets fraction x total / ranks_per_node.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tp_runtime.config import ConfigError, RuntimeConfig

if TYPE_CHECKING:
    from executor.model.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Allocator slack and temporaries the estimate does not name (vLLM's profiling run sees them).
ACTIVATION_SLACK = 2
# What sampling holds per logit at its peak: the fp32 logits, their log-softmax and probabilities,
# and on a GPU a filtered draw's sort of whole rows (values and int64 ids) with its prefix sums and
# weights (executor/sampler.py `_draw_sorted`).
SAMPLING_BYTES_PER_LOGIT = 4 * 3 + (4 + 8) + 4 * 3


def weight_bytes_per_rank(model: ModelConfig, dtype: str, world: int) -> int:
    h, f, layers = model.hidden_size, model.intermediate_size, model.num_layers
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h
    embeddings = model.vocab_size * h * (1 if model.tie_embeddings else 2)
    # Heads and KV groups may split unevenly: the largest shard sets the need.
    return -(-(layers * per_layer + embeddings) // world) * DTYPE_BYTES[dtype] + h * DTYPE_BYTES[dtype]


def activation_bytes(model: ModelConfig, dtype: str, tokens: int, rows: int) -> int:
    h = model.hidden_size
    per_token = (4 * h + model.num_heads * model.head_dim * 3 + 2 * model.intermediate_size) * DTYPE_BYTES[dtype]
    logits = rows * model.vocab_size * SAMPLING_BYTES_PER_LOGIT
    return ACTIVATION_SLACK * (tokens * per_token + logits)


def device_memory_bytes(use_cuda: bool) -> int:
    """One device's total memory: the first GPU's, or this host's physical memory."""
    if use_cuda:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_cache_bytes(config: RuntimeConfig, model: ModelConfig, use_cuda: bool, total: int | None = None) -> int:
    """The KV pool per rank that --gpu-memory-utilization leaves; ConfigError when it leaves none."""
    fraction = config.gpu_memory_utilization
    if not 0 < fraction <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
    total = device_memory_bytes(use_cuda) if total is None else total
    share = total if use_cuda else total // config.ranks_per_node
    allowed = int(share * fraction)
    weights = weight_bytes_per_rank(model, config.dtype, config.tensor_parallel_size)
    activations = activation_bytes(model, config.dtype, config.max_num_batched_tokens, config.max_num_seqs)
    left = allowed - weights - activations
    where = "GPU" if use_cuda else f"host's memory (split among {config.ranks_per_node} ranks)"
    if left <= 0:
        raise ConfigError(
            f"--gpu-memory-utilization {fraction} allows {allowed >> 20} MiB of the {where} of {total >> 20} MiB per "
            f"rank, and the weights ({weights >> 20} MiB) and activations ({activations >> 20} MiB) need more: "
            "raise it, or size the pool with --kv-cache-memory"
        )
    return left
