"""The soak's report: report.json (summary, pressure, RSS, checks, every request), timeline.json
(every /metrics and RSS sample) and soak.png (docs/reports.md explains each panel).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from scripts.harness.metrics import (
    M_ABORTS,
    M_CACHED,
    M_CANCELS,
    M_CLEARED,
    M_EVICTIONS,
    M_FREE,
    M_MARKED,
    M_OFFLOADS,
    M_PREEMPTIONS,
    M_REJECTS,
    M_RESTORES,
    M_STEPS,
    M_USED,
)
from scripts.harness.output import percentile, write_json
from scripts.soak_checks import MIB, Check, Comparison, RssVerdict, check_passed
from scripts.soak_workload import RunRecord, outcome_of


def build_report(
    args: argparse.Namespace,
    *,
    model: str,
    server_argv: list[str],
    max_request_tokens: int,
    started_at: str,
    load_before: tuple[float, float, float],
    wall_s: float,
    server_exit_code: int | None,
    record: RunRecord,
    comparisons: Sequence[Comparison],
    rss: Sequence[RssVerdict],
    checks: Sequence[Check],
    elapsed_s: float,
) -> dict[str, object]:
    detected = not check_passed(checks, "logits_finite") or not check_passed(checks, "greedy_reference")
    return {
        "kind": "soak",
        "mode": "negative-control" if args.skip_clears else "soak",
        "passed": detected if args.skip_clears else all(c.passed for c in checks),
        "damage_detected": detected,
        "started_at": started_at,
        # Other work on the machine skews every number here: the 1/5/15-minute load averages.
        "load_average": {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]},
        "wall_s": round(wall_s, 1),
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
            "model": model,
            "server_argv": server_argv,
            "max_request_tokens": max_request_tokens,
        },
        "server_exit_code": server_exit_code,
        "summary": summarize(record, comparisons, elapsed_s),
        "pressure": pressure_counts(record.final_metrics),
        "rss": [asdict(v) for v in rss],
        "checks": [asdict(c) for c in checks],
        "near_ties": [asdict(c) for c in comparisons if c.near_tie],
        "divergences": [asdict(c) for c in comparisons if not c.identical and not c.near_tie],
        "requests": request_rows(record, comparisons),
    }


def write_report(report: dict[str, object], record: RunRecord, out: Path) -> None:
    write_json(out / "report.json", report)
    write_json(
        out / "timeline.json",
        {"metrics": [asdict(s) for s in record.metrics], "rss": record.rss, "warmup_end_s": record.warmup_end},
    )
    write_plots(record, out / "soak.png")


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

