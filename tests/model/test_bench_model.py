"""bench_model's options reach the steps it times: a run on a tiny checkpoint, read back as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def test_context_and_mixed_step_are_the_ones_asked_for(tmp_path: Path) -> None:
    """With a prompt longer than the decodes' context: the cache must hold the mixed step's tables."""
    model = write_tiny_llama(tmp_path / "tiny")
    done = subprocess.run(
        [sys.executable, "scripts/bench_model.py", "--json", "--model", str(model), "--formats", "fp32",
         "--batches", "1,2", "--steps", "2", "--compile", "off", "--context", "40", "--mixed", "3,900"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["context_tokens"] == 40
    (result,) = report["formats"]
    assert [d["batch"] for d in result["decode"]] == [1, 2]
    assert (result["mixed_decodes"], result["mixed_prompt"]) == (3, 900)
    assert result["mixed_ms"] > 0 and all(d["step_ms"] > 0 for d in result["decode"])


@pytest.mark.parametrize("value", ["3", "a,b", "3,1", "-1,20"])
def test_a_malformed_mixed_step_is_refused_with_a_sentence(value: str) -> None:
    done = subprocess.run(
        [sys.executable, "scripts/bench_model.py", "--mixed", value], cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 2 and "--mixed" in done.stderr, done.stderr


def test_slices_time_the_steps_asked_for_on_demand(tmp_path: Path) -> None:
    """bench_serving's ModelStepProbe keeps this process loaded and asks for a slice around each level."""
    model = write_tiny_llama(tmp_path / "tiny")
    process = subprocess.Popen(
        [sys.executable, "scripts/bench_model.py", "--slices", "--model", str(model), "--formats", "fp32",
         "--compile", "off", "--context", "40"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = process.communicate("2\n3\n0\n", timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    answers = [json.loads(line) for line in out.splitlines()]
    assert answers[0] == {"ready": True}
    assert [a["steps"] for a in answers[1:]] == [2, 3] and all(a["step_s"] > 0 for a in answers[1:])
    assert process.returncode != 0 and "at least one step" in err  # a slice of no steps is refused


@pytest.mark.parametrize("extra", [["--formats", "fp32,bf16"], ["--baseline", "/nowhere"]])
def test_slices_are_of_one_format_of_this_tree(extra: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "scripts/bench_model.py", "--slices", *extra], cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 2 and "--slices times one format" in done.stderr, done.stderr
