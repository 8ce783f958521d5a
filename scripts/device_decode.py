"""Decode benchmark on one CUDA GPU: a Llama-3-8B-shaped model with random bf16 weights, eager
against CUDA graphs (executor.cuda_graphs.DecodeGraphRunner), at batch 1, 16 and 64 with 512
tokens of context each. Prints one JSON line per batch size (tokens/s, and the fraction of HBM
bandwidth reached: the bytes a step must read, weights plus the KV it attends over, per step time,
over the bandwidth of a large device copy measured here) and a summary; exits non-zero when the
graph's logits disagree with the eager forward's.

Random weights are enough here: decode speed depends on shapes, not values. Run by
scripts/device_check.sh; about 16 GiB of weights and 8 GiB of cache.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_model import copy_bandwidth, weight_bytes  # noqa: E402
from executor.cache import KVCache  # noqa: E402
from executor.cuda_graphs import DecodeGraphRunner  # noqa: E402
from executor.inputs import StepInputs  # noqa: E402
from executor.model.config import ModelConfig  # noqa: E402
from executor.model.layers import Linear  # noqa: E402
from executor.model.llama import LayerWeights, LlamaModel  # noqa: E402
from executor.model.sharding import ShardPlan  # noqa: E402
from executor.sampler import SamplingBatch, sample  # noqa: E402
from protocol.frames import CacheGeometry, Prepare  # noqa: E402

LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rope_scaling=None,
    rms_eps=1e-5,
    tie_embeddings=False,
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_ids=(128001, 128009),
)
BATCHES = (1, 16, 64)
CONTEXT = 512
MAX_CONTEXT = 1024
PAGE_SIZE = 16


def random_model(device: torch.device) -> LlamaModel:
    c = LLAMA3_8B
    shard = ShardPlan.build(c, 0, 1)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02

    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layers = [
        LayerWeights(
            attn_norm=torch.ones(c.hidden_size, device=device),
            qkv=Linear(w(qkv_rows, c.hidden_size)),
            o=Linear(w(c.hidden_size, c.num_heads * c.head_dim)),
            ffn_norm=torch.ones(c.hidden_size, device=device),
            gate_up=Linear(w(2 * c.intermediate_size, c.hidden_size)),
            down=Linear(w(c.hidden_size, c.intermediate_size)),
        )
        for _ in range(c.num_layers)
    ]
    return LlamaModel(
        c,
        shard,
        embed=w(c.vocab_size, c.hidden_size),
        lm_head=w(c.vocab_size, c.hidden_size),
        final_norm=torch.ones(c.hidden_size, device=device),
        layers=layers,
        fingerprint="random-llama3-8b",
        device=device,
    )


def decode_prepare(batch: int) -> Prepare:
    pages_per_seq = CONTEXT // PAGE_SIZE
    return Prepare.greedy_decode(
        context_lens=np.full(batch, CONTEXT),
        token_ids=np.arange(100, 100 + batch),
        page_table_lens=np.full(batch, pages_per_seq),
        page_table=np.arange(batch * pages_per_seq),
    )


def step_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / repeats


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device visible to torch"}))
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    started = time.perf_counter()
    model = random_model(device)
    num_kv_pages = max(BATCHES) * (CONTEXT // PAGE_SIZE) + 64
    cache = KVCache(
        num_kv_pages=num_kv_pages,
        page_size=PAGE_SIZE,
        num_layers=LLAMA3_8B.num_layers,
        num_kv_heads=LLAMA3_8B.num_kv_heads,
        head_dim=LLAMA3_8B.head_dim,
        kv_dtype="bf16",
        device=device,
    )
    cache.clear_pages(np.arange(num_kv_pages, dtype=np.int32))
    geometry = CacheGeometry(
        num_kv_pages=num_kv_pages,
        page_size=PAGE_SIZE,
        num_layers=LLAMA3_8B.num_layers,
        num_kv_heads=LLAMA3_8B.num_kv_heads,
        head_dim=LLAMA3_8B.head_dim,
        kv_dtype="bf16",
        vocab_size=LLAMA3_8B.vocab_size,
        max_model_len=MAX_CONTEXT,
        max_num_seqs=max(BATCHES),
        max_num_batched_tokens=4096,
    )
    build_s = time.perf_counter() - started
    bandwidth = copy_bandwidth(megabytes=2048, device="cuda")
    weights = weight_bytes(model)
    kv_bytes_per_token = cache.page_bytes // PAGE_SIZE
    started = time.perf_counter()
    runner = DecodeGraphRunner(model, cache, geometry=geometry, batch_sizes=BATCHES)
    capture_s = time.perf_counter() - started
    failures = []
    for batch in BATCHES:
        inputs = StepInputs.from_prepare(decode_prepare(batch), pad_page=cache.pad_page, page_size=PAGE_SIZE, device=device)
        eager_logits = model.forward(inputs, cache).clone()
        graph_logits = runner.forward(inputs, cache).clone()
        agree = float((eager_logits.argmax(-1) == graph_logits.argmax(-1)).float().mean())
        max_diff = float((eager_logits - graph_logits).abs().max())
        eager = step_ms(lambda: model.forward(inputs, cache))
        graphed = step_ms(lambda: runner.forward(inputs, cache))
        params = SamplingBatch(inputs.temperature, inputs.top_p, inputs.top_k, inputs.seeds, inputs.sample_positions)
        sampling = step_ms(lambda: sample(graph_logits, params))
        step_bytes = weights + batch * CONTEXT * kv_bytes_per_token
        if agree < 1.0 or not np.isfinite(max_diff):
            failures.append(f"batch {batch}: graph argmax agrees on {agree:.0%}, max |diff| {max_diff}")
        print(
            json.dumps(
                {
                    "section": "decode",
                    "batch": batch,
                    "context": CONTEXT,
                    "graph": list(runner.graph_for(inputs).batch.inputs.page_table.shape),
                    "eager_ms": round(eager, 3),
                    "graph_ms": round(graphed, 3),
                    "sample_ms": round(sampling, 3),
                    "eager_tok_s": round(batch * 1e3 / eager, 1),
                    "graph_tok_s": round(batch * 1e3 / graphed, 1),
                    "graph_speedup": round(eager / graphed, 2),
                    "bytes_per_step": step_bytes,
                    "eager_hbm_fraction": round(step_bytes / (eager / 1e3) / bandwidth, 3),
                    "graph_hbm_fraction": round(step_bytes / (graphed / 1e3) / bandwidth, 3),
                    "argmax_agreement": agree,
                    "max_abs_logit_diff": max_diff,
                }
            ),
            flush=True,
        )
    print(
        json.dumps(
            {
                "section": "decode_summary",
                "build_s": round(build_s, 1),
                "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                "weight_bytes": weights,
                "capture_s": round(capture_s, 1),
                "graphs": len(runner.graphs),
                "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
                "failures": failures,
                "ok": not failures,
            }
        )
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
