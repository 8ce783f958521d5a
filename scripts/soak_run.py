"""Running the soak: the servers' options, the stream of requests at a fixed concurrency, and the
monitor that samples /metrics and every process's RSS while it runs.

The run under test is TP=--tp with a small pool, poisoned at allocation and on every free; the
reference run replays the greedy requests at TP=1 with a pool that never runs short and no poison.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import httpx

from scripts.harness.client import StreamResult, served_model, stream_completion
from scripts.harness.metrics import M_RUNNING, M_USED, M_WAITING, MetricsSample, scrape_metrics
from scripts.harness.runtime import RuntimeServer, ServerOptions
from scripts.soak_workload import RunRecord, SoakRequest, outcome_of


# In fault mode the restarts must never run out: every kill is one.
FAULT_MODE_RESTARTS = ("--max-restarts", "100000")


def soak_server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        tensor_parallel_size=args.tp,
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        num_kv_pages=args.num_kv_pages,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        swap_space=args.swap_space,
        poison_kv_cache=True,
        poison_freed_pages=True,
        skip_clears=args.skip_clears,
        extra_args=(*deterministic_flag(args), *(FAULT_MODE_RESTARTS if args.kill_every else ())),
    )


def reference_server_options(args: argparse.Namespace) -> ServerOptions:
    """TP=1, a pool that never runs short, no poison."""
    return ServerOptions(
        tensor_parallel_size=1,
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=max(args.concurrency, 8),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        extra_args=deterministic_flag(args),
    )


def deterministic_flag(args: argparse.Namespace) -> tuple[str, ...]:
    """Both servers in the deterministic mode (docs/invariance.md), or neither."""
    return ("--deterministic",) if args.deterministic else ("--no-deterministic",)


def run_under_test(
    options: ServerOptions,
    requests: Sequence[SoakRequest] | None,
    make_request: Callable[[int], SoakRequest],
    args: argparse.Namespace,
    record: RunRecord,
    out: Path,
) -> int | None:
    """The run under test, monitored, into record; returns the server's exit code after its drain."""
    with RuntimeServer(options, out / "server.log") as server:
        killer = RankKiller(server, record, args.kill_every, args.tp) if args.kill_every else None
        asyncio.run(drive(server, requests, make_request, args, record, Monitor(server, record, args.poll_interval), killer))
        return server.stop()


class RankKiller:
    """Fault mode (--kill-every K): kill -9 of a rank after every K finished requests, the last rank
    and rank 0 in turn. A kill waits for the group that replaced the last one to serve, and labels
    its ranks (their RSS is followed from then on)."""

    def __init__(self, server: RuntimeServer, record: RunRecord, every: int, tp: int) -> None:
        self.server = server
        self.record = record
        self.every = every
        self.targets = (tp - 1, 0)
        self._idle = threading.Event()
        self._idle.set()

    def after_request(self, finished: int) -> None:
        if finished % self.every or not self._idle.is_set():
            return
        self._idle.clear()
        rank = self.targets[len(self.record.faults) % len(self.targets)]
        threading.Thread(target=self._kill, args=(rank,), name="rank-killer", daemon=True).start()

    def _kill(self, rank: int) -> None:
        try:
            self.record.faults.append((round(time.perf_counter() - self.record.t0, 3), f"rank{rank}"))
            self.server.signal(rank, signal.SIGKILL)
            self.server.wait_health(lambda status: status != 200, timeout_s=15)
            self.server.wait_health(lambda status: status == 200, timeout_s=300)
            self.server.wait_new_ranks(timeout_s=60)
        finally:
            self._idle.set()

    def wait_idle(self) -> None:
        self._idle.wait(400)


class Monitor:
    """Polls /metrics and the RSS of every rank and of the frontend while the run goes on."""

    def __init__(self, server: RuntimeServer, record: RunRecord, interval_s: float) -> None:
        self.server = server
        self.record = record
        self.interval_s = interval_s
        self.latest: dict[str, float] = {}

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll(client)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    async def poll(self, client: httpx.AsyncClient) -> None:
        t = time.perf_counter() - self.record.t0
        values = await scrape_metrics(client, self.server.url)
        if values is not None:
            self.latest = values
            self.record.metrics.append(MetricsSample(t=round(t, 3), values=values))
        for label, rss in sorted(self.server.rss().items()):
            self.record.rss.setdefault(label, []).append((round(t, 3), rss))


async def drive(
    server: RuntimeServer,
    requests: Sequence[SoakRequest] | None,
    make_request: Callable[[int], SoakRequest] | None,  # for --duration: request i on demand
    args: argparse.Namespace,
    record: RunRecord,
    monitor: Monitor | None,
    killer: RankKiller | None = None,
) -> None:
    """Sends the stream at the chosen concurrency, with a live progress bar."""
    from tqdm import tqdm

    model = served_model(server.url)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    deadline = None if args.duration is None else time.perf_counter() + args.duration
    total = len(requests) if requests is not None else None
    counts = {"completed": 0, "cancelled": 0, "failed": 0, "lost": 0}
    # Warm-up ends after a share of the requests, or of the time when the run is timed.
    warmup_count = max(2 * args.concurrency, int(args.warmup_fraction * (total or 0))) if total is not None else None
    next_index = 0
    finished = 0
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10.0), limits=limits) as client:
        record.t0 = time.perf_counter()
        if warmup_count is None:
            record.warmup_end = args.warmup_fraction * (args.duration or 0.0)
        poller = asyncio.create_task(monitor.run(client, stop)) if monitor else None
        bar = tqdm(total=total, desc="soak", unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

        def take() -> SoakRequest | None:
            nonlocal next_index
            if requests is not None:
                if next_index >= len(requests):
                    return None
                item = requests[next_index]
            else:
                if deadline is not None and time.perf_counter() >= deadline:
                    return None
                if make_request is None or (args.requests is not None and next_index >= args.requests):
                    return None
                item = make_request(next_index)
                record.requests.append(item)
            next_index += 1
            return item

        async def worker() -> None:
            nonlocal finished
            while (item := take()) is not None:
                result = await stream_completion(client, server.url, model, item.request, args.request_timeout)
                record.results[item.index] = result
                counts[outcome_of(result)] += 1
                finished += 1
                if killer is not None:
                    killer.after_request(finished)
                if finished == warmup_count:
                    record.warmup_end = time.perf_counter() - record.t0
                bar.update(1)
                if monitor is not None:
                    used = monitor.latest.get(M_USED)
                    bar.set_postfix(counts | ({"kv_used": int(used)} if used is not None else {}), refresh=False)

        try:
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            if killer is not None:  # the last kill's new group serves before the final look
                await asyncio.to_thread(killer.wait_idle)
            if monitor is not None:
                await wait_drained(client, server.url, timeout_s=30.0)
                await monitor.poll(client)
                record.final_metrics = monitor.latest or None
        finally:
            bar.close()
            stop.set()
            if poller is not None:
                await poller
    if record.warmup_end == 0.0:
        record.warmup_end = (time.perf_counter() - record.t0) / 2


async def wait_drained(client: httpx.AsyncClient, url: str, timeout_s: float) -> None:
    """Cancelled streams end server-side a step or two after the client hangs up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        values = await scrape_metrics(client, url)
        if values is not None and not values.get(M_RUNNING) and not values.get(M_WAITING):
            return
        await asyncio.sleep(0.25)


def run_reference(args: argparse.Namespace, requests: Sequence[SoakRequest], out: Path) -> dict[int, StreamResult]:
    """The greedy prompts again at TP=1, no pressure, no poison, no cancellations."""
    plain = [replace(r, request=replace(r.request, cancel_after_tokens=None)) for r in requests]
    record = RunRecord(requests=list(plain))
    ref_args = argparse.Namespace(**{**vars(args), "duration": None, "requests": None, "warmup_fraction": 0.0})
    with RuntimeServer(reference_server_options(args), out / "reference-server.log") as server:
        asyncio.run(drive(server, plain, None, ref_args, record, None))
    return record.results
