"""scripts/bench_wakeup.py's measurement of what an idle costs the thread that comes back from it."""

from __future__ import annotations

from scripts.bench_wakeup import after_idle, idle_driver


def test_the_work_after_an_idle_is_timed_after_a_sleep_and_after_a_spin() -> None:
    report = after_idle(count=8, gap_s=0.0005, blocks=2)
    assert set(report) == {"after_sleep_us", "after_spin_us"}
    for times in report.values():
        assert 0 < times["median"] <= times["p90"]


def test_the_idle_driver_is_read_from_sys_or_left_unsaid() -> None:
    idle = idle_driver()
    assert set(idle) == {"driver", "governor", "guest_halt_poll_ns"}
    assert all(value is None or (isinstance(value, str) and value) for value in idle.values())
