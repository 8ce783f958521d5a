"""The soak's verdicts: each check passes on a clean run and fails on the miss it exists for.

Greedy outputs are compared with a TP=1 reference run of the same prompts. In the deterministic
mode (the default, docs/invariance.md) they must be identical: any difference is a divergence.
Without it, where they first differ, the reference model's logits there tell a near-tie (both
tokens within a tolerance of the best: bf16 reductions at TP=2 may pick either) from a divergence. RSS must stay flat after warm-up, and
/metrics must show that the run did what it claims: preemption, eviction, offload and clears.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from scripts.harness.client import StreamResult
from scripts.harness.metrics import (
    M_ABORTED_STEPS,
    M_ABORTS,
    M_CACHED,
    M_CLEARED,
    M_EVICTIONS,
    M_EXECUTOR_RESTARTS,
    M_OFFLOADS,
    M_PREEMPTED,
    M_PREEMPTIONS,
    M_REJECTS,
    M_REQUEST_REJECTS,
    M_RESTORES,
    M_RUNNING,
    M_USED,
    M_WAITING,
)
from scripts.soak_workload import RunRecord, SoakRequest, outcome_of

CHECKS = (
    "accounted",  # every request completed, was cancelled by us, or failed with a stated reason
    "answered_once",  # one stream per request: one id, one end, nothing after the finish
    "no_failures",  # no request failed; in fault mode, none but with an error that names a rank
    "recovered",  # one executor group restart per rank killed in fault mode, none without
    "logits_finite",  # no request failed for non-finite logits
    "token_ids",  # the server returned the token ids the comparison needs
    "greedy_reference",  # greedy outputs equal the TP=1 reference, or differ at a near-tie
    "rss_flat",  # no rank's (nor the frontend's) RSS grows after warm-up beyond the tolerance
    "no_rejects_aborts",  # /metrics counted no REJECT and no ABORT
    "drained",  # afterwards nothing runs or waits and every page is free or cached
    "pressure",  # the run did what it claims: preemption, eviction, offload/restore, clears
)
NON_FINITE = re.compile(r"finite|nan", re.IGNORECASE)
NAMES_A_RANK = re.compile(r"\brank \d+")
MIB = 1 << 20


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


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    misses: tuple[str, ...] = ()


def check_run(
    record: RunRecord,
    comparisons: Sequence[Comparison],
    rss: Sequence[RssVerdict],
    *,
    swap_space: bool,
    prefix_caching: bool = True,
    faults: int | None = None,
) -> list[Check]:
    """The checks of CHECKS, in that order. faults: the ranks killed in fault mode (None: no fault
    mode); then a failure with an error naming a rank is an outcome, not a miss."""
    results = [(r, record.results[r.index]) for r in record.requests]
    stream_checks = _stream_checks(results, faults is not None)
    return [
        *stream_checks[:3],
        _recovered_check(record.final_metrics, faults or 0),
        *stream_checks[3:],
        _reference_check(comparisons),
        _rss_check(rss),
        *_metrics_checks(record.final_metrics, swap_space=swap_space, prefix_caching=prefix_caching),
    ]


def _recovered_check(final: dict[str, float] | None, faults: int) -> Check:
    restarts = None if final is None else final.get(M_EXECUTOR_RESTARTS, 0.0)
    return Check(
        "recovered",
        restarts == faults,
        f"{faults} ranks killed, {restarts} executor groups restarted",
        () if restarts == faults else (f"{M_EXECUTOR_RESTARTS} = {restarts}, kills = {faults}",),
    )


def _stream_checks(results: Sequence[tuple[SoakRequest, StreamResult]], fault_mode: bool = False) -> list[Check]:
    """What the client saw: every request accounted for, answered once, none failed (in fault
    mode: none but with an error naming the rank that failed)."""
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
    unexplained = [(r, res) for r, res in failed if not (fault_mode and NAMES_A_RANK.search(res.error or ""))]
    explained = f", {len(failed) - len(unexplained)} with an error naming the rank that failed" if fault_mode else ""
    checks.append(
        Check(
            "no_failures", not unexplained, f"{len(failed)} failed{explained}",
            tuple(f"#{r.index}: {res.error}" for r, res in unexplained),
        )
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
    return checks


def _reference_check(comparisons: Sequence[Comparison]) -> Check:
    diverged = [c for c in comparisons if not c.identical and not c.near_tie]
    near = [c for c in comparisons if c.near_tie]
    return Check(
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


def _rss_check(rss: Sequence[RssVerdict]) -> Check:
    grown = [
        f"{v.label}: {v.note}" if v.note else f"{v.label}: +{v.growth_mib} MiB after warm-up (slope {v.slope_mib_per_min} MiB/min)"
        for v in rss
        if not v.flat
    ]
    return Check(
        "rss_flat",
        bool(rss) and not grown,
        "; ".join(f"{v.label} {v.warmup_peak_mib}->{v.after_peak_mib} MiB" for v in rss) or "no rank RSS was sampled",
        tuple(grown),
    )


def _metrics_checks(final: dict[str, float] | None, *, swap_space: bool, prefix_caching: bool) -> list[Check]:
    """What /metrics counted by the end: no REJECT or ABORT, nothing left over, the pressure claimed."""
    if final is None:
        unreadable = "/metrics was not readable at the end of the run"
        return [Check(name, False, unreadable) for name in ("no_rejects_aborts", "drained", "pressure")]
    checks: list[Check] = []
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


def compare_greedy(
    requests: Sequence[SoakRequest],
    results: dict[int, StreamResult],
    reference: dict[int, StreamResult],
    *,
    eos: int,
    model: str,
    dtype: str,
    tolerance: float | None,
) -> list[Comparison]:
    """Each greedy output against the reference's. tolerance None (the deterministic mode): exact,
    every difference diverges. Else a difference is judged on the logits of the runtime's own model
    at TP=1 (scripts/reference.py) at the first differing position."""
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
    if pending and tolerance is None:
        for r, position in pending:
            soak, ref = results[r.index], reference[r.index]
            comparisons.append(
                Comparison(
                    index=r.index,
                    identical=False,
                    position=position,
                    soak_token=token_at(soak.token_ids, position, soak.finish_reason, eos),
                    reference_token=token_at(ref.token_ids, position, ref.finish_reason, eos),
                )
            )
    elif pending:
        from scripts.reference import OfflineReference

        offline = OfflineReference(model, dtype)
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
                    tolerance,
                )
            )
    return sorted(comparisons, key=lambda c: c.index)


class SoakError(RuntimeError):
    """The soak could not run to its checks (the reference run failed, the server did not start)."""


def check_passed(checks: Sequence[Check], name: str) -> bool:
    return next(c.passed for c in checks if c.name == name)
