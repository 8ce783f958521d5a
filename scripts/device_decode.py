"""Decode on one CUDA GPU: a Llama-3-8B-shaped model with random bf16 weights, eager against CUDA
graphs (executor.cuda_graphs.DecodeGraphRunner with the runtime's graph sizes), at batch 1, 8 and 64
with CONTEXT tokens of context each. One JSON line per batch size: ms per step and tokens/s, eager
and graphed; greedy agreement of the graph with eager (argmax of every row, same model, same cache);
the fraction of the HBM roofline reached (the bytes a step must read, weights plus the KV it attends
over, per step time, over the bandwidth of a large device copy measured here). Then clears' cost:
clear_pages of the pages a step typically lists, as a fraction of a step. Exits non-zero when the
graph's argmax disagrees with eager's, when a batch-1 graph step reaches less than
MIN_BATCH1_HBM_FRACTION of the bandwidth (at batch 1 a step reads the weights once: memory bound),
or when clears cost more than MAX_CLEAR_FRACTION of a step.

Random weights are enough: decode speed depends on shapes, not values. About 16 GiB of weights and
8 GiB of cache. `--shape tiny --device cpu` runs the same code on a small model, with the graph
runner's padding run eagerly (no capture on a CPU; DecodeGraphRunner(capture=False)): what a replay
would read, compared with the plain forward, so the comparison can fail there too (the tests do).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
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
from scripts.device_models import LLAMA3_8B  # noqa: E402
from executor.model.layers import Linear  # noqa: E402
from executor.model.llama import LayerWeights, LlamaModel  # noqa: E402
from executor.model.sharding import ShardPlan  # noqa: E402
from executor.options import ExecutorOptions  # noqa: E402
from executor.sampler import sample  # noqa: E402
from protocol.frames import CacheGeometry, Prepare  # noqa: E402

SHAPES = {
    "llama3-8b": LLAMA3_8B,
    "tiny": replace(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
}
BATCHES = (1, 8, 64)
# The runtime's own graph sizes: a batch between two of them is padded up, as a server's is.
GRAPH_SIZES = next(f.default for f in fields(ExecutorOptions) if f.name == "cuda_graph_batch_sizes")
CONTEXT = 512
MAX_CONTEXT = 1024
PAGE_SIZE = 16
# Set from the first GPU run (2026-12-04, H200: 0.455 at batch 1, 7.9 ms a step), a margin under
# it: the floor catches a step that gets slower; the gap to the roofline is docs/device.md's to close.
MIN_BATCH1_HBM_FRACTION = 0.4
TOP_KERNELS = 8
# Pages a step lists to clear: a decode of 64 crosses into a new page for one sequence in 16 each
# step (4 pages), a 512-token prefill takes 32; each page its own run, the worst case for memsets.
CLEAR_PAGES = (1, 4, 32)
MAX_CLEAR_FRACTION = 0.02  # of the batch-64 step, for the 4 pages a batch-64 decode step lists


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


def decode_prepare(batch: int, vocab: int, context: int = CONTEXT) -> Prepare:
    pages_per_seq = -(-context // PAGE_SIZE)
    return Prepare.greedy_decode(
        context_lens=np.full(batch, context),
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


def clear_failures(fraction: float | None) -> list[str]:
    if fraction is not None and not fraction <= MAX_CLEAR_FRACTION:
        return [f"clearing {CLEAR_PAGES[1]} pages costs {fraction:.1%} of a batch-64 step, over {MAX_CLEAR_FRACTION:.0%}"]
    return []


def clears_cost(cache: KVCache, device: torch.device, step_ms_by_batch: dict[int, float]) -> dict[str, object]:
    """clear_pages of CLEAR_PAGES scattered pages (every page its own run), against the steps."""
    cost: dict[str, object] = {"page_bytes": cache.page_bytes}
    for count in CLEAR_PAGES:
        pages = np.arange(0, 2 * count, 2, dtype=np.int32)
        cost[f"clear_{count}_pages_us"] = round(step_ms(lambda: cache.clear_pages(pages), device) * 1e3, 1)
    largest = max(step_ms_by_batch)
    if largest in step_ms_by_batch:
        cost["fraction_of_step"] = {
            f"{count}_pages_batch_{batch}": round(cost[f"clear_{count}_pages_us"] / 1e3 / ms, 5)
            for batch, ms in step_ms_by_batch.items()
            for count in CLEAR_PAGES
        }
    return cost


def kernel_profile(fn, device: torch.device) -> dict[str, object]:  # noqa: ANN001
    """Where one eager step's time goes, by kernel (on the CPU: by operator): the TOP_KERNELS
    largest by their own time, in us, and the total. The graph replays the same kernels, so this
    says which of them keep a step off the HBM roofline."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [(e.key, getattr(e, field), e.count) for e in prof.key_averages() if getattr(e, field) > 0]
    events.sort(key=lambda e: -e[1])
    return {
        "total_us": round(sum(e[1] for e in events), 1),
        "top": [{"name": name[:80], "us": round(us, 1), "calls": count} for name, us, count in events[:TOP_KERNELS]],
    }


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
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens of context per sequence")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device visible to torch"}))
        return 2
    config, batches, context = SHAPES[args.shape], tuple(args.batches), args.context
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    graphs = device.type == "cuda"
    if graphs:
        torch.cuda.set_device(device)
    started = time.perf_counter()
    model = random_model(config, device)
    num_kv_pages = max(batches) * -(-context // PAGE_SIZE) + 64
    cache = KVCache(
        num_kv_pages=num_kv_pages, page_size=PAGE_SIZE, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, kv_dtype="bf16", device=device,
    )
    cache.clear_pages(np.arange(num_kv_pages, dtype=np.int32))
    geometry = CacheGeometry(
        num_kv_pages=num_kv_pages, page_size=PAGE_SIZE, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, kv_dtype="bf16", vocab_size=config.vocab_size, max_model_len=MAX_CONTEXT,
        max_num_seqs=min(size for size in GRAPH_SIZES if size >= max(batches)), max_num_batched_tokens=4096,
    )
    build_s = time.perf_counter() - started
    bandwidth = copy_bandwidth(megabytes=2048 if graphs else 64, device=device.type)
    kv_bytes_per_token = cache.page_bytes // PAGE_SIZE
    started = time.perf_counter()
    from executor.cuda_graphs import DecodeGraphRunner

    runner = DecodeGraphRunner(model, cache, geometry=geometry, batch_sizes=GRAPH_SIZES, capture=graphs)
    capture_s = time.perf_counter() - started
    failures: list[str] = []
    graph_step_ms: dict[int, float] = {}
    for batch in batches:
        inputs = StepInputs.from_prepare(
            decode_prepare(batch, config.vocab_size, context), pad_page=cache.pad_page, page_size=PAGE_SIZE, device=device
        )
        snapshot = cache.data.clone()  # both forwards write this step's K/V into the same slots
        eager_logits = model.forward(inputs, cache).clone()
        cache.data.copy_(snapshot)
        del snapshot
        graph_logits = runner.forward(inputs, cache).clone()
        agree = float((eager_logits.argmax(-1) == graph_logits.argmax(-1)).float().mean())
        max_diff = float((eager_logits - graph_logits).abs().max())
        eager = step_ms(lambda: model.forward(inputs, cache), device)
        graphed = step_ms(lambda: runner.forward(inputs, cache), device)
        graph_step_ms[batch] = graphed
        params = inputs.sampling
        sampling = step_ms(lambda: sample(graph_logits, params), device)
        step_bytes = weight_bytes(model, rows=batch, sampled=batch) + batch * context * kv_bytes_per_token
        graph_fraction = hbm_fraction(step_bytes, graphed, bandwidth) if graphs else None
        batch_failures = decode_failures(batch, agree, max_diff, graph_fraction)
        failures += batch_failures
        row = {
            "section": "decode", "batch": batch, "context": context, "eager_ms": round(eager, 3),
            "eager_tok_s": round(batch * 1e3 / eager, 1), "sample_ms": round(sampling, 3), "bytes_per_step": step_bytes,
            "eager_hbm_fraction": round(hbm_fraction(step_bytes, eager, bandwidth), 3),
            "argmax_agreement": agree, "max_abs_logit_diff": max_diff, "ok": not batch_failures,
        }
        used = runner.graph_for(inputs)
        row.update(
            graph=list(used.batch.inputs.page_table.shape) if used else None, graph_captured=graphs,
            graph_ms=round(graphed, 3), graph_tok_s=round(batch * 1e3 / graphed, 1), graph_speedup=round(eager / graphed, 2),
        )
        if graph_fraction is not None:
            row["graph_hbm_fraction"] = round(graph_fraction, 3)
        print(json.dumps(row), flush=True)
        kernels = kernel_profile(lambda: model.forward(inputs, cache), device)
        print(json.dumps({"section": "decode_kernels", "batch": batch, **kernels}), flush=True)
    cost = clears_cost(cache, device, graph_step_ms)
    largest = max(batches)
    typical = cost.get("fraction_of_step", {}).get(f"{CLEAR_PAGES[1]}_pages_batch_{largest}") if largest >= 64 else None
    clear_problems = clear_failures(typical if graphs else None)
    failures += clear_problems
    print(json.dumps({"section": "clears_cost", **cost, "ok": not clear_problems}), flush=True)
    summary = {
        "section": "decode_summary", "shape": args.shape, "device": str(device), "build_s": round(build_s, 1),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "capture_s": round(capture_s, 1),
        "graphs": len(runner.graphs), "failures": failures, "ok": not failures,
    }
    if graphs:
        summary["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(summary), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
