"""GPU check of clear_pages, its stream ordering, its bandwidth, and the decode graph runner.

Run by scripts/device_check.sh on one CUDA GPU; prints one JSON object per section and exits
non-zero if any check fails. Sections:
1. clear_pages with cuda-python, every KV dtype: NaN-poisoned listed pages zeroed in every plane,
   every other page (poisoned neighbours, live rows, the pad page) byte-identical.
2. Stream order: on a non-default model stream, poison -> clear_pages -> replay of a captured CUDA
   graph that reads the page with masked-attention arithmetic (0 x NaN = NaN), many times without
   a host sync in between; the graph's output must be finite every time. Control: without the
   clear the same graph must see NaN, or the check proves nothing.
3. Bandwidth: memset of one long run and of single pages (cuMemsetD8Async) against a
   device-to-device copy, on a Llama-3-8B-shaped bf16 page (2 MiB). A memset writes once where a
   copy reads and writes, so one long run must reach at least half the copy's read+write rate.
4. Pinned offload: pages copied to the pinned host buffer, cleared, and copied back, all queued on
   one stream without a host sync, come back byte-identical.
5. DecodeGraphRunner: a capturable stand-in decode forward replayed for padded batch sizes gives
   the eager logits and leaves the pad page zero.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

from executor.cache import KVCache, page_runs  # noqa: E402
from executor.cuda_graphs import DecodeGraphRunner  # noqa: E402
from executor.cuda_memset import memset_runs  # noqa: E402
from executor.inputs import StepInputs  # noqa: E402
from protocol.frames import CacheGeometry, KVDtype, Prepare  # noqa: E402

FAILURES: list[str] = []
# `--device cpu` runs the sections that need no CUDA (the CPU fill stands in for the memsets), so
# that this script's use of the runtime's API is tested where there is no GPU.
DEVICE = torch.device("cuda")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def check(condition: bool, what: str) -> bool:
    if not condition:
        FAILURES.append(what)
    return condition


def report(section: str, **values: object) -> None:
    print(json.dumps({"section": section, **values}), flush=True)


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


def check_stream_order(iterations: int = 200) -> None:
    cache = make_cache("fp8-e4m3", num_kv_pages=256, layers=8, heads=8, head_dim=128)
    page = 17
    cache.data[page].zero_()
    cache.data[page, :, :, :5] = torch.ones((), dtype=torch.float32).to(cache.storage_dtype)
    mask = torch.zeros(cache.page_size, device="cuda")
    mask[:5] = 1.0  # a sequence of 5 tokens: slots 5.. are masked, as attention masks them
    out = torch.zeros((), device="cuda")
    model_stream = torch.cuda.Stream()

    def masked_read() -> None:
        values = cache.data[page].float()  # [L, 2, P, H, D]
        out.copy_((values * mask.view(1, 1, -1, 1, 1)).sum())

    with torch.cuda.stream(model_stream):
        masked_read()
    model_stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=model_stream):
        masked_read()
    expected = float(cache.num_layers * 2 * 5 * cache.num_kv_heads * cache.head_dim)

    def run(clear: bool) -> list[float]:
        results = []
        with torch.cuda.stream(model_stream):
            for _ in range(iterations):
                # Poison the masked slots (the released page's stale bytes), then the step.
                cache.data[page, :, :, 5:].view(torch.uint8).fill_(0xFF)
                if clear:
                    memset_runs(cache.data, [(page, page + 1)], 0)
                    cache.data[page, :, :, :5] = torch.ones((), device="cuda").to(cache.storage_dtype)
                graph.replay()
                results.append(out.clone())
        model_stream.synchronize()
        return [r.item() for r in results]

    cleared = run(clear=True)
    control = run(clear=False)
    ok = check(all(v == expected for v in cleared), "graph after clear_pages sees only written slots") and check(
        all(np.isnan(v) for v in control), "control: graph without the clear sees NaN"
    )
    report(
        "stream_order",
        iterations=iterations,
        finite_after_clear=sum(np.isfinite(cleared)),
        nan_without_clear=sum(np.isnan(control)),
        expected=expected,
        ok=ok,
    )


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


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 128


class CapturableStandIn:
    """A decode forward with no host sync: write K/V, read every page of the table masked by the
    context, logits one-hot at (token + 1) plus the masked read (NaN if it saw garbage)."""

    fingerprint = "capturable-stand-in"
    config = TinyConfig()

    def forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        value = inputs.token_ids.float()[:, None, None].expand(-1, cache.num_kv_heads, cache.head_dim)
        for layer in range(cache.num_layers):
            cache.write(layer, inputs.write_pages, inputs.write_offsets, value, value)
        n, width = inputs.page_table.shape
        k, _ = cache.key_value(0)
        slots = k[inputs.page_table].float().reshape(n, width * cache.page_size, -1)
        visible = torch.arange(width * cache.page_size, device=slots.device)[None, :] < inputs.context_lens[:, None]
        attended = (visible[:, :, None].float() * slots).sum(dim=(1, 2))
        rows = inputs.sample_rows
        logits = torch.nn.functional.one_hot((inputs.token_ids[rows] + 1) % 128, 128).float()
        return logits * 5.0 + attended[:, None]


def decode_prepare(n: int, num_kv_pages: int) -> Prepare:
    pages_per_seq = 4
    return Prepare.greedy_decode(
        context_lens=np.array([3 + 5 * i for i in range(n)]),
        token_ids=np.arange(10, 10 + n),
        page_table_lens=np.full(n, pages_per_seq),
        page_table=np.arange(n * pages_per_seq) % num_kv_pages,
    )


def check_graph_runner() -> None:
    geometry = CacheGeometry(
        num_kv_pages=64, page_size=16, num_layers=2, num_kv_heads=2, head_dim=16, kv_dtype="fp32",
        vocab_size=128, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
    )
    cache = KVCache(
        num_kv_pages=64, page_size=16, num_layers=2, num_kv_heads=2, head_dim=16, kv_dtype="fp32",
        device=torch.device("cuda"),
    )
    cache.data[: cache.pad_page].zero_()
    model = CapturableStandIn()
    runner = DecodeGraphRunner(model, cache, geometry=geometry, batch_sizes=(1, 4, 8))
    results = {}
    for n in (1, 3, 8, 12):
        prepare = decode_prepare(n, geometry.num_kv_pages)
        inputs = StepInputs.from_prepare(prepare, pad_page=cache.pad_page, page_size=16, device="cuda")
        snapshot = cache.data.clone()
        eager = model.forward(inputs, cache).clone()
        cache.data.copy_(snapshot)
        graphed = runner.forward(inputs, cache).clone()
        torch.cuda.synchronize()
        # The graph reads a wider (pad-page) table: sums may round differently, values may not.
        same = torch.allclose(eager, graphed, rtol=1e-5, atol=1e-5)
        pad_zero = bool((cache.data[cache.pad_page] == 0).all())
        used = runner.graph_for(inputs)
        results[n] = {"graph": used.batch.size if used else None, "same_as_eager": same, "pad_page_zero": pad_zero}
        check(same, f"graph runner n={n}: logits equal eager")
        check(pad_zero, f"graph runner n={n}: pad page stays zero")
    report("graph_runner", results=results, ok=all(r["same_as_eager"] and r["pad_page_zero"] for r in results.values()))


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
