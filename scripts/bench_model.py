"""Model step benchmark: decode step time by batch, 1024-token prefill, and the cost of clears.

Every decode step runs the executor's per-step path: StepInputs.from_prepare, clear_pages, then
the forward. The floor of a step is the bytes it must read (the weights, plus the KV it attends
over) at this machine's copy bandwidth, measured here with a large tensor copy. A mixed-format
step of few rows reads the int4 copies, a larger one the dense copies: its floor follows.

    python scripts/bench_model.py [--json] [--formats fp32,bf16,int4,mixed] [--steps 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.allocator import retain_freed_memory  # noqa: E402
from executor.cache import KVCache  # noqa: E402
from executor.inputs import StepInputs  # noqa: E402
from executor.model import LlamaModel, default_model_path, load_model  # noqa: E402
from protocol.frames import Prepare  # noqa: E402

# name -> (activation dtype, weight format)
FORMATS = {
    "fp32": (torch.float32, "dense"),
    "bf16": (torch.bfloat16, "dense"),
    "int4": (torch.bfloat16, "int4"),
    "mixed": (torch.bfloat16, "mixed"),
}
PAGE_SIZE = 16
CONTEXT = 128  # tokens already in each sequence's cache at every timed decode step


@dataclass
class DecodeResult:
    batch: int
    step_ms: float
    tokens_per_s: float
    bytes_per_step: int
    floor_ms: float
    fraction_of_floor: float


@dataclass
class FormatResult:
    weight_format: str
    weight_bytes: int
    decode: list[DecodeResult]
    prefill_tokens: int
    prefill_ms: float
    prefill_tokens_per_s: float
    prefill_floor_ms: float
    clear_on_ms: float
    clear_off_ms: float
    clear_cost_percent: float
    clear_alone_us: float  # the batch-32 step's clear_pages call timed alone
    batch32_over_batch1: float


def copy_bandwidth(megabytes: int = 512, repeats: int = 7, device: str = "cpu") -> float:
    """Bytes per second moved by a large tensor copy, counting the read and the write."""
    source = torch.ones(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    sync = torch.cuda.synchronize if source.is_cuda else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        target.copy_(source)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * source.numel() * 4 / statistics.median(times)


def weight_bytes(model: LlamaModel, rows: int, sampled: int) -> int:
    """Bytes a step of `rows` tokens, `sampled` of them sampled, reads from weights: every layer
    matrix and the LM head (not the embedding table: a step reads only its rows)."""
    total = model.lm_head.linear.bytes_read(sampled)
    for layer in model.layers:
        total += sum(linear.bytes_read(rows) for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
        total += sum(t.numel() * t.element_size() for t in (layer.attn_norm, layer.ffn_norm))
    return total


def make_prepare(
    tokens: list[list[int]], contexts: list[int], cleared: list[int], vocab: int
) -> Prepare:
    """One step: sequence i brings tokens[i] and then holds contexts[i] tokens in pages
    [i * pages_per_seq, ...)."""
    n = len(tokens)
    pages_per_seq = -(-max(contexts) // PAGE_SIZE)
    return Prepare.greedy(
        query_lens=[len(t) for t in tokens],
        context_lens=contexts,
        token_ids=[x % vocab for t in tokens for x in t],
        page_table_lens=[pages_per_seq] * n,
        page_table=np.arange(n * pages_per_seq),
        cleared_pages=sorted(cleared),
    )


def run_step(model: LlamaModel, cache: KVCache, prepare: Prepare) -> float:
    start = time.perf_counter()
    cache.clear_pages(prepare.cleared_pages)
    inputs = StepInputs.from_prepare(
        prepare, pad_page=cache.pad_page, page_size=cache.page_size, device=model.device
    )
    logits = model.forward(inputs, cache)
    if logits is not None:
        logits.argmax(dim=-1)
    return time.perf_counter() - start


def new_cache(model: LlamaModel, num_kv_pages: int) -> KVCache:
    cache = KVCache(
        num_kv_pages=num_kv_pages,
        page_size=PAGE_SIZE,
        num_layers=model.config.num_layers,
        num_kv_heads=model.shard.local_kv_heads,
        head_dim=model.config.head_dim,
        kv_dtype="bf16" if model.dtype == torch.bfloat16 else "fp32",
        device=model.device,
    )
    cache.clear_pages(np.arange(num_kv_pages, dtype=np.int32))
    return cache


def bench_format(path: str, name: str, steps: int, batches: list[int], bandwidth: float) -> FormatResult:
    dtype, weight_format = FORMATS[name]
    model = load_model(
        path, rank=0, world_size=1, dtype=dtype, device=torch.device("cpu"), weight_format=weight_format
    )
    vocab = model.config.vocab_size
    pages_per_seq = -(-(CONTEXT + 1) // PAGE_SIZE)
    spare = 8
    cache = new_cache(model, max(batches) * pages_per_seq + spare + 1024 // PAGE_SIZE + 1)
    spare_pages = list(range(cache.num_kv_pages - spare, cache.num_kv_pages))
    kv_bytes_per_token = cache.page_bytes // PAGE_SIZE

    decode, step_ms_by_batch = [], {}
    clear_on, clear_off = [], []
    for batch in batches:
        contexts = [CONTEXT + 1] * batch
        prepare = make_prepare([[7 + i] for i in range(batch)], contexts, [], vocab)
        # Steady decode lists about batch / page_size newly committed pages per step.
        cleared = spare_pages[: max(1, -(-batch // PAGE_SIZE))]
        with_clears = make_prepare([[7 + i] for i in range(batch)], contexts, cleared, vocab)
        for _ in range(2):
            run_step(model, cache, prepare)
        times = []
        for _ in range(steps):
            if batch == 32:
                # Interleaved A/B so that machine noise hits both sides alike.
                clear_on.append(run_step(model, cache, with_clears))
                clear_off.append(run_step(model, cache, prepare))
            times.append(run_step(model, cache, prepare))
        step = statistics.median(times)
        step_ms_by_batch[batch] = step * 1e3
        step_bytes = weight_bytes(model, batch, batch) + batch * (CONTEXT + 1) * kv_bytes_per_token
        floor = step_bytes / bandwidth
        decode.append(
            DecodeResult(batch, step * 1e3, batch / step, step_bytes, floor * 1e3, floor / step)
        )

    prompt = 1024
    prefill = make_prepare([list(range(100, 100 + prompt))], [prompt], [], vocab)
    run_step(model, cache, prefill)
    prefill_s = statistics.median(run_step(model, cache, prefill) for _ in range(max(3, steps // 5)))
    # The A/B difference drowns in step noise on a shared machine; the clear timed alone does not.
    clear_list = np.asarray(spare_pages[: max(1, -(-32 // PAGE_SIZE))], dtype=np.int32)
    clear_alone = []
    for _ in range(200):
        start = time.perf_counter()
        cache.clear_pages(clear_list)
        clear_alone.append(time.perf_counter() - start)
    on = statistics.median(clear_on) if clear_on else float("nan")
    off = statistics.median(clear_off) if clear_off else float("nan")
    return FormatResult(
        weight_format=name,
        weight_bytes=weight_bytes(model, 1, 1),
        decode=decode,
        prefill_tokens=prompt,
        prefill_ms=prefill_s * 1e3,
        prefill_tokens_per_s=prompt / prefill_s,
        prefill_floor_ms=(weight_bytes(model, prompt, 1) + prompt * kv_bytes_per_token) / bandwidth * 1e3,
        clear_on_ms=on * 1e3,
        clear_off_ms=off * 1e3,
        clear_cost_percent=(on / off - 1) * 100,
        clear_alone_us=statistics.median(clear_alone) * 1e6,
        batch32_over_batch1=(
            (32 / step_ms_by_batch[32]) / (1 / step_ms_by_batch[1])
            if 1 in step_ms_by_batch and 32 in step_ms_by_batch
            else float("nan")
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--formats", default="fp32,bf16,mixed",
        help="comma-separated: fp32, bf16 (dense weights), int4 (4-bit matrices, bf16 activations), mixed",
    )
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per batch size")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    retain_freed_memory()  # as the executor does
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    names = args.formats.split(",")
    unknown = sorted(set(names) - set(FORMATS))
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    path = args.model or default_model_path()
    results = [bench_format(path, name, args.steps, batches, bandwidth) for name in names]
    report = {
        "model": Path(path).name,
        "threads": torch.get_num_threads(),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "context_tokens": CONTEXT,
        "page_size": PAGE_SIZE,
        "formats": [asdict(r) for r in results],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['model']}: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), {report['threads']} threads")
    for r in results:
        print(f"\n{r.weight_format}: {r.weight_bytes / 1e6:.0f} MB of weights read by a batch-1 step")
        for d in r.decode:
            print(
                f"  decode batch {d.batch:3d}: {d.step_ms:8.2f} ms/step {d.tokens_per_s:8.1f} tok/s  "
                f"floor {d.floor_ms:6.2f} ms ({d.fraction_of_floor:.0%} of floor speed)"
            )
        print(
            f"  prefill {r.prefill_tokens} tokens: {r.prefill_ms:.0f} ms, "
            f"{r.prefill_tokens_per_s:.0f} tok/s (weight floor {r.prefill_floor_ms:.1f} ms)"
        )
        print(f"  batch-32 aggregate / batch-1: {r.batch32_over_batch1:.1f}x")
        print(
            f"  clears at batch 32: on {r.clear_on_ms:.2f} ms, off {r.clear_off_ms:.2f} ms "
            f"({r.clear_cost_percent:+.2f}%); the clear alone {r.clear_alone_us:.1f} us "
            f"({r.clear_alone_us / 1e3 / r.clear_off_ms:.3%} of the step)"
        )


if __name__ == "__main__":
    main()
