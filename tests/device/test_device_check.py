"""What of scripts/device_check.sh runs without a GPU: the plan and its budgets, the orchestration
(a part that fails, prints a failure, or runs past its budget fails the check), the set-up's refusal
to touch a machine without a GPU, and the checks' own logic and use of the runtime's API on the CPU."""

from __future__ import annotations

import io
import json
import sys
import time

import pytest

from scripts import device_check, device_decode, device_runtime, device_setup
from scripts.device_check import Part, plan, run

PY = sys.executable


def fake(name: str, code: str, budget_s: float = 20) -> Part:
    return Part(name, (PY, "-c", code), budget_s, f"fake part {name}")


def test_the_plan_fits_in_eight_minutes_and_names_scripts_that_exist() -> None:
    parts = plan()
    assert [p.name for p in parts][0] == "setup"
    assert len({p.name for p in parts}) == len(parts)
    assert sum(p.budget_s for p in parts) <= device_check.TOTAL_BUDGET_S < 8 * 60
    for part in parts:
        scripts = [arg for arg in part.argv if arg.endswith(".py") or arg.startswith("tests/")]
        assert scripts and all((device_check.REPO / s).exists() for s in scripts), part


def run_fake(parts: list[Part], total_s: float = 60) -> tuple[int, list[dict]]:
    out = io.StringIO()
    code = run(parts, total_s, env={"PATH": "/usr/bin:/bin"}, out=out)
    return code, [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


def test_every_part_passing_passes() -> None:
    code, lines = run_fake([fake("setup", "print('{\"ok\": true}')"), fake("a", "print('{\"x\": 1, \"ok\": true}')")])
    assert code == 0
    assert lines[-1]["summary"] == {"setup": "ok", "a": "ok"} and lines[-1]["ok"] is True


def test_a_failed_line_an_exit_code_or_a_timeout_each_fail_the_check() -> None:
    started = time.monotonic()
    code, lines = run_fake(
        [
            fake("setup", "pass"),
            fake("says_failed", "print('{\"section\": \"s\", \"ok\": false}')"),
            fake("exits_1", "import sys; sys.exit(1)"),
            fake("too_slow", "import time; print('started', flush=True); time.sleep(60)", budget_s=1.5),
            fake("fine", "pass"),
        ]
    )
    assert time.monotonic() - started < 20, "the slow part was not killed at its budget"
    assert code == 1
    summary = lines[-1]
    assert summary["summary"] == {"setup": "ok", "says_failed": "FAILED", "exits_1": "FAILED", "too_slow": "FAILED", "fine": "ok"}
    slow = next(line for line in lines if line.get("part") == "too_slow" and "failures" in line)
    assert "budget" in slow["failures"][0]


def test_a_failed_set_up_skips_the_rest_and_no_device_is_exit_2() -> None:
    code, lines = run_fake([fake("setup", "import sys; sys.exit(2)"), fake("a", "pass")])
    assert code == device_check.EXIT_NO_DEVICE
    assert lines[-1]["skipped"] == ["a"] and lines[-1]["ok"] is False


def test_the_whole_call_has_one_deadline() -> None:
    started = time.monotonic()
    code, _ = run_fake([fake("setup", "import time; time.sleep(30)", budget_s=30)], total_s=1.5)
    assert code == 1 and time.monotonic() - started < 15


def test_set_up_installs_nothing_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if device_setup.has_nvidia_gpu():
        pytest.skip("this machine has a GPU")
    assert device_setup.main() == 2
    assert "nothing installed" in capsys.readouterr().out
    assert device_setup.cuda_python_requirement("12.8") == "cuda-python>=12,<13"
    assert device_setup.cuda_python_requirement("13.0") == "cuda-python>=13,<14"


def test_decode_on_the_cpu_runs_the_same_code_and_its_failures_are_real(capsys: pytest.CaptureFixture[str]) -> None:
    assert device_decode.main(["--shape", "tiny", "--device", "cpu", "--batches", "1", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["batch"] for r in rows if r["section"] == "decode"] == [1, 2]
    assert all(r["bytes_per_step"] > 0 and r["eager_tok_s"] > 0 for r in rows if r["section"] == "decode")
    assert device_decode.hbm_fraction(4_800_000_000, 1000.0, 4.8e9) == pytest.approx(1.0)
    assert device_decode.decode_failures(1, 1.0, 0.0, 0.9) == []
    assert device_decode.decode_failures(16, 1.0, 0.0, 0.1) == []  # the floor is batch 1's
    assert "HBM" in device_decode.decode_failures(1, 1.0, 0.0, 0.3)[0]
    assert "agrees" in device_decode.decode_failures(1, 0.9, 0.0, None)[0]
    assert device_decode.decode_failures(1, 1.0, float("nan"), None)


def test_the_clear_checks_run_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from scripts import device_check_clear

    assert device_check_clear.main(["--device", "cpu"]) == 0
    sections = [json.loads(line)["section"] for line in capsys.readouterr().out.splitlines()]
    assert sections.count("clear_pages") == 4 and "offload" in sections


def answer(text: str | None, tokens: tuple[int, ...] = (), error: str | None = None) -> device_runtime.Answer:
    return device_runtime.Answer("p", 200 if text is not None else 500, text, error, tokens)


def test_the_runtime_checks_compare_what_they_claim() -> None:
    clean = [answer("a b", (1, 2)), answer("c", (3,))]
    assert device_runtime.answers_match(clean, [answer("a b", (1, 2)), answer("c", (3,))]) == []
    assert device_runtime.answers_match(clean, [answer("a b", (1, 2)), answer("c", (4,))])  # same text, other tokens
    assert device_runtime.answers_match(clean, [answer("a b", (1, 2)), answer(None, error="not finite")])
    assert device_runtime.poison_detected([answer(None, error="logits were not finite")]) == []
    assert device_runtime.poison_detected([answer("!!!!", (9, 9))])  # text from a poisoned cache
    assert device_runtime.poison_detected([answer(None, error="connection refused")])  # failed, but not detected
    assert device_runtime.agreement([answer("x", (1, 2, 3, 4))], [answer("y", (1, 2, 9, 4))]) == 0.5
    assert device_runtime.agreement(clean, clean) == 1.0
