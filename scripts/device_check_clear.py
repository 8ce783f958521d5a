"""GPU check of clear_pages, its stream ordering, its bandwidth, and the decode graph runner.

Run by scripts/device_check.sh on one CUDA GPU; prints one JSON object per section and exits
non-zero if any check fails. Sections:
1. clear_pages with cuda-python, every KV dtype: NaN-poisoned listed pages zeroed in every plane,
   every other page (poisoned neighbours, live rows, the pad page) byte-identical.
2. Stream order, with the real model and the real graph runner: on a non-default model stream,
   poison a page -> clear_pages -> a decode step of a one-token sequence on that page, eager and
   replayed from the runner's CUDA graph, ITERATIONS times with no host sync in between. The step
   writes slot 0 and attention reads the page whole, masking slots 1.. (0 x NaN = NaN), so every
   step's logits must equal those of a pristine cache. Control: without the clear every step's
   logits must be NaN, or the check proves nothing.
3. Bandwidth: memset of one long run and of single pages (cuMemsetD8Async) against a
   device-to-device copy, on a Llama-3-8B-shaped bf16 page (2 MiB). A memset writes once where a
   copy reads and writes, so one long run must reach at least half the copy's read+write rate.
4. Pinned offload: pages copied to the pinned host buffer, cleared, and copied back, all queued on
   one stream without a host sync, come back byte-identical.
5. DecodeGraphRunner on the real (tiny) Llama: replayed for padded batch sizes, the greedy choice
   of every row equals the eager forward's, and the pad page stays zero.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

from scripts.device_decode import SHAPES, random_model  # noqa: E402
from executor.cache import KVCache, page_runs  # noqa: E402
from scripts.device_report import Checks, report  # noqa: E402
from executor.cuda_graphs import DecodeGraphRunner  # noqa: E402
from executor.cuda_memset import memset_runs  # noqa: E402
from executor.inputs import StepInputs  # noqa: E402
from protocol.frames import CacheGeometry, KVDtype, Prepare  # noqa: E402

CHECKS = Checks()
FAILURES, check = CHECKS.failures, CHECKS.check
# `--device cpu` runs the sections that need no CUDA (the CPU fill stands in for the memsets), so
# that this script's use of the runtime's API is tested where there is no GPU.
DEVICE = torch.device("cuda")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def make_cache(
    kv_dtype: str, num_kv_pages: int, layers: int, heads: int, head_dim: int, page_size: int = 16, num_host_pages: int = 0
) -> KVCache:
    return KVCache(
        num_kv_pages=num_kv_pages,
        page_size=page_size,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        device=DEVICE,
        num_host_pages=num_host_pages,
        poison=True,
    )


def check_clear_pages() -> None:
    for kv_dtype in [d.value for d in KVDtype]:
        cache = make_cache(kv_dtype, num_kv_pages=64, layers=4, heads=2, head_dim=64)
        live = torch.randn(cache.data[:32].shape, device=DEVICE).clamp(-4, 4)
        cache.data[:32] = live.to(cache.storage_dtype)
        poisoned = np.array([3, 4, 5, 9, 20, 40, 41, 42, 50], dtype=np.int32)
        cache.poison_pages(poisoned)
        nan_before = bool(torch.isnan(cache.data[poisoned].float()).all())
        listed = np.array([3, 4, 5, 9, 40, 41, 42, 43, 44], dtype=np.int32)  # 20 and 50 stay poisoned
        before = cache.data.view(torch.uint8).clone()
        sync()
        cache.clear_pages(listed)
        sync()
        after = cache.data.view(torch.uint8)
        others = np.setdiff1d(np.arange(cache.num_kv_pages + 1), listed)
        ok = all(
            [
                check(nan_before, f"{kv_dtype}: 0xFF pages read as NaN before the clear"),
                check(bool((after[listed] == 0).all()), f"{kv_dtype}: listed pages zero in every plane"),
                check(torch.equal(after[others], before[others]), f"{kv_dtype}: other pages byte-identical"),
                check(bool(torch.isnan(cache.data[[20, 50]].float()).all()), f"{kv_dtype}: unlisted poison kept"),
                check(bool((after[cache.pad_page] == 0).all()), f"{kv_dtype}: pad page zero"),
            ]
        )
        report("clear_pages", kv_dtype=kv_dtype, runs=len(page_runs(listed)), ok=ok)


ITERATIONS = 50


def tiny_model_and_cache():  # noqa: ANN201
    """device_decode's tiny Llama (random bf16) and a poisoned bf16 cache for it, on DEVICE."""
    config = SHAPES["tiny"]
    model = random_model(config, DEVICE)
    cache = make_cache("bf16", num_kv_pages=64, layers=config.num_layers, heads=config.num_kv_heads, head_dim=config.head_dim)
    return model, cache


def tiny_geometry(cache: KVCache, vocab: int) -> CacheGeometry:
    return CacheGeometry(
        num_kv_pages=cache.num_kv_pages, page_size=cache.page_size, num_layers=cache.num_layers, num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim, kv_dtype="bf16", vocab_size=vocab, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
    )  # fmt: skip


def one_token_step(page: int, token: int) -> Prepare:
    return Prepare.greedy_decode(
        context_lens=np.array([1]), token_ids=np.array([token]), page_table_lens=np.array([1]), page_table=np.array([page])
    )


def check_stream_order() -> None:
    """The clear, queued on the model stream, lands before the forward that reads the page, eager
    and through a CUDA graph replay, with no host sync between them."""
    model, cache = tiny_model_and_cache()
    page = 17
    runner = DecodeGraphRunner(model, cache, geometry=tiny_geometry(cache, model.config.vocab_size), batch_sizes=(1,))
    inputs = StepInputs.from_prepare(one_token_step(page, 42), pad_page=cache.pad_page, page_size=cache.page_size, device=DEVICE)
    model_stream = torch.cuda.Stream()
    for name, step in (("eager", model), ("graph", runner)):
        cache.clear_pages(np.array([page], dtype=np.int32))
        sync()
        reference = step.forward(inputs, cache).clone()  # a pristine page
        sync()

        def run(clear: bool) -> list[torch.Tensor]:
            results = []
            with torch.cuda.stream(model_stream):
                for _ in range(ITERATIONS):
                    cache.poison_pages(np.array([page], dtype=np.int32))  # the page's stale bytes
                    if clear:
                        cache.clear_pages(np.array([page], dtype=np.int32))
                    results.append(step.forward(inputs, cache).clone())
            model_stream.synchronize()
            return results

        cleared, control = run(clear=True), run(clear=False)
        exact = sum(bool(torch.equal(r, reference)) for r in cleared)
        poisoned = sum(bool(torch.isnan(r).all()) for r in control)
        ok = check(exact == ITERATIONS, f"{name}: {ITERATIONS - exact} of {ITERATIONS} steps after clear_pages differ from a pristine page's")
        ok = check(poisoned == ITERATIONS, f"{name} control: {ITERATIONS - poisoned} steps without the clear did not see NaN") and ok
        report("stream_order", forward=name, iterations=ITERATIONS, equal_after_clear=exact, nan_without_clear=poisoned, ok=ok)


def cuda_time_us(fn, repeats: int = 20) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / repeats


def check_bandwidth() -> None:
    # Llama-3-8B at TP=1: 32 layers x K,V x 16 slots x 8 KV heads x 128 x bf16 = 2 MiB a page.
    cache = make_cache("bf16", num_kv_pages=1024, layers=32, heads=8, head_dim=128)
    page_bytes = cache.page_bytes
    one_run = [(0, 512)]
    singles = [(p, p + 1) for p in range(0, 1024, 2)]
    memset_run_us = cuda_time_us(lambda: memset_runs(cache.data, one_run, 0))
    memset_single_us = cuda_time_us(lambda: memset_runs(cache.data, singles, 0))
    clear_single_us = cuda_time_us(lambda: cache.clear_pages(np.arange(0, 1024, 2, dtype=np.int32)))
    src = cache.data[:512]
    dst = cache.data[512:1024]
    copy_us = cuda_time_us(lambda: dst.copy_(src))
    nbytes = 512 * page_bytes
    memset_gb_s = nbytes / memset_run_us / 1e3
    copy_gb_s = 2 * nbytes / copy_us / 1e3
    ok = check(memset_gb_s >= 0.5 * copy_gb_s, f"memset of one run {memset_gb_s:.0f} GB/s is under half the copy's {copy_gb_s:.0f} GB/s")
    report(
        "bandwidth",
        ok=ok,
        page_bytes=page_bytes,
        memset_one_run_gb_s=nbytes / memset_run_us / 1e3,
        memset_single_pages_gb_s=nbytes / memset_single_us / 1e3,
        memset_us_per_single_page=memset_single_us / 512,
        clear_pages_us_per_single_page=clear_single_us / 512,
        d2d_copy_read_plus_write_gb_s=2 * nbytes / copy_us / 1e3,
        d2d_copy_bytes_moved_gb_s=nbytes / copy_us / 1e3,
    )


def check_offload() -> None:
    cache = make_cache("bf16", num_kv_pages=64, layers=4, heads=2, head_dim=64, num_host_pages=8)
    cache.data[:64] = torch.randn(cache.data[:64].shape, device=DEVICE).to(cache.storage_dtype)
    pages, slots = np.array([3, 4, 40], dtype=np.int32), np.array([0, 5, 7], dtype=np.int32)
    original = cache.data[pages].clone()
    sync()
    cache.offload(pages, slots)  # non_blocking copies to pinned memory
    cache.poison_pages(pages)  # the page's next owner, queued behind the copy
    cache.clear_pages(pages)
    cache.restore(pages, slots)
    sync()
    ok = all(
        [
            check(cache.host.is_pinned() or DEVICE.type != "cuda", "the host offload buffer is pinned"),
            check(torch.equal(cache.data[pages].view(torch.uint8), original.view(torch.uint8)), "offload + restore: byte-identical"),
        ]
    )
    report("offload", pages=len(pages), page_bytes=cache.page_bytes, ok=ok)


def decode_prepare(n: int, num_kv_pages: int) -> Prepare:
    pages_per_seq = 4
    return Prepare.greedy_decode(
        context_lens=np.array([3 + 5 * i for i in range(n)]),
        token_ids=np.arange(10, 10 + n),
        page_table_lens=np.full(n, pages_per_seq),
        page_table=np.arange(n * pages_per_seq) % num_kv_pages,
    )


def check_graph_runner() -> None:
    """Replays for padded batch sizes (3 on the graph of 4, 12 eagerly past the largest) against the
    eager forward on the same cache: the greedy choice of every row, and the pad page kept zero."""
    model, cache = tiny_model_and_cache()
    cache.data[: cache.pad_page] = (torch.randn(cache.data[: cache.pad_page].shape, device=DEVICE) * 0.5).to(cache.storage_dtype)
    runner = DecodeGraphRunner(model, cache, geometry=tiny_geometry(cache, model.config.vocab_size), batch_sizes=(1, 4, 8))
    results = {}
    for n in (1, 3, 8, 12):
        inputs = StepInputs.from_prepare(decode_prepare(n, cache.num_kv_pages), pad_page=cache.pad_page, page_size=16, device=DEVICE)
        snapshot = cache.data.clone()
        eager = model.forward(inputs, cache).float()
        cache.data.copy_(snapshot)
        graphed = runner.forward(inputs, cache).float()
        sync()
        agree = float((eager.argmax(-1) == graphed.argmax(-1)).float().mean())
        pad_zero = bool((cache.data[cache.pad_page] == 0).all())
        used = runner.graph_for(inputs)
        results[n] = {"graph": used.batch.size if used else None, "argmax_agreement": agree,
                      "max_abs_diff": float((eager - graphed).abs().max()), "pad_page_zero": pad_zero}  # fmt: skip
        check(agree == 1.0, f"graph runner n={n}: greedy choice agrees on {agree:.0%} of rows")
        check(pad_zero, f"graph runner n={n}: pad page stays zero")
    report("graph_runner", results=results, ok=all(r["argmax_agreement"] == 1.0 and r["pad_page_zero"] for r in results.values()))


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description="clear_pages, its ordering, offload and the graph runner on CUDA")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    DEVICE = torch.device(parser.parse_args(argv).device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device visible to torch"}))
        return 2
    if DEVICE.type == "cuda":
        report("device", name=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
        sections = (check_clear_pages, check_stream_order, check_bandwidth, check_offload, check_graph_runner)
    else:
        sections = (check_clear_pages, check_offload)
    started = time.perf_counter()
    for section in sections:
        try:
            section()
        except Exception as exc:  # noqa: BLE001 - report every section even if one breaks
            check(False, f"{section.__name__} raised {type(exc).__name__}: {exc}")
            report(section.__name__, error=f"{type(exc).__name__}: {exc}")
    report("summary", seconds=round(time.perf_counter() - started, 1), failures=FAILURES, ok=not FAILURES)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
