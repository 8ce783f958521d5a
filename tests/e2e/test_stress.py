"""scripts/stress.py against a live TP=2 server of the tiny model: every adversarial case answered as
it must be, every normal stream beside it correct, /health 200 after each, streams with random
disconnects leaving nothing running, the HTTP fuzzer without a 5xx, and the SIGTERM drain cutting
long streams with an error event and [DONE]. The short form; the long form (both fuzzers long,
SIGSTOP and kill -9 of each process on fresh servers) is `slow`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import stress


def run_stress(tiny_model: Path, out: Path, *extra: str) -> tuple[int, dict]:
    code = stress.main(["--model", str(tiny_model), "--out", str(out), *extra])
    return code, json.loads((out / "report.json").read_text())


KNOWN_GAPS: set[str] = set()  # cases expected to fail until their fix lands (none now)


def check(code: int, report: dict) -> None:
    missed = [case for case in report["cases"] if not case["passed"]]
    assert [case for case in missed if case["name"] not in KNOWN_GAPS] == [], json.dumps(missed, indent=1)
    names = {case["name"] for case in report["cases"]}
    assert names == {case.name for case in stress.CASES} | {stress.MANY_STREAMS, "SIGTERM drain"}
    for case in report["cases"]:
        normal = case["normal"]
        streams = report["disconnect_streams"] if case["name"] == stress.MANY_STREAMS else report["normal_streams_per_case"]
        assert normal["correct"] + normal["cancelled"] == normal["streams"] == streams
    assert set(report["rss_mib"]["start"]) == {"rank0", "rank1", "frontend"}
    frames = report["frame_fuzz"]
    assert frames is None or (frames["mutations"] > 0 and frames["good_tokens_after"] == frames["good_tokens_before"])
    assert [fault["name"] for fault in report["faults"]] in ([], [f"{sig.name} {target}" for sig, target in stress.FAULTS])
    for fault in report["faults"]:
        assert fault["ended_with_error"] == fault["streams"] and fault["lost"] == [] and fault["port"] == "free", fault
    gaps = [case["name"] for case in missed]
    if gaps:
        assert code == 1 and not report["passed"]
        pytest.xfail(f"known gaps: {gaps}")
    assert code == 0 and report["passed"]


@pytest.mark.timeout(300)
def test_the_short_stress_run_passes_every_case(tiny_model: Path, tmp_path: Path) -> None:
    check(*run_stress(tiny_model, tmp_path, "--short"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_long_stress_run_passes_every_case(tiny_model: Path, tmp_path: Path) -> None:
    check(*run_stress(tiny_model, tmp_path))
