"""scripts/bench_step.py's step-loop measurement: it runs the real executors over the real protocol
and reports what it says it does, for both fake forwards and more rows than one page of tables."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from scripts.bench_step import (
    DECODE_SEQS,
    PAGE_SIZE,
    REAL_FORWARD,
    REPO,
    LoopSpec,
    STAMP_COLUMNS,
    SimulatedDevice,
    StampedModel,
    _LoopDriver,
    bench_geometry,
    COMPARED_RUN_ENV,
    compare_trees,
    decode_prepare,
    frame_gaps,
    loop_argv,
    measure_loop,
    message_costs,
    paired,
    sampler_missing,
    steady_frame_costs,
)
from executor.link import link_thread_name
from protocol.validate import validate_prepare


@pytest.mark.parametrize(
    ("forward", "steady", "readback"),
    [
        ("sleep", "continue", "at-once"), ("gil", "continue", "at-once"), ("sleep", "prepare", "at-once"),
        ("device", "continue", "at-once"), ("device", "continue", "pipelined"),
    ],
)  # fmt: skip
def test_the_loop_measurement_reports_every_phase(forward: str, steady: str, readback: str) -> None:
    steps = 12
    spec = LoopSpec(world_size=1, steps=steps, rows=4, forward_ms=2.0, forward=forward, steady=steady, readback=readback)
    report = measure_loop(spec)
    assert report["steps"] == steps - min(10, steps // 4)
    for phase in ("forward_gap_us", "model_idle_us", "go_to_all_done_us"):
        assert 0 <= report[phase]["median"] <= report[phase]["p90"], phase
    # A lone rank receives each steady step while the one before runs: its READY rides in that
    # step's RESULT, so few steps, if any, are answered by a READY of their own. On a loaded machine
    # the link may not have checked a step yet when the answer it would ride in goes out (a CI run
    # read 4 of 9): the best of three runs shows the riding.
    shares = [report["ready_in_result_share"]]
    while max(shares) < 0.5 and len(shares) < 3:
        shares.append(measure_loop(spec)["ready_in_result_share"])
    assert max(shares) >= 0.5, shares
    alone = report["prepare_to_all_ready_us"]
    assert alone is None or 0 <= alone["median"] <= alone["p90"]
    # A step holds its forward (2 ms) and then some: the stamps are the forwards' own.
    assert report["median_step_us"] >= 2000
    # Rank 0's two threads apart, each of them a share of the rank's whole CPU.
    cpu = report["cpu_us_per_step"]
    assert 0 < cpu["rank0_link_thread"] < cpu["rank0"] and 0 < cpu["rank0_model_thread"] < cpu["rank0"]


def test_frames_of_several_forwards_report_the_gaps_inside_and_between_them() -> None:
    steps, forwards = 8, 4
    report = measure_loop(LoopSpec(world_size=1, steps=steps, rows=4, forward_ms=2.0, forwards=forwards))
    assert report["steps"] == steps - min(10, steps // 4)
    for phase in ("forward_gap_us", "forward_gap_within_frame_us", "forward_gap_between_frames_us"):
        assert 0 <= report[phase]["median"] <= report[phase]["p90"], phase
    assert report["median_step_us"] >= forwards * 2000  # every forward of a frame ran


def test_gaps_split_into_those_inside_a_frame_and_those_between_two() -> None:
    # Frames of 3 from forward 0: gaps follow forwards 3..9, those after 5 and 8 end a frame.
    gaps = np.arange(3, 10, dtype=np.float64)
    within, between = frame_gaps(gaps, 3, 3)
    assert between.tolist() == [5, 8] and within.tolist() == [3, 4, 6, 7, 9]
    within, between = frame_gaps(gaps, 3, 1)
    assert within.size == 0 and between.tolist() == gaps.tolist()


def test_the_loop_measures_the_gap_around_the_default_models_real_forward() -> None:
    steps = 8
    report = measure_loop(LoopSpec(world_size=1, steps=steps, rows=2, forward=REAL_FORWARD))
    assert report["steps"] == steps - min(10, steps // 4)
    gap = report["forward_gap_us"]
    assert 0 <= gap["median"] <= gap["p90"]
    # The model's thread computes a real forward (a fake one sleeps, ~0.1 ms of CPU a step): a
    # decode of SmolLM2's 30 layers is milliseconds of it even shared with a busy machine.
    assert report["cpu_us_per_step"]["rank0_model_thread"] > 2000


@pytest.mark.parametrize("rows", [DECODE_SEQS, 256])
def test_steady_decode_steps_are_valid_for_the_geometry(rows: int) -> None:
    g = bench_geometry(rows)
    for step, steady in ((1, False), (2, True), (200, True)):
        p = decode_prepare(step, rows, steady=steady)
        validate_prepare(p, g)
        assert bool(p.feedback.all()) is steady and p.page_table.shape[0] == (0 if steady else rows * 8)


def test_the_message_costs_compare_both_layouts_of_both_frames_in_both_settings() -> None:
    report = message_costs(repeats=20)
    for frame in ("ready", "prepare_16"):
        for layout in ("3_parts", "1_message"):
            for beside in ("alone", "beside_torch_ops"):
                for stat in ("mean", "median"):
                    assert report.pop(f"{frame}_{layout}_{beside}_{stat}_us") > 0
    assert report == {}


@pytest.mark.parametrize(("rows", "forwards"), [(DECODE_SEQS, 1), (256, 1), (DECODE_SEQS, 4), (DECODE_SEQS, PAGE_SIZE)])
def test_steady_steps_go_as_continues_until_the_pages_are_full(rows: int, forwards: int) -> None:
    g = bench_geometry(rows)
    driver = _LoopDriver(endpoint=None, world_size=1, max_inflight=2, rows=rows, steady="continue", forwards=forwards)
    frames = PAGE_SIZE // forwards  # a page's frames
    briefs = []
    for step in range(1, 2 + 3 * frames):
        body, brief = driver.next_step(step)
        validate_prepare(body, g)
        briefs.append(brief is not None)
        assert bool(body.feedback.all()) is (step > 1)
        assert body.decode_steps == forwards
    # The first step and every frames-th after it go whole: the context starts again.
    assert briefs == [False] + ([True] * (frames - 1) + [False]) * 3
    whole = _LoopDriver(endpoint=None, world_size=1, max_inflight=2, rows=rows, steady="prepare")
    assert not any(whole.next_step(step)[1] is not None for step in range(1, 20))


def test_the_frame_costs_time_both_ways_of_sending_a_steady_step() -> None:
    report = steady_frame_costs(rows=4, repeats=3)
    assert set(report) == {
        f"{kind}_{what}_us" for kind in ("prepare", "continue") for what in ("encode", "decode", "validate")
    } | {"continue_expand_us"}
    assert all(value > 0 for value in report.values())


def test_the_simulated_device_runs_one_forward_at_a_time_and_a_sample_lands_when_its_forward_ends(monkeypatch) -> None:
    import numpy as np
    import torch

    from executor import steps
    from executor.sampler import SampleOutput

    monkeypatch.setattr(steps._Readback, "start", steps._Readback.__dict__["start"])  # restored after the test
    device = SimulatedDevice(forward_s=0.05)
    first, second = device.queue_forward(), device.queue_forward()
    assert second[0] == first[1]  # queued behind it
    assert second[1] - second[0] == pytest.approx(0.05) and first[1] - first[0] == pytest.approx(0.05)
    device.read_back_behind()
    out = SampleOutput(torch.tensor([7, 9]), torch.zeros(2), torch.ones(2, dtype=torch.bool))
    readback = steps._Readback.start(None, out)  # the orders alike: behind the device's clock
    assert not readback.landed()
    host = readback.take()
    assert readback.landed() and time.perf_counter() >= second[1]
    assert host.tokens.tolist() == [7, 9] and np.array_equal(host.finite, [1, 1])


def test_a_forward_s_stamps_cost_its_own_span_not_the_gap_after_it() -> None:
    # The gap is measured from a forward's end stamp: the CPU clocks and the row's store come
    # before the forward, and after its end only the end itself is written.
    class Inner:
        fingerprint, config, shard, span = "inner", None, None, None

        def __init__(self) -> None:
            self.seen: list[np.ndarray] = []
            self.ran: list[tuple[float, float]] = []

        def forward(self, inputs: object, cache: object) -> None:
            if len(self.ran) < len(stamps):
                self.seen.append(stamps[len(self.ran)].copy())
            began = time.perf_counter()
            time.sleep(0.001)
            self.ran.append((began, time.perf_counter()))

    stamps = np.full((2, len(STAMP_COLUMNS)), np.nan)
    inner, release = Inner(), threading.Event()
    link = threading.Thread(target=release.wait, name=link_thread_name(0))
    link.start()
    try:
        model = StampedModel(inner, stamps, rank=0)
        for _ in range(3):  # one more than the stamps hold: it is run, not stamped
            model.forward(None, None)
    finally:
        release.set()
        link.join()
    start, end = STAMP_COLUMNS.index("start"), STAMP_COLUMNS.index("end")
    for row, seen, (began, ended) in zip(stamps, inner.seen, inner.ran):
        assert np.isnan(seen).tolist() == [column == "end" for column in STAMP_COLUMNS]  # all but the end, before it
        assert row[start] <= began and row[end] >= ended
    assert model.forwards == 3 and len(inner.ran) == 3


def test_a_baseline_s_loop_takes_this_run_s_options_less_the_comparison_s_own() -> None:
    argv = ["--loop-only", "--ranks", "1,2", "--baseline", "/tmp/x", "--rounds=4", "--json", "--rows=16", "--forward-ms", "5"]
    assert loop_argv(argv) == ["--ranks", "1,2", "--rows=16", "--forward-ms", "5"]
    assert loop_argv(["--baseline=/tmp/x", "--rounds", "2", "--steps", "9"]) == ["--steps", "9"]


def test_the_rounds_are_compared_in_pairs() -> None:
    def run(gap: float, p90: float, ready: float | None) -> dict[str, dict]:
        ready_us = None if ready is None else {"median": ready, "p90": ready}
        return {"overlap/2/rows=16/sleep": {"forward_gap_us": {"median": gap, "p90": p90}, "prepare_to_all_ready_us": ready_us}}

    runs = {
        "this": [run(200, 400, 1000), run(180, 300, None), run(260, 500, 1100)],
        "baseline": [run(230, 380, 1200), run(170, 320, 900), run(300, 520, 1300)],
    }
    figures = paired(runs)["overlap/2/rows=16/sleep"]
    gap = figures["forward_gap_us.median"]
    assert gap["this"] == [200, 180, 260] and gap["baseline"] == [230, 170, 300]
    assert gap["this_median"] == 200 and gap["baseline_median"] == 230
    assert gap["difference_median"] == -30  # of -30, +10, -40
    assert figures["forward_gap_us.p90"]["difference_median"] == -20  # of +20, -20, -20
    ready = figures["prepare_to_all_ready_us.median"]  # the round without it is left out
    assert ready["this"] == [1000, 1100] and ready["difference_median"] == -200
    assert not any("frame" in figure for figure in figures)  # steps of one forward have no frames

    def framed(within: float, between: float) -> dict[str, dict]:
        case = run(200, 400, 1000)["overlap/2/rows=16/sleep"]
        case |= {"forward_gap_within_frame_us": {"median": within}, "forward_gap_between_frames_us": {"median": between}}
        return {"overlap/2/rows=16/sleep/forwards=16": case}

    frames = paired({"this": [framed(150, 400), framed(170, 420)], "baseline": [framed(210, 390), framed(230, 450)]})
    frames = frames["overlap/2/rows=16/sleep/forwards=16"]
    assert frames["forward_gap_within_frame_us.median"]["difference_median"] == -60
    assert frames["forward_gap_between_frames_us.median"]["difference_median"] == -10  # of +10, -30


def test_a_tree_is_compared_with_a_baseline_round_by_round() -> None:
    compared = compare_trees(["--ranks", "1", "--rows", "4", "--steps", "6", "--forward-ms", "1", "--modes", "overlap"], REPO, 2)
    assert compared["rounds"] == 2 and [len(runs) for runs in compared["runs"].values()] == [2, 2]
    gap = compared["paired"]["overlap/1/rows=4/sleep"]["forward_gap_us.median"]
    assert len(gap["this"]) == len(gap["baseline"]) == 2 and all(value >= 0 for value in gap["this"] + gap["baseline"])


def test_a_comparison_refuses_what_would_run_it_again_or_compare_two_samplers(tmp_path) -> None:
    def bench(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(REPO / "scripts" / "bench_step.py"), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ | env, check=False)

    # An abbreviation would reach the compared runs as an option of their own: a comparison each.
    abbreviated = bench("--loop-only", "--base", str(tmp_path / "absent"))  # taken for --baseline, it would be refused
    assert abbreviated.returncode == 2 and "unrecognized arguments: --base" in abbreviated.stderr
    nested = bench("--loop-only", "--baseline", str(REPO), **{COMPARED_RUN_ENV: "1"})
    assert nested.returncode == 2 and "a comparison started" in nested.stderr
    # A tree whose compiled sampler is not built samples otherwise than one whose is.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_step.py").write_text("")
    assert "executor from" in sampler_missing(tmp_path)  # not its own: the installed one's
    if sampler_missing(REPO) is None:
        with pytest.raises(RuntimeError, match="executor from .* where the other tree's is built"):
            compare_trees(["--ranks", "1"], tmp_path, 1)
