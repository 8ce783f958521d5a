"""Soak run: the runtime under KV pressure with fault injection, checked request by request.

    python scripts/soak.py                      # the short form: TP=2, ~2-3 minutes on a 2-core CPU
    python scripts/soak.py --requests 2000      # the long form a release is judged by
    python scripts/soak.py --skip-clears        # negative control: the checks must catch the damage

It starts `tp-runtime serve` at --tp ranks with a KV pool small enough that prefix snapshots are
evicted, requests are preempted (recomputed, and offloaded to host slots when --swap-space allows)
and pages are reused all the time, with the cache poisoned at allocation and every freed page
poisoned. It drives long and short prompts alternately, with shared system prompts, cancellations
mid-stream, and greedy and seeded sampled requests. Then it runs the greedy prompts again on a
TP=1 server without pressure or poison and checks (see CHECKS below); any miss exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from harness import (  # noqa: E402
    REPO_ROOT,
    CompletionRequest,
    MetricsSample,
    RuntimeServer,
    ServerOptions,
    ServerStartError,
    StreamResult,
    default_out_dir,
    exit_on_sigterm,
    percentile,
    rss_bytes,
    scrape_metrics,
    served_model,
    stream_completion,
    write_json,
)
from prompts import SYSTEM_PROMPTS, PromptBuilder  # noqa: E402

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

CHECKS = (
    "accounted",  # every request completed, was cancelled by us, or failed with a stated reason
    "answered_once",  # one stream per request: one id, one end, nothing after the finish
    "no_failures",  # no request failed (this run injects no failures)
    "logits_finite",  # no request failed for non-finite logits
    "token_ids",  # the server returned the token ids the comparison needs
    "greedy_reference",  # greedy outputs equal the TP=1 reference, or differ at a near-tie
    "rss_flat",  # no rank's (nor the frontend's) RSS grows after warm-up beyond the tolerance
    "no_rejects_aborts",  # /metrics counted no REJECT and no ABORT
    "drained",  # afterwards nothing runs or waits and every page is free or cached
    "pressure",  # the run did what it claims: preemption, eviction, offload/restore, clears
)
NON_FINITE = re.compile(r"finite|nan", re.IGNORECASE)
MIB = 1 << 20

# Metric names of tp_runtime/metrics.py (docs/http_api.md).
M_RUNNING = "tp_runtime_requests_running"
M_WAITING = "tp_runtime_requests_waiting"
M_PREEMPTED = "tp_runtime_requests_preempted"
M_FREE = "tp_runtime_kv_pages_free"
M_USED = "tp_runtime_kv_pages_used"
M_CACHED = "tp_runtime_kv_pages_cached"
M_MARKED = "tp_runtime_kv_pages_marked"
M_CLEARED = "tp_runtime_kv_pages_cleared_total"
M_PREEMPTIONS = "tp_runtime_preemptions_total"
M_OFFLOADS = "tp_runtime_kv_offloads_total"
M_RESTORES = "tp_runtime_kv_restores_total"
M_EVICTIONS = "tp_runtime_prefix_evictions_total"
M_STEPS = "tp_runtime_steps_total"
M_REJECTS = "tp_runtime_step_rejects_total"
M_ABORTS = "tp_runtime_step_aborts_total"
M_ABORTED_STEPS = "tp_runtime_aborted_steps_total"
M_REQUEST_REJECTS = "tp_runtime_request_rejects_total"
M_CANCELS = "tp_runtime_request_cancels_total"


# ---- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadShape:
    long_tokens: tuple[int, int] = (300, 900)  # user text of a long prompt
    short_tokens: tuple[int, int] = (20, 60)
    max_tokens: tuple[int, int] = (16, 96)  # long enough that decoding outgrows the pool: preemption
    shared_prefix_fraction: float = 0.6  # prompts that start with one of the shared system prompts
    sampled_fraction: float = 0.25  # seeded sampled requests; the rest are greedy
    cancel_fraction: float = 0.15  # requests whose client hangs up mid-stream


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str  # "long" | "short"
    system_prompt: int | None  # index into SYSTEM_PROMPTS: the shared prefix
    request: CompletionRequest

    @property
    def greedy(self) -> bool:
        return self.request.temperature == 0.0


def build_request(builder: PromptBuilder, index: int, seed: int, shape: WorkloadShape) -> SoakRequest:
    """Request `index` of the stream; the same (index, seed) always gives the same request."""
    rng = random.Random(f"soak:{seed}:{index}")
    kind = "long" if index % 2 == 0 else "short"
    low, high = shape.long_tokens if kind == "long" else shape.short_tokens
    system = rng.randrange(len(SYSTEM_PROMPTS)) if rng.random() < shape.shared_prefix_fraction else None
    user = builder.body(rng, rng.randint(low, high)) + builder.question(rng)
    prompt = builder.chat(SYSTEM_PROMPTS[system] if system is not None else None, user)
    max_tokens = rng.randint(*shape.max_tokens)
    sampled = rng.random() < shape.sampled_fraction
    cancel = rng.random() < shape.cancel_fraction
    request = CompletionRequest(
        prompt_ids=tuple(prompt),
        max_tokens=max_tokens,
        temperature=0.8 if sampled else 0.0,
        top_p=0.95 if sampled else 1.0,
        seed=rng.randrange(1 << 31) if sampled else None,
        cancel_after_tokens=rng.randint(1, max_tokens - 1) if cancel else None,
    )
    return SoakRequest(index=index, kind=kind, system_prompt=system, request=request)


def max_request_tokens(builder: PromptBuilder, shape: WorkloadShape) -> int:
    """An upper bound of prompt + output tokens of any request of this shape."""
    template = max(len(builder.chat(system, [])) for system in SYSTEM_PROMPTS)
    longest_user = max(shape.long_tokens[1], shape.short_tokens[1]) + builder.longest_question
    return template + longest_user + shape.max_tokens[1]


# ---- what a request came to ---------------------------------------------------------------------


def outcome_of(result: StreamResult) -> str:
    if result.cancelled and result.error is None:
        return "cancelled"
    if result.error is not None:
        return "lost" if result.error.startswith("lost:") else "failed"
    if result.finish_reason in ("length", "stop"):
        return "completed"
    return "lost"  # the stream ended without a finish reason or an error: nobody said why


@dataclass(frozen=True)
class Comparison:
    """A greedy soak output against the reference's output of the same prompt."""

    index: int
    identical: bool
    position: int | None = None  # first differing output position
    soak_token: int | None = None
    reference_token: int | None = None
    top2: tuple[tuple[int, float], tuple[int, float]] | None = None  # the reference's two best
    gap_soak: float | None = None  # best logit minus the soak token's logit
    gap_reference: float | None = None
    near_tie: bool = False


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two token sequences differ (a shorter one differs where it ended)."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def token_at(tokens: Sequence[int], position: int, finish_reason: str | None, eos: int) -> int | None:
    """The token chosen at position: past the end of a stopped output, the end-of-sequence token."""
    if position < len(tokens):
        return tokens[position]
    return eos if finish_reason == "stop" else None


def judge_difference(
    index: int,
    position: int,
    soak_token: int | None,
    reference_token: int | None,
    logits: Sequence[float],
    tolerance: float,
) -> Comparison:
    """Near-tie: both tokens' reference logits lie within `tolerance` of the reference's best."""
    ranked = sorted(range(len(logits)), key=lambda t: logits[t], reverse=True)[:2]
    best = float(logits[ranked[0]])
    top2 = ((ranked[0], best), (ranked[1], float(logits[ranked[1]])))
    gap_soak = None if soak_token is None else best - float(logits[soak_token])
    gap_reference = None if reference_token is None else best - float(logits[reference_token])
    near = gap_soak is not None and gap_reference is not None and gap_soak <= tolerance and gap_reference <= tolerance
    return Comparison(
        index=index,
        identical=False,
        position=position,
        soak_token=soak_token,
        reference_token=reference_token,
        top2=top2,
        gap_soak=gap_soak,
        gap_reference=gap_reference,
        near_tie=near,
    )


# ---- memory ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RssVerdict:
    label: str
    warmup_peak_mib: float | None
    after_peak_mib: float | None
    growth_mib: float | None
    slope_mib_per_min: float | None
    flat: bool
    note: str = ""


def rss_verdict(label: str, samples: Sequence[tuple[float, int]], warmup_end: float, tolerance_mib: float) -> RssVerdict:
    """Flat: the peak after warm-up exceeds the warm-up's own peak by at most tolerance_mib.

    The warm-up peak is the baseline because it already holds the largest activations (long
    prefill chunks come early); a leak shows as peaks that keep climbing after it. Too few samples
    to tell is not flat: the check must not pass on no evidence.
    """
    warm = [rss for t, rss in samples if t <= warmup_end]
    after = [(t, rss) for t, rss in samples if t > warmup_end]
    if not warm or len(after) < 2:
        note = f"too few samples around the end of warm-up at {warmup_end:.1f} s ({len(warm)} before, {len(after)} after)"
        return RssVerdict(label, None, None, None, None, flat=False, note=note)
    warm_peak = max(warm) / MIB
    after_peak = max(rss for _, rss in after) / MIB
    growth = after_peak - warm_peak
    return RssVerdict(
        label=label,
        warmup_peak_mib=round(warm_peak, 1),
        after_peak_mib=round(after_peak, 1),
        growth_mib=round(growth, 1),
        slope_mib_per_min=round(_slope([t for t, _ in after], [rss / MIB for _, rss in after]) * 60.0, 2),
        flat=growth <= tolerance_mib,
    )


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


# ---- checks ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    misses: tuple[str, ...] = ()


@dataclass
class RunRecord:
    """Everything one soak run observed."""

    requests: list[SoakRequest] = field(default_factory=list)
    results: dict[int, StreamResult] = field(default_factory=dict)
    metrics: list[MetricsSample] = field(default_factory=list)
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    t0: float = 0.0  # perf_counter at the start of the stream of requests
    warmup_end: float = 0.0  # seconds after t0
    final_metrics: dict[str, float] | None = None


def check_run(
    record: RunRecord,
    comparisons: Sequence[Comparison],
    rss: Sequence[RssVerdict],
    *,
    swap_space: bool,
    prefix_caching: bool = True,
) -> list[Check]:
    results = [(r, record.results[r.index]) for r in record.requests]
    checks: list[Check] = []

    lost = [f"#{r.index}: {res.error or 'the stream ended without a finish reason'}" for r, res in results if outcome_of(res) == "lost"]
    checks.append(Check("accounted", not lost, f"{len(results) - len(lost)}/{len(results)} requests accounted for", tuple(lost)))

    twice: list[str] = []
    owners: dict[str, int] = {}
    for r, res in results:
        if len(res.response_ids) > 1:
            twice.append(f"#{r.index}: one stream carried ids {sorted(res.response_ids)}")
        if res.done_markers > 1 or res.after_finish:
            twice.append(f"#{r.index}: {res.done_markers} [DONE] markers, {res.after_finish} chunks after the finish")
        if outcome_of(res) == "completed" and res.done_markers != 1:
            twice.append(f"#{r.index}: completed with {res.done_markers} [DONE] markers")
        for rid in res.response_ids:
            if rid in owners:
                twice.append(f"#{r.index}: response id {rid} also answered #{owners[rid]}")
            owners[rid] = r.index
    checks.append(Check("answered_once", not twice, "every request answered by exactly one stream", tuple(twice)))

    failed = [(r, res) for r, res in results if outcome_of(res) == "failed"]
    checks.append(
        Check("no_failures", not failed, f"{len(failed)} failed", tuple(f"#{r.index}: {res.error}" for r, res in failed))
    )
    non_finite = [f"#{r.index}: {res.error}" for r, res in failed if NON_FINITE.search(res.error or "")]
    checks.append(Check("logits_finite", not non_finite, f"{len(non_finite)} failed for non-finite logits", tuple(non_finite)))

    no_ids = [f"#{r.index}" for r, res in results if outcome_of(res) == "completed" and res.output_tokens and not res.token_ids]
    checks.append(
        Check(
            "token_ids",
            not no_ids,
            "completed streams carry choices[].token_ids (request field return_token_ids)",
            tuple(no_ids),
        )
    )

    diverged = [c for c in comparisons if not c.identical and not c.near_tie]
    near = [c for c in comparisons if c.near_tie]
    checks.append(
        Check(
            "greedy_reference",
            not diverged,
            f"{len(comparisons)} greedy outputs compared: {len(comparisons) - len(near) - len(diverged)} identical, "
            f"{len(near)} near-ties, {len(diverged)} diverged",
            tuple(
                f"#{c.index}: position {c.position}: soak token {c.soak_token}, reference {c.reference_token}, "
                f"reference top-2 {c.top2}, gaps {c.gap_soak}/{c.gap_reference}"
                for c in diverged
            ),
        )
    )

    grown = [
        f"{v.label}: {v.note}" if v.note else f"{v.label}: +{v.growth_mib} MiB after warm-up (slope {v.slope_mib_per_min} MiB/min)"
        for v in rss
        if not v.flat
    ]
    checks.append(
        Check(
            "rss_flat",
            bool(rss) and not grown,
            "; ".join(f"{v.label} {v.warmup_peak_mib}->{v.after_peak_mib} MiB" for v in rss) or "no rank RSS was sampled",
            tuple(grown),
        )
    )

    final = record.final_metrics
    if final is None:
        checks.append(Check("no_rejects_aborts", False, "/metrics was not readable at the end of the run"))
        checks.append(Check("drained", False, "/metrics was not readable at the end of the run"))
        checks.append(Check("pressure", False, "/metrics was not readable at the end of the run"))
        return checks
    counts = {name: final.get(name, 0.0) for name in (M_REJECTS, M_ABORTS, M_ABORTED_STEPS, M_REQUEST_REJECTS)}
    bad = tuple(f"{name} = {value:g}" for name, value in counts.items() if value)
    checks.append(Check("no_rejects_aborts", not bad, ", ".join(f"{k} = {v:g}" for k, v in counts.items()), bad))

    leftovers = {name: final.get(name) for name in (M_RUNNING, M_WAITING, M_PREEMPTED)}
    # kv_pages_used counts every page off the free list, prefix snapshots included.
    used, cached = final.get(M_USED), final.get(M_CACHED)
    leftovers["request pages (kv_pages_used - kv_pages_cached)"] = None if used is None or cached is None else used - cached
    undrained = tuple(f"{name} = {value}" for name, value in leftovers.items() if value is None or value != 0)
    checks.append(Check("drained", not undrained, "nothing running, waiting or holding request pages after the run", undrained))

    wanted = [M_PREEMPTIONS, M_CLEARED] + ([M_EVICTIONS] if prefix_caching else []) + ([M_OFFLOADS, M_RESTORES] if swap_space else [])
    missing = tuple(f"{name} = {final.get(name, 0.0):g}" for name in wanted if not final.get(name))
    checks.append(
        Check(
            "pressure",
            not missing,
            ", ".join(f"{name} = {final.get(name, 0.0):g}" for name in wanted),
            missing,
        )
    )
    return checks


# ---- running it -------------------------------------------------------------------------------------


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
    )


class Monitor:
    """Polls /metrics and every rank's RSS while the run goes on."""

    def __init__(self, server: RuntimeServer, record: RunRecord, interval_s: float) -> None:
        self.server = server
        self.record = record
        self.interval_s = interval_s
        self.latest: dict[str, float] = {}
        self._pids: dict[str, int] = {}

    def discover(self) -> None:
        self._pids = {f"rank{rank}": pid for rank, pid in sorted(self.server.rank_pids().items())}
        frontend = self.server.frontend_pid()
        if frontend is not None:
            self._pids["frontend"] = frontend

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
        for label, pid in self._pids.items():
            rss = rss_bytes(pid)
            if rss is not None:
                self.record.rss.setdefault(label, []).append((round(t, 3), rss))


async def drive(
    server: RuntimeServer,
    requests: Sequence[SoakRequest] | None,
    make_request: Callable[[int], SoakRequest] | None,  # for --duration: request i on demand
    args: argparse.Namespace,
    record: RunRecord,
    monitor: Monitor | None,
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
                if finished == warmup_count:
                    record.warmup_end = time.perf_counter() - record.t0
                bar.update(1)
                if monitor is not None:
                    used = monitor.latest.get(M_USED)
                    bar.set_postfix(counts | ({"kv_used": int(used)} if used is not None else {}), refresh=False)

        try:
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
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


def compare_greedy(
    args: argparse.Namespace,
    requests: Sequence[SoakRequest],
    results: dict[int, StreamResult],
    reference: dict[int, StreamResult],
    eos: int,
) -> list[Comparison]:
    comparisons: list[Comparison] = []
    pending: list[tuple[SoakRequest, int]] = []
    for r in requests:
        soak, ref = results[r.index], reference.get(r.index)
        if ref is None or outcome_of(ref) != "completed":
            raise SoakError(f"the reference run did not complete request #{r.index}: {ref.error if ref else 'missing'}")
        position = first_difference(soak.token_ids, ref.token_ids)
        if position is None:
            comparisons.append(Comparison(index=r.index, identical=True))
        else:
            pending.append((r, position))
    if pending:
        from reference import OfflineReference

        offline = OfflineReference(args.model or default_model(), args.dtype)
        for r, position in pending:
            soak, ref = results[r.index], reference[r.index]
            logits = offline.next_token_logits([*r.request.prompt_ids, *ref.token_ids[:position]])
            comparisons.append(
                judge_difference(
                    r.index,
                    position,
                    token_at(soak.token_ids, position, soak.finish_reason, eos),
                    token_at(ref.token_ids, position, ref.finish_reason, eos),
                    logits.tolist(),
                    args.near_tie_tolerance,
                )
            )
    return sorted(comparisons, key=lambda c: c.index)


class SoakError(RuntimeError):
    """The soak could not run to its checks (the reference run failed, the server did not start)."""


def default_model() -> str:
    from executor.model import default_model_path

    return default_model_path()


# ---- report -----------------------------------------------------------------------------------------


def summarize(record: RunRecord, comparisons: Sequence[Comparison], elapsed_s: float) -> dict[str, object]:
    results = [record.results[r.index] for r in record.requests]
    outcomes = [outcome_of(res) for res in results]
    tokens = sum(res.output_tokens for res in results)
    ttft = [res.ttft_s for res in results if res.ttft_s is not None]
    tpot = [res.tpot_s for res in results if res.tpot_s is not None]
    near = sum(c.near_tie for c in comparisons)
    diverged = sum(not c.identical and not c.near_tie for c in comparisons)
    return {
        "requests": len(results),
        "completed": outcomes.count("completed"),
        "cancelled": outcomes.count("cancelled"),
        "failed": outcomes.count("failed"),
        "lost": outcomes.count("lost"),
        "long": sum(r.kind == "long" for r in record.requests),
        "short": sum(r.kind == "short" for r in record.requests),
        "greedy": sum(r.greedy for r in record.requests),
        "sampled": sum(not r.greedy for r in record.requests),
        "shared_prefix": sum(r.system_prompt is not None for r in record.requests),
        "prompt_tokens": sum(len(r.request.prompt_ids) for r in record.requests),
        "output_tokens": tokens,
        "elapsed_s": round(elapsed_s, 2),
        "output_tokens_per_s": round(tokens / elapsed_s, 2) if elapsed_s > 0 else None,
        "ttft_s": _quantiles(ttft),
        "tpot_s": _quantiles(tpot),
        "greedy_compared": len(comparisons),
        "identical": len(comparisons) - near - diverged,
        "near_ties": near,
        "diverged": diverged,
    }


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    def rounded(v: float | None) -> float | None:
        return None if v is None else round(v, 4)

    return {"median": rounded(percentile(values, 50)), "p99": rounded(percentile(values, 99)), "max": rounded(max(values, default=None))}


def request_rows(record: RunRecord, comparisons: Sequence[Comparison]) -> list[dict[str, object]]:
    by_index = {c.index: c for c in comparisons}
    rows = []
    for r in record.requests:
        res = record.results[r.index]
        c = by_index.get(r.index)
        rows.append(
            {
                "index": r.index,
                "kind": r.kind,
                "system_prompt": r.system_prompt,
                "greedy": r.greedy,
                "prompt_tokens": len(r.request.prompt_ids),
                "max_tokens": r.request.max_tokens,
                "cancel_after_tokens": r.request.cancel_after_tokens,
                "outcome": outcome_of(res),
                "finish_reason": res.finish_reason,
                "error": res.error,
                "output_tokens": res.output_tokens,
                "ttft_s": None if res.ttft_s is None else round(res.ttft_s, 4),
                "tpot_s": None if res.tpot_s is None else round(res.tpot_s, 4),
                "reference": None if c is None else ("identical" if c.identical else "near-tie" if c.near_tie else "diverged"),
            }
        )
    return rows


def pressure_counts(final: dict[str, float] | None) -> dict[str, float | None]:
    names = {
        "steps": M_STEPS,
        "pages_cleared": M_CLEARED,
        "preemptions": M_PREEMPTIONS,
        "offloads": M_OFFLOADS,
        "restores": M_RESTORES,
        "prefix_evictions": M_EVICTIONS,
        "step_rejects": M_REJECTS,
        "step_aborts": M_ABORTS,
        "request_cancels": M_CANCELS,
    }
    return {key: (None if final is None else final.get(name)) for key, name in names.items()}


def write_plots(record: RunRecord, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 2, figsize=(11, 12))
    ax = axes[0][0]
    stamps = sorted(t - record.t0 for res in record.results.values() for t in res.token_times)
    if stamps:
        width = max(1.0, stamps[-1] / 60)
        bins = [i * width for i in range(int(stamps[-1] / width) + 2)]
        counts, edges = _histogram(stamps, bins)
        ax.plot(edges[:-1], [c / width for c in counts], drawstyle="steps-post")
    ax.set(title="Throughput (output tokens/s, client side)", xlabel="s", ylabel="tokens/s")

    t = [s.t for s in record.metrics]
    ax = axes[0][1]
    nan = float("nan")
    series = {
        "used by requests": [s.values.get(M_USED, nan) - s.values.get(M_CACHED, nan) for s in record.metrics],
        "cached (prefix snapshots)": [s.values.get(M_CACHED, nan) for s in record.metrics],
        "free": [s.values.get(M_FREE, nan) for s in record.metrics],
        "marked": [s.values.get(M_MARKED, nan) for s in record.metrics],
    }
    for label, values in series.items():
        ax.plot(t, values, label=label)
    ax.set(title="KV pool occupancy (pages)", xlabel="s")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    per_step_t, per_step = [], []
    for a, b in zip(record.metrics, record.metrics[1:]):
        steps = b.values.get(M_STEPS, 0.0) - a.values.get(M_STEPS, 0.0)
        if steps > 0:
            per_step_t.append(b.t)
            per_step.append((b.values.get(M_CLEARED, 0.0) - a.values.get(M_CLEARED, 0.0)) / steps)
    ax.plot(per_step_t, per_step, ".", markersize=3)
    ax.set(title="Pages cleared per step (mean over each poll)", xlabel="s")

    ax = axes[1][1]
    for name, label in ((M_PREEMPTIONS, "preemptions"), (M_OFFLOADS, "offloads"), (M_RESTORES, "restores")):
        ax.plot(t, [s.values.get(name, float("nan")) for s in record.metrics], label=label)
    ax.set(title="Preemption, offload, restore; prefix eviction (cumulative)", xlabel="s")
    ax.legend(fontsize=8, loc="upper left")
    # Evicted pages outnumber preemptions by far: their own axis keeps both readable.
    pages_ax = ax.twinx()
    pages_ax.plot(t, [s.values.get(M_EVICTIONS, float("nan")) for s in record.metrics], color="tab:red", label="prefix pages evicted")
    pages_ax.legend(fontsize=8, loc="lower right")

    results = list(record.results.values())
    ttft = [res.ttft_s for res in results if res.ttft_s is not None]
    tpot = [res.tpot_s * 1000 for res in results if res.tpot_s is not None]
    axes[2][0].hist(ttft, bins=30)
    axes[2][0].set(title="Time to first token", xlabel="s", ylabel="requests")
    axes[2][1].hist(tpot, bins=30)
    axes[2][1].set(title="Time per output token", xlabel="ms", ylabel="requests")

    ax = axes[3][0]
    for label, samples in sorted(record.rss.items()):
        ax.plot([s for s, _ in samples], [rss / MIB for _, rss in samples], label=label)
    ax.axvline(record.warmup_end, color="grey", linestyle="--", label="end of warm-up")
    ax.set(title="RSS per process (MiB)", xlabel="s")
    ax.legend(fontsize=8)

    ax = axes[3][1]
    outcome_names = ("completed", "cancelled", "failed", "lost")
    outcomes = [outcome_of(record.results[r.index]) for r in record.requests if r.index in record.results]
    ax.bar(outcome_names, [outcomes.count(o) for o in outcome_names])
    ax.set(title="Request outcomes", ylabel="requests")

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=60)
    plt.close(fig)


def _histogram(values: Sequence[float], edges: Sequence[float]) -> tuple[list[int], list[float]]:
    counts = [0] * (len(edges) - 1)
    width = edges[1] - edges[0]
    for v in values:
        counts[min(int(v / width), len(counts) - 1)] += 1
    return counts, list(edges)


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tp-runtime soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=None, help="requests in the stream (default 40, or unlimited with --duration)")
    p.add_argument("--duration", type=float, default=None, help="send requests for this many seconds instead")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the runtime under test")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-kv-pages", type=int, default=96, help="a pool small enough for pressure")
    p.add_argument("--max-model-len", type=int, default=1280)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--swap-space", default="6MiB", help="host offload buffer; 0 preempts by recompute only")
    p.add_argument("--skip-clears", action="store_true", help="negative control: the checks must detect the damage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-fraction", type=float, default=0.25, help="share of requests before RSS must stay flat")
    p.add_argument("--rss-tolerance-mib", type=float, default=48.0)
    p.add_argument("--near-tie-tolerance", type=float, default=None, help="logits; default 0.05 for fp32, 0.5 otherwise")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--long-tokens", type=int, nargs=2, default=(300, 900), metavar=("MIN", "MAX"))
    p.add_argument("--short-tokens", type=int, nargs=2, default=(20, 60), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 96), metavar=("MIN", "MAX"))
    p.add_argument("--out", type=Path, default=None, help="report directory (default reports/soak-<time>)")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    args = p.parse_args(argv)
    if args.requests is None and args.duration is None:
        args.requests = 40
    if args.near_tie_tolerance is None:
        args.near_tie_tolerance = 0.05 if args.dtype == "fp32" else 0.5
    if args.concurrency < 1 or args.tp < 1 or (args.requests is not None and args.requests < 1):
        p.error("--concurrency, --tp and --requests must be at least 1")
    if not 0.0 <= args.warmup_fraction < 1.0:
        p.error("--warmup-fraction must be in [0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import json

    from tp_runtime.tokenizer import Tokenizer

    args = parse_args(argv)
    exit_on_sigterm()
    out = args.out or default_out_dir("soak-control" if args.skip_clears else "soak")
    model = args.model or default_model()
    tokenizer = Tokenizer.from_model_path(model)
    builder = PromptBuilder(tokenizer)
    shape = WorkloadShape(
        long_tokens=tuple(args.long_tokens), short_tokens=tuple(args.short_tokens), max_tokens=tuple(args.max_tokens)
    )
    longest = max_request_tokens(builder, shape)
    if longest > args.max_model_len:
        raise SystemExit(f"soak: error: a request may need {longest} tokens but --max-model-len is {args.max_model_len}")
    make = lambda i: build_request(builder, i, args.seed, shape)  # noqa: E731
    fixed = [make(i) for i in range(args.requests)] if args.duration is None else None
    record = RunRecord(requests=list(fixed) if fixed is not None else [])

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()
    options = soak_server_options(args)
    t_start = time.perf_counter()
    try:
        with RuntimeServer(options, out / "server.log") as server:
            monitor = Monitor(server, record, args.poll_interval)
            monitor.discover()
            asyncio.run(drive(server, fixed, make, args, record, monitor))
            shutdown_code = server.stop()
    except ServerStartError as exc:
        sys.stderr.write(f"soak: error: {exc}\n")
        return 2
    elapsed = max((res.t_end for res in record.results.values() if res.t_end is not None), default=record.t0) - record.t0

    rss = [rss_verdict(label, samples, record.warmup_end, args.rss_tolerance_mib) for label, samples in sorted(record.rss.items())]
    greedy_done = [r for r in record.requests if r.greedy and outcome_of(record.results[r.index]) == "completed" and record.results[r.index].token_ids]
    pre_checks = check_run(record, [], rss, swap_space=_swap_enabled(args.swap_space))
    damage_seen = not _passed(pre_checks, "logits_finite")
    comparisons: list[Comparison] = []
    reference_error: str | None = None
    if greedy_done and not (args.skip_clears and damage_seen):
        try:
            reference = run_reference(args, greedy_done, out)
            comparisons = compare_greedy(args, greedy_done, record.results, reference, tokenizer.eos_token_ids[0])
        except (SoakError, ServerStartError) as exc:
            reference_error = str(exc)
    checks = check_run(record, comparisons, rss, swap_space=_swap_enabled(args.swap_space))
    if reference_error is not None:
        checks.append(Check("reference_run", False, f"the TP=1 reference run failed: {reference_error}"))
    passed = all(c.passed for c in checks)
    detected = not _passed(checks, "logits_finite") or not _passed(checks, "greedy_reference")

    report = {
        "kind": "soak",
        "mode": "negative-control" if args.skip_clears else "soak",
        "passed": detected if args.skip_clears else passed,
        "damage_detected": detected,
        "started_at": started,
        # Other work on the machine skews every number here: the 1/5/15-minute load averages.
        "load_average": {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
            "model": model,
            "server_argv": options.argv(0)[5:],
            "max_request_tokens": longest,
        },
        "server_exit_code": shutdown_code,
        "summary": summarize(record, comparisons, elapsed),
        "pressure": pressure_counts(record.final_metrics),
        "rss": [asdict(v) for v in rss],
        "checks": [asdict(c) for c in checks],
        "near_ties": [asdict(c) for c in comparisons if c.near_tie],
        "divergences": [asdict(c) for c in comparisons if not c.identical and not c.near_tie],
        "requests": request_rows(record, comparisons),
    }
    write_json(out / "report.json", report)
    write_json(
        out / "timeline.json",
        {"metrics": [asdict(s) for s in record.metrics], "rss": record.rss, "warmup_end_s": record.warmup_end},
    )
    write_plots(record, out / "soak.png")
    print_summary(report, out)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


def _passed(checks: Sequence[Check], name: str) -> bool:
    return next(c.passed for c in checks if c.name == name)


def _swap_enabled(swap_space: str) -> bool:
    from tp_runtime.config import parse_size

    return parse_size(swap_space) > 0


def print_summary(report: dict, out: Path) -> None:
    s = report["summary"]
    lines = [
        f"soak ({report['mode']}): {s['requests']} requests, {s['completed']} completed, {s['cancelled']} cancelled, "
        f"{s['failed']} failed, {s['lost']} lost; {s['output_tokens']} tokens in {s['elapsed_s']} s "
        f"({s['output_tokens_per_s']} tok/s); greedy vs reference: {s['identical']} identical, "
        f"{s['near_ties']} near-ties, {s['diverged']} diverged",
        "pressure: " + ", ".join(f"{k} {v:g}" if v is not None else f"{k} ?" for k, v in report["pressure"].items()),
    ]
    for c in report["checks"]:
        lines.append(f"  [{'ok' if c['passed'] else 'MISS'}] {c['name']}: {c['detail']}")
        lines.extend(f"        {m}" for m in c["misses"][:20])
    if report["mode"] == "negative-control":
        verdict = "DETECTED the damage (as it must)" if report["damage_detected"] else "did NOT detect the damage: the checks cannot fail"
        lines.append(f"negative control {verdict}")
    else:
        lines.append("PASSED" if report["passed"] else "FAILED")
    load = report["load_average"]
    lines.append(f"load average (1/5/15 min) at start {load['start']}, at end {load['end']}, on {os.cpu_count()} CPUs")
    lines.append(f"report: {out / 'report.json'}, plots: {out / 'soak.png'}")
    sys.stderr.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
