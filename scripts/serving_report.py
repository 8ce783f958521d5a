"""The serving benchmark's numbers: one side's result at one concurrency, the control plane's share
from /metrics, the comparison of the overlapped and serial step loops and of the reference, the
targets, the plot and the summary. No server and no model here: scripts/bench_serving.py measures."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.harness.metrics import (
    M_MODEL_BUSY_SECONDS,
    M_MODEL_IDLE_SECONDS,
    M_PLAN_SECONDS,
    M_PREFIX_HITS,
    M_PREFIX_QUERIES,
    M_PROTOCOL_SECONDS,
    M_STEP_SECONDS,
    M_STEPS,
)
from scripts.harness.output import percentile

REFERENCE_TARGETS = {32: 3.0, 1: 1.5}  # concurrency -> minimum throughput ratio tp-runtime / reference
# Issue 14's targets for the overlapped loop: a lone stream's time per output token within 10% of
# the model's own batch-1 step, and the model waiting on the control plane under 2% at 32 streams.
BASELINE = "baseline"  # bench_serving --baseline: another checkout's runtime
TPOT_OVER_MODEL_STEP_MAX = 1.05
CONTROL_PLANE_SHARE_MAX = 0.02
# The CPU of every server process that does not run the model, together, per output token.
CONTROL_CPU_MS_PER_TOKEN_MAX = {1: 0.3, 32: 0.05}
OVERHEAD_METRICS = (M_PLAN_SECONDS, M_PROTOCOL_SECONDS, M_STEP_SECONDS, M_MODEL_BUSY_SECONDS, M_MODEL_IDLE_SECONDS, M_STEPS)
# Overhead's fields, in order: the step counters above, which it needs, then the prefix cache's,
# read as 0 where /metrics lacks them (a --baseline tree from before the vLLM metrics).
COUNTER_METRICS = (*OVERHEAD_METRICS, M_PREFIX_QUERIES, M_PREFIX_HITS)
OVERLAP, SERIAL = "overlap", "serial"  # --async-scheduling on and off
# Above this share of prompt tokens served from the prefix cache a level is said to repeat its
# prompts: a level's prompts share a page at most by chance (their bodies are drawn by --seed).
PREFIX_HIT_SHARE_NOTED = 0.05


@dataclass(frozen=True)
class SideResult:
    """One side (a tp-runtime loop or the reference) at one concurrency."""

    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_median_s: float | None
    ttft_p99_s: float | None
    tpot_median_s: float | None
    tpot_p99_s: float | None
    short_outputs: int  # requests that produced fewer tokens than asked (the server ignored ignore_eos)
    errors: tuple[str, ...] = ()
    # Inter-token latency, every request's gaps pooled (StreamResult.itl_s): what a stream's reader
    # waits between two pieces, where TPOT averages a request's pieces away.
    itl_median_s: float | None = None
    itl_p99_s: float | None = None


def side_result(
    token_counts: Sequence[int],
    ttfts: Sequence[float],
    tpots: Sequence[float],
    wall_s: float,
    wanted: int,
    errors: Sequence[str] = (),
    itls: Sequence[float] = (),
) -> SideResult:
    tokens = sum(token_counts)

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 5)

    return SideResult(
        requests=len(token_counts),
        output_tokens=tokens,
        wall_s=round(wall_s, 3),
        tokens_per_s=round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        ttft_median_s=r(percentile(ttfts, 50)),
        ttft_p99_s=r(percentile(ttfts, 99)),
        tpot_median_s=r(percentile(tpots, 50)),
        tpot_p99_s=r(percentile(tpots, 99)),
        short_outputs=sum(n < wanted for n in token_counts),
        errors=tuple(errors),
        itl_median_s=r(percentile(itls, 50)),
        itl_p99_s=r(percentile(itls, 99)),
    )


@dataclass(frozen=True)
class Overhead:
    """The growth of the runtime's step counters over one level.

    `plan_s + protocol_s` is the control plane's own time. With the overlap most of it runs while
    the model computes, and protocol_s then also holds the wait for the step ahead to end, so the
    share that costs tokens is `control_plane_share`: the time rank 0's model sat idle between two
    back-to-back steps, over the time of those steps (busy + idle)."""

    plan_s: float
    protocol_s: float
    step_s: float
    model_busy_s: float
    model_idle_s: float
    steps: float
    prefix_queries: float  # prompt tokens looked up in the prefix cache
    prefix_hits: float  # and found there

    @property
    def prefix_hit_share(self) -> float | None:
        """The share of the prompt tokens the prefix cache served. The benchmark's prompts begin
        apart, so it is ~0; more means they repeat what the server saw before (a rerun with --url
        and the same --seed), and the level did less prefill than its prompts ask."""
        return None if self.prefix_queries <= 0 else self.prefix_hits / self.prefix_queries

    @property
    def fraction(self) -> float | None:
        return None if self.step_s <= 0 else (self.plan_s + self.protocol_s) / self.step_s

    @property
    def control_plane_share(self) -> float | None:
        total = self.model_busy_s + self.model_idle_s
        return None if total <= 0 else self.model_idle_s / total

    @property
    def model_step_s(self) -> float | None:
        """Rank 0's mean forward + sampling time per step, as the runtime timed it."""
        return None if self.steps <= 0 else self.model_busy_s / self.steps


def overhead_between(before: dict[str, float] | None, after: dict[str, float] | None) -> Overhead | None:
    """The counters' growth; None where /metrics lacks them (another runtime behind --url)."""
    if before is None or after is None or any(name not in after for name in OVERHEAD_METRICS):
        return None
    return Overhead(*(after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTER_METRICS))


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


@dataclass(frozen=True)
class LoopRun:
    """One tp-runtime server at one concurrency: a step loop (OVERLAP or SERIAL), a variant of it
    with other flags, or another tree's runtime (BASELINE)."""

    loop: str
    side: SideResult
    overhead_fraction: float | None
    control_plane_share: float | None
    model_step_s: float | None
    # CPU time (all threads) of each of the server's processes per output token, by label
    # (launcher, frontend, rank0, ...), over this level; None for a server this run did not start.
    cpu_ms_per_token: dict[str, float] | None = None
    control_cpu_ms_per_token: float | None = None  # theirs, of every process that does not run the model
    # The frontend's share of it by thread name (its /metrics' tp_runtime_thread_cpu_seconds_total),
    # also behind --url; None where the server does not say. And how often each thread woke for it
    # (tp_runtime_thread_wakeups_total): on cores shared with the model each wake-up is a cold burst.
    thread_cpu_ms_per_token: dict[str, float] | None = None
    thread_wakeups_per_token: dict[str, float] | None = None
    prefix_hit_share: float | None = None
    # The median over the level's requests, every round's, of each request's TPOT over bench_model's
    # batch-1 step timed right before and after its round's level (the mean of the two), and those
    # steps, one a round; None where the step was not timed around it (only concurrency 1 is).
    tpot_over_bench_step: float | None = None
    bench_steps_s: tuple[float, ...] | None = None


def loop_run(
    loop: str, side: SideResult, overhead: Overhead | None, cpu_ms_per_token: dict[str, float] | None = None,
    thread_cpu_ms_per_token: dict[str, float] | None = None,
    thread_wakeups_per_token: dict[str, float] | None = None,
    tpot_over_bench_step: float | None = None,
    bench_steps_s: tuple[float, ...] | None = None,
) -> LoopRun:  # fmt: skip
    return LoopRun(
        loop=loop,
        side=side,
        overhead_fraction=None if overhead is None else _round(overhead.fraction),
        control_plane_share=None if overhead is None else _round(overhead.control_plane_share),
        model_step_s=None if overhead is None else _round(overhead.model_step_s, 6),
        cpu_ms_per_token=cpu_ms_per_token,
        control_cpu_ms_per_token=None if cpu_ms_per_token is None else round(
            sum(ms for label, ms in cpu_ms_per_token.items() if not label.startswith("rank")), 4
        ),
        thread_cpu_ms_per_token=thread_cpu_ms_per_token,
        thread_wakeups_per_token=thread_wakeups_per_token,
        prefix_hit_share=None if overhead is None else _round(overhead.prefix_hit_share),
        tpot_over_bench_step=tpot_over_bench_step,
        bench_steps_s=bench_steps_s,
    )


@dataclass(frozen=True)
class LevelReport:
    concurrency: int
    runs: tuple[LoopRun, ...]  # the first is the one compared with the reference
    reference: SideResult | None
    throughput_ratio: float | None  # runs[0] / reference
    ttft_ratio: float | None  # runs[0] / reference: below 1 is better
    tpot_ratio: float | None
    agreement: float | None  # mean share of greedy output tokens equal to the reference's, in order
    overlap_speedup: float | None  # serial TPOT / overlapped TPOT (medians), where both ran
    overlap_throughput_gain: float | None  # overlapped tokens/s / serial tokens/s

    @property
    def runtime(self) -> SideResult:
        return self.runs[0].side

    def run(self, loop: str) -> LoopRun | None:
        return next((r for r in self.runs if r.loop == loop), None)


def level_report(concurrency: int, runs: Sequence[LoopRun], reference: SideResult | None, agreement: float | None) -> LevelReport:
    first = runs[0].side
    on = next((r.side for r in runs if r.loop == OVERLAP), None)
    off = next((r.side for r in runs if r.loop == SERIAL), None)
    both = on is not None and off is not None
    return LevelReport(
        concurrency=concurrency,
        runs=tuple(runs),
        reference=reference,
        throughput_ratio=ratio(first.tokens_per_s, reference.tokens_per_s) if reference else None,
        ttft_ratio=ratio(first.ttft_median_s, reference.ttft_median_s) if reference else None,
        tpot_ratio=ratio(first.tpot_median_s, reference.tpot_median_s) if reference else None,
        agreement=agreement,
        overlap_speedup=ratio(off.tpot_median_s, on.tpot_median_s) if both else None,
        overlap_throughput_gain=ratio(on.tokens_per_s, off.tokens_per_s) if both else None,
    )


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float | None:
    """Mean over requests of the common prefix length over the output length."""
    pairs = [(x, y) for x, y in zip(a, b) if x and y]
    if not pairs:
        return None
    shares = []
    for x, y in pairs:
        same = 0
        for p, q in zip(x, y):
            if p != q:
                break
            same += 1
        shares.append(same / max(len(x), len(y)))
    return round(sum(shares) / len(shares), 4)


def check_targets(levels: Sequence[LevelReport], model_step_s: float | None = None) -> list[dict[str, object]]:
    """Each target that this run's levels measure, with its verdict."""
    verdicts: list[dict[str, object]] = []
    for level in levels:
        if level.reference is not None and level.concurrency in REFERENCE_TARGETS:
            wanted, got = REFERENCE_TARGETS[level.concurrency], level.throughput_ratio
            verdicts.append({
                "target": f"tokens/s >= {wanted}x the reference at concurrency {level.concurrency}",
                "value": got, "met": got is not None and got >= wanted,
            })
        overlapped = level.run(OVERLAP)
        if overlapped is None:
            continue
        if level.concurrency == 1:
            tpot = tpot_over_step(overlapped, model_step_s)
            if tpot is not None:
                got, basis = tpot
                verdicts.append({
                    "target": f"overlapped TPOT at concurrency 1 <= {TPOT_OVER_MODEL_STEP_MAX}x bench_model's batch-1 step {basis}",
                    "value": got, "met": got <= TPOT_OVER_MODEL_STEP_MAX,
                })
        cpu_cap = CONTROL_CPU_MS_PER_TOKEN_MAX.get(level.concurrency)
        if cpu_cap is not None and overlapped.control_cpu_ms_per_token is not None:
            got = overlapped.control_cpu_ms_per_token
            verdicts.append({
                "target": f"CPU of the processes that do not run the model <= {cpu_cap} ms per output token at concurrency {level.concurrency}",
                "value": got, "met": got <= cpu_cap,
            })
        if level.concurrency == 32 and overlapped.control_plane_share is not None:
            got = overlapped.control_plane_share
            verdicts.append({
                "target": f"model idle on the control plane < {CONTROL_PLANE_SHARE_MAX:.0%} of step time at concurrency 32",
                "value": got, "met": got < CONTROL_PLANE_SHARE_MAX,
            })
    return verdicts


STEP_AROUND, STEP_OF_RUN = "timed around its level", "of the run"  # what the TPOT target was held against


def tpot_over_step(run: LoopRun, model_step_s: float | None) -> tuple[float, str] | None:
    """A run's TPOT over bench_model's batch-1 step, and which step: the one timed around its own
    level where there is one (a slow spell of the host slows both alike), else the run's."""
    if run.tpot_over_bench_step is not None:
        return run.tpot_over_bench_step, STEP_AROUND
    if not model_step_s or run.side.tpot_median_s is None:
        return None
    return round(run.side.tpot_median_s / model_step_s, 3), STEP_OF_RUN


def write_plot(levels: Sequence[LevelReport], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: list[tuple[str, list[SideResult | None]]] = [
        (f"tp-runtime ({loop})", [level.run(loop).side if level.run(loop) else None for level in levels])
        for loop in dict.fromkeys(run.loop for level in levels for run in level.runs)
    ]
    if any(level.reference for level in levels):
        series.append(("transformers", [level.reference for level in levels]))
    labels = [str(level.concurrency) for level in levels]
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = (
        ("Output tokens/s", lambda s: s.tokens_per_s),
        ("Time to first token, median (s)", lambda s: s.ttft_median_s),
        ("Time per output token, median (ms)", lambda s: None if s.tpot_median_s is None else s.tpot_median_s * 1000),
    )
    for ax, (title, value) in zip(axes, panels):
        for k, (name, sides) in enumerate(series):
            offsets = [i - 0.4 + width * (k + 0.5) for i in range(len(levels))]
            ax.bar(offsets, [(value(s) or 0) if s else 0 for s in sides], width, label=name)
        ax.set_xticks(list(range(len(levels))), labels)
        ax.set(title=title, xlabel="concurrency")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=60)
    plt.close(fig)


def print_summary(report: dict, out: Path) -> None:
    def fmt(v: float | None, scale: float = 1.0, spec: str = ".3f") -> str:
        return "-" if v is None else format(v * scale, spec)

    config = report["config"]
    temperature = config.get("temperature", 0.0)
    sampling = "greedy" if not temperature else f"temperature {temperature}, top_p {config.get('top_p', 1.0)}"
    if config.get("logprobs") is not None:
        sampling += f", {config['logprobs']} alternatives a token"
    lines = [f"serving benchmark: {report['target']['name']} ({config['dtype']}), "
             f"{config['input_len']} in / {config['output_len']} out tokens, {sampling}"]
    if report.get("model_step_s"):
        slices = report.get("model_step_slices_s") or [report["model_step_s"]]
        lines.append(
            f"bench_model batch-1 step in this run: {report['model_step_s'] * 1000:.2f} ms median of {len(slices)} "
            f"slices ({min(slices) * 1000:.2f}-{max(slices) * 1000:.2f})"
        )
    lines.append(
        f"{'conc':>4} {'server':>8} {'tok/s':>9} {'TTFT med':>9} {'TPOT med':>9} {'TPOT p99':>9} {'ITL p99':>9} {'idle':>6} "
        f"{'model step':>10} {'ctl CPU/tok':>11}"
    )
    for level in report["levels"]:
        rows = [
            (run["loop"], run["side"], run["control_plane_share"], run["model_step_s"], run["control_cpu_ms_per_token"])
            for run in level["runs"]
        ]
        if level["reference"]:
            rows.append(("ref", level["reference"], None, None, None))
        for loop, side, share, step, cpu in rows:
            lines.append(
                f"{level['concurrency']:>4} {loop:>8} {side['tokens_per_s']:>9.1f} {fmt(side['ttft_median_s']):>9} "
                f"{fmt(side['tpot_median_s'], 1000, '.2f'):>7}ms {fmt(side['tpot_p99_s'], 1000, '.2f'):>7}ms "
                f"{fmt(side.get('itl_p99_s')):>9} "
                f"{fmt(share, 100, '.1f'):>5}% {fmt(step, 1000, '.2f'):>8}ms {fmt(cpu, 1, '.3f'):>9}ms"
            )
        for run in level["runs"]:
            threads = run.get("thread_cpu_ms_per_token")
            if threads:
                shares = ", ".join(f"{name} {ms:.3f}" for name, ms in sorted(threads.items(), key=lambda kv: -kv[1]) if ms >= 0.0005)
                lines.append(f"{'':>14}{run['loop']} frontend threads, CPU ms/token: {shares}")
            wakeups = run.get("thread_wakeups_per_token")
            if wakeups:
                counts = ", ".join(f"{name} {n:.3f}" for name, n in sorted(wakeups.items(), key=lambda kv: -kv[1]) if n >= 0.0005)
                lines.append(f"{'':>14}{run['loop']} frontend threads, wake-ups/token: {counts}")
            around = run.get("tpot_over_bench_step")
            if around is not None:
                steps = run["bench_steps_s"]
                lines.append(
                    f"{'':>14}{run['loop']}: TPOT {around:.3f}x bench_model's batch-1 step {STEP_AROUND} "
                    f"({min(steps) * 1e3:.2f}-{max(steps) * 1e3:.2f} ms)"
                )
            hits = run.get("prefix_hit_share")
            if hits is not None and hits >= PREFIX_HIT_SHARE_NOTED:
                lines.append(
                    f"{'':>14}{run['loop']}: the prefix cache served {hits:.0%} of the prompt tokens: the prompts "
                    "repeat what the server saw (give a rerun against one server its own --seed)"
                )
        if level["overlap_speedup"] is not None:
            lines.append(f"{'':>14}overlap: TPOT {level['overlap_speedup']:.3f}x faster, tokens/s {level['overlap_throughput_gain']:.3f}x")
    for t in report["targets"]:
        lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']}")
    load = report["load_average"]
    lines.append(f"load average (1/5/15 min) at start {load['start']}, at end {load['end']}, on {os.cpu_count()} CPUs")
    lines.append(f"report: {out / 'report.json'}, plot: {out / 'bench.png'}")
    sys.stderr.write("\n".join(lines) + "\n")
