"""The soak's verdicts: each check passes on a clean run and fails on the miss it exists for."""

import json

import pytest

from scripts.harness.client import CompletionRequest, StreamResult
from scripts.harness.metrics import (
    M_ABORTS,
    M_CACHED,
    M_CLEARED,
    M_EVICTIONS,
    M_FREE,
    M_MARKED,
    M_OFFLOADS,
    M_PREEMPTED,
    M_PREEMPTIONS,
    M_REJECTS,
    M_RESTORES,
    M_RUNNING,
    M_STEPS,
    M_USED,
    M_WAITING,
    MetricsSample,
)
from scripts.harness.metrics import M_EXECUTOR_RESTARTS
from scripts.soak_checks import (
    CHECKS,
    Comparison,
    check_run,
    compare_greedy,
    first_difference,
    judge_difference,
    rss_verdict,
    token_at,
)
from scripts.soak_report import request_rows, summarize, write_plots
from scripts.soak_workload import RunRecord, SoakRequest, outcome_of

MIB = 1 << 20
CLEAN_METRICS = {
    M_RUNNING: 0.0,
    M_WAITING: 0.0,
    M_PREEMPTED: 0.0,
    M_USED: 16.0,
    M_FREE: 80.0,
    M_CACHED: 16.0,
    M_MARKED: 30.0,
    M_CLEARED: 500.0,
    M_PREEMPTIONS: 7.0,
    M_OFFLOADS: 40.0,
    M_RESTORES: 40.0,
    M_EVICTIONS: 12.0,
    M_STEPS: 300.0,
    M_REJECTS: 0.0,
    M_ABORTS: 0.0,
}


def finished(index: int, tokens: list[int], t0: float = 100.0) -> StreamResult:
    r = StreamResult(t_sent=t0, response_ids={f"cmpl-{index}"}, token_ids=list(tokens), text="x" * len(tokens))
    r.chunks = len(tokens)
    r.finish_reason = "length"
    r.done_markers = 1
    r.t_first, r.t_last, r.t_end = t0 + 0.5, t0 + 0.5 + 0.1 * (len(tokens) - 1), t0 + 2.0
    r.token_times = [t0 + 0.5 + 0.1 * i for i in range(len(tokens))]
    return r


def soak_request(index: int, greedy: bool = True) -> SoakRequest:
    request = CompletionRequest(prompt_ids=(1, 2, 3), max_tokens=4, temperature=0.0 if greedy else 0.8, seed=None if greedy else 5)
    return SoakRequest(index=index, kind="long" if index % 2 == 0 else "short", system_prompt=None, request=request)


def clean_record(n: int = 4) -> RunRecord:
    record = RunRecord(t0=100.0, warmup_end=1.0, final_metrics=dict(CLEAN_METRICS))
    for i in range(n):
        record.requests.append(soak_request(i))
        record.results[i] = finished(i, [10 + i, 11, 12, 13])
    record.metrics = [MetricsSample(t=0.5 * k, values={**CLEAN_METRICS, M_STEPS: 10.0 * k, M_CLEARED: 15.0 * k}) for k in range(6)]
    record.rss = {"rank0": [(0.5 * k, 500 * MIB) for k in range(6)], "rank1": [(0.5 * k, 400 * MIB) for k in range(6)]}
    return record


def flat_rss() -> list:
    return [rss_verdict("rank0", [(0.5, 500 * MIB), (2.0, 501 * MIB), (3.0, 500 * MIB)], 1.0, 48.0)]


def verdicts(record, comparisons=(), rss=None, swap_space=True, faults=None):
    checks = check_run(record, list(comparisons), flat_rss() if rss is None else rss, swap_space=swap_space, faults=faults)
    return {c.name: c for c in checks}


def test_a_clean_run_passes_every_check():
    checks = verdicts(clean_record(), [Comparison(index=0, identical=True)])
    assert all(c.passed for c in checks.values()), [c for c in checks.values() if not c.passed]
    assert list(checks) == list(CHECKS)


def test_a_stream_without_an_end_is_lost():
    record = clean_record()
    record.results[2].finish_reason = None
    record.results[3].error = "lost: no end of stream within 600 s"
    checks = verdicts(record)
    assert not checks["accounted"].passed
    assert [m.split(":")[0] for m in checks["accounted"].misses] == ["#2", "#3"]


def test_cancelled_by_the_client_is_accounted_for():
    record = clean_record()
    record.results[1].finish_reason = None
    record.results[1].done_markers = 0
    record.results[1].cancelled = True
    checks = verdicts(record)
    assert checks["accounted"].passed and checks["answered_once"].passed
    assert outcome_of(record.results[1]) == "cancelled"


@pytest.mark.parametrize("damage", ["two ids", "two done", "after finish", "shared id"])
def test_a_request_answered_twice_fails(damage):
    record = clean_record()
    r = record.results[1]
    if damage == "two ids":
        r.response_ids.add("cmpl-other")
    elif damage == "two done":
        r.done_markers = 2
    elif damage == "after finish":
        r.after_finish = 1
    else:
        r.response_ids = {"cmpl-0"}
    assert not verdicts(record)["answered_once"].passed


def test_non_finite_logits_fail_two_checks_with_the_reason():
    record = clean_record()
    record.results[0].error = "the logits of this request were not finite (NaN or inf)"
    record.results[2].error = "HTTP 503: the runtime is draining"
    checks = verdicts(record)
    assert not checks["no_failures"].passed and len(checks["no_failures"].misses) == 2
    assert not checks["logits_finite"].passed
    assert checks["logits_finite"].misses == ("#0: the logits of this request were not finite (NaN or inf)",)


def test_missing_token_ids_fail_the_token_ids_check():
    record = clean_record()
    record.results[1].token_ids = []
    assert not verdicts(record)["token_ids"].passed


def test_divergence_fails_but_a_near_tie_is_counted_and_passes():
    near = Comparison(index=0, identical=False, position=3, near_tie=True)
    far = Comparison(index=1, identical=False, position=5, soak_token=7, reference_token=9, near_tie=False)
    assert verdicts(clean_record(), [near])["greedy_reference"].passed
    check = verdicts(clean_record(), [near, far])["greedy_reference"]
    assert not check.passed and check.misses[0].startswith("#1: position 5")
    assert "1 near-ties, 1 diverged" in check.detail


def test_the_deterministic_reference_is_exact_with_no_near_tie_class():
    """tolerance None (the soak's default, both servers --deterministic): a difference anywhere
    diverges, without asking the reference model how close the two tokens were."""
    requests = [soak_request(0), soak_request(1)]
    results = {0: finished(0, [5, 6, 7]), 1: finished(1, [5, 6, 8])}
    reference = {0: finished(0, [5, 6, 7]), 1: finished(1, [5, 6, 9])}
    comparisons = compare_greedy(requests, results, reference, eos=2, model="unused", dtype="bf16", tolerance=None)
    assert [c.identical for c in comparisons] == [True, False]
    assert (comparisons[1].position, comparisons[1].soak_token, comparisons[1].reference_token) == (2, 8, 9)
    check = verdicts(clean_record(2), comparisons)["greedy_reference"]
    assert not check.passed and "1 identical, 0 near-ties, 1 diverged" in check.detail


@pytest.mark.parametrize("name", [M_REJECTS, M_ABORTS])
def test_a_reject_or_abort_in_metrics_fails(name):
    record = clean_record()
    record.final_metrics[name] = 1.0
    assert not verdicts(record)["no_rejects_aborts"].passed


def test_pages_still_used_after_the_run_fail_drained():
    record = clean_record()
    record.final_metrics[M_USED] = 19.0  # 16 of them are prefix snapshot pages: 3 still held by a request
    check = verdicts(record)["drained"]
    assert not check.passed and check.misses == ("request pages (kv_pages_used - kv_pages_cached) = 3.0",)


def test_a_run_without_pressure_proves_nothing():
    record = clean_record()
    record.final_metrics[M_RESTORES] = 0.0
    assert not verdicts(record)["pressure"].passed
    assert verdicts(record, swap_space=False)["pressure"].passed  # restores are only due with swap space
    record.final_metrics[M_PREEMPTIONS] = 0.0
    assert not verdicts(record, swap_space=False)["pressure"].passed


def test_unreadable_metrics_fail_rather_than_pass():
    record = clean_record()
    record.final_metrics = None
    checks = verdicts(record)
    assert not checks["no_rejects_aborts"].passed and not checks["drained"].passed


def test_rss_growth_after_warmup_beyond_tolerance_fails():
    steady = [(t, (600 if t < 5 else 590) * MIB) for t in range(20)]
    leak = [(t, (500 + 5 * t) * MIB) for t in range(20)]
    assert rss_verdict("rank0", steady, 5.0, 48.0).flat
    verdict = rss_verdict("rank1", leak, 5.0, 48.0)
    assert not verdict.flat and verdict.growth_mib == 70.0 and verdict.slope_mib_per_min == pytest.approx(300.0)
    assert not verdicts(clean_record(), rss=[verdict])["rss_flat"].passed
    assert not verdicts(clean_record(), rss=[])["rss_flat"].passed
    few = rss_verdict("rank0", [(1.0, MIB), (6.0, MIB)], 5.0, 48.0)
    assert not few.flat and "too few samples" in few.note
    assert "too few samples" in verdicts(clean_record(), rss=[few])["rss_flat"].misses[0]


def test_first_difference_and_the_token_chosen_there():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert token_at([1, 2], 2, "stop", eos=99) == 99
    assert token_at([1, 2], 2, "length", eos=99) is None
    assert token_at([1, 2], 1, "stop", eos=99) == 2


def test_near_tie_needs_both_tokens_within_tolerance_of_the_best():
    logits = [0.0] * 10
    logits[4], logits[7], logits[2] = 12.0, 11.8, 9.0
    tie = judge_difference(0, 3, soak_token=7, reference_token=4, logits=logits, tolerance=0.5)
    assert tie.near_tie and tie.top2 == ((4, 12.0), (7, 11.8)) and tie.gap_soak == pytest.approx(0.2)
    assert not judge_difference(0, 3, soak_token=2, reference_token=4, logits=logits, tolerance=0.5).near_tie
    assert not judge_difference(0, 3, soak_token=7, reference_token=4, logits=logits, tolerance=0.1).near_tie
    assert not judge_difference(0, 3, soak_token=None, reference_token=4, logits=logits, tolerance=0.5).near_tie


def test_summary_rows_and_plots(tmp_path):
    record = clean_record(6)
    record.requests.append(soak_request(6, greedy=False))
    record.results[6] = finished(6, [1, 2])
    comparisons = [Comparison(index=i, identical=True) for i in range(5)] + [Comparison(index=5, identical=False, near_tie=True)]
    summary = summarize(record, comparisons, elapsed_s=2.0)
    assert summary["requests"] == 7 and summary["completed"] == 7 and summary["output_tokens"] == 26
    assert summary["output_tokens_per_s"] == 13.0 and summary["near_ties"] == 1 and summary["identical"] == 5
    assert summary["tpot_s"]["median"] == pytest.approx(0.1)
    rows = request_rows(record, comparisons)
    assert [row["reference"] for row in rows] == ["identical"] * 5 + ["near-tie", None]
    json.dumps(rows)
    png = tmp_path / "soak.png"
    write_plots(record, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000


def test_fault_mode_takes_failures_that_name_a_rank_and_counts_the_restarts():
    record = clean_record()
    record.results[1].error = "the connection of rank 1 on host vm closed: its process ended"
    record.results[1].finish_reason = None
    record.final_metrics = {**CLEAN_METRICS, M_EXECUTOR_RESTARTS: 2.0}
    checks = verdicts(record, faults=2)
    assert checks["no_failures"].passed and checks["recovered"].passed, checks
    assert not verdicts(record, faults=3)["recovered"].passed  # a kill without its restart
    assert not verdicts(record)["recovered"].passed  # a restart in a run that killed nothing
    assert not verdicts(record)["no_failures"].passed  # without fault mode a failure is a miss
    record.results[2].error = "HTTP 503: the runtime is draining"
    record.results[2].finish_reason = None
    assert not verdicts(record, faults=2)["no_failures"].passed  # fault mode, but no rank named
