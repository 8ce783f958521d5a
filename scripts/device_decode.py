"""Decode benchmark on one CUDA GPU: a Llama-3-8B-shaped model with random bf16 weights, eager
against CUDA graphs (executor.cuda_graphs.DecodeGraphRunner), at batch 1, 16 and 64 with 512 tokens
of context each. Prints one JSON line per batch size (tokens/s, and the fraction of HBM bandwidth
reached: the bytes a step must read, weights plus the KV it attends over, per step time, over the
bandwidth of a large device copy measured here) and a summary. Exits non-zero when the graph's
logits disagree with the eager forward's, or when a batch-1 graph step reaches less than
MIN_BATCH1_HBM_FRACTION of that bandwidth (at batch 1 a step reads the weights once: memory bound).

Random weights are enough here: decode speed depends on shapes, not values. Run by
scripts/device_check.sh; about 16 GiB of weights and 8 GiB of cache. `--shape tiny --device cpu`
runs the same code eagerly on a small model (no graphs, no timing floor), as the tests do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

from scripts.bench_model import copy_bandwidth, weight_bytes  # noqa: E402
from executor.cache import KVCache  # noqa: E402
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
SHAPES = {
    "llama3-8b": LLAMA3_8B,
    "tiny": replace(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
}
BATCHES = (1, 16, 64)
CONTEXT = 512
MAX_CONTEXT = 1024
PAGE_SIZE = 16
MIN_BATCH1_HBM_FRACTION = 0.5


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> LlamaModel:
    shard = ShardPlan.build(config, 0, 1)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype) * 0.02

    c = config
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
        fingerprint=f"random-{c.num_layers}x{c.hidden_size}",
        device=device,
    )


def decode_prepare(batch: int, vocab: int) -> Prepare:
    pages_per_seq = CONTEXT // PAGE_SIZE
    return Prepare.greedy_decode(
        context_lens=np.full(batch, CONTEXT),
        token_ids=np.arange(100, 100 + batch) % vocab,
        page_table_lens=np.full(batch, pages_per_seq),
        page_table=np.arange(batch * pages_per_seq),
    )


def hbm_fraction(step_bytes: int, step_ms: float, bandwidth_bytes_s: float) -> float:
    """The share of the device's copy bandwidth a step reached, reading step_bytes in step_ms."""
    return step_bytes / (step_ms / 1e3) / bandwidth_bytes_s


def decode_failures(batch: int, agree: float, max_diff: float, graph_fraction: float | None) -> list[str]:
    """What fails a batch: graph logits that disagree with eager, or a slow batch-1 graph step
    (graph_fraction None: no graphs, no timing floor)."""
    failures = []
    if agree < 1.0 or not np.isfinite(max_diff):
        failures.append(f"batch {batch}: graph argmax agrees on {agree:.0%}, max |diff| {max_diff}")
    if batch == 1 and graph_fraction is not None and not graph_fraction >= MIN_BATCH1_HBM_FRACTION:
        failures.append(
            f"batch 1: a graph step reaches {graph_fraction:.0%} of HBM bandwidth, under {MIN_BATCH1_HBM_FRACTION:.0%}"
        )
    return failures


def step_ms(fn, device: torch.device, repeats: int = 20) -> float:  # noqa: ANN001
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - started) * 1e3 / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TP=1 decode speed and HBM fraction, eager and CUDA graphs")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device visible to torch"}))
        return 2
    config, batches = SHAPES[args.shape], tuple(args.batches)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    graphs = device.type == "cuda"
    if graphs:
        torch.cuda.set_device(device)
    started = time.perf_counter()
    model = random_model(config, device)
    num_kv_pages = max(batches) * (CONTEXT // PAGE_SIZE) + 64
    cache = KVCache(
        num_kv_pages=num_kv_pages, page_size=PAGE_SIZE, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, kv_dtype="bf16", device=device,
    )
    cache.clear_pages(np.arange(num_kv_pages, dtype=np.int32))
    geometry = CacheGeometry(
        num_kv_pages=num_kv_pages, page_size=PAGE_SIZE, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, kv_dtype="bf16", vocab_size=config.vocab_size, max_model_len=MAX_CONTEXT,
        max_num_seqs=max(batches), max_num_batched_tokens=4096,
    )
    build_s = time.perf_counter() - started
    bandwidth = copy_bandwidth(megabytes=2048 if graphs else 64, device=device.type)
    kv_bytes_per_token = cache.page_bytes // PAGE_SIZE
    runner = None
    started = time.perf_counter()
    if graphs:
        from executor.cuda_graphs import DecodeGraphRunner

        runner = DecodeGraphRunner(model, cache, geometry=geometry, batch_sizes=batches)
    capture_s = time.perf_counter() - started
    failures: list[str] = []
    for batch in batches:
        inputs = StepInputs.from_prepare(
            decode_prepare(batch, config.vocab_size), pad_page=cache.pad_page, page_size=PAGE_SIZE, device=device
        )
        eager_logits = model.forward(inputs, cache).clone()
        stepper = runner if runner is not None else model
        graph_logits = stepper.forward(inputs, cache).clone()
        agree = float((eager_logits.argmax(-1) == graph_logits.argmax(-1)).float().mean())
        max_diff = float((eager_logits - graph_logits).abs().max())
        eager = step_ms(lambda: model.forward(inputs, cache), device)
        graphed = step_ms(lambda: stepper.forward(inputs, cache), device) if runner is not None else None
        params = SamplingBatch(inputs.temperature, inputs.top_p, inputs.top_k, inputs.seeds, inputs.sample_positions)
        sampling = step_ms(lambda: sample(graph_logits, params), device)
        step_bytes = weight_bytes(model, rows=batch, sampled=batch) + batch * CONTEXT * kv_bytes_per_token
        graph_fraction = hbm_fraction(step_bytes, graphed, bandwidth) if graphed is not None else None
        batch_failures = decode_failures(batch, agree, max_diff, graph_fraction)
        failures += batch_failures
        row = {
            "section": "decode", "batch": batch, "context": CONTEXT, "eager_ms": round(eager, 3),
            "eager_tok_s": round(batch * 1e3 / eager, 1), "sample_ms": round(sampling, 3), "bytes_per_step": step_bytes,
            "eager_hbm_fraction": round(hbm_fraction(step_bytes, eager, bandwidth), 3),
            "argmax_agreement": agree, "max_abs_logit_diff": max_diff, "ok": not batch_failures,
        }
        if runner is not None and graphed is not None:
            used = runner.graph_for(inputs)
            row.update(
                graph=list(used.batch.inputs.page_table.shape) if used else None, graph_ms=round(graphed, 3),
                graph_tok_s=round(batch * 1e3 / graphed, 1), graph_speedup=round(eager / graphed, 2),
                graph_hbm_fraction=round(graph_fraction, 3),
            )
        print(json.dumps(row), flush=True)
    summary = {
        "section": "decode_summary", "shape": args.shape, "device": str(device), "build_s": round(build_s, 1),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "capture_s": round(capture_s, 1),
        "graphs": len(runner.graphs) if runner is not None else 0, "failures": failures, "ok": not failures,
    }
    if graphs:
        summary["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(summary), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
