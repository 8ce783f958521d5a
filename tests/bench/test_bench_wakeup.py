"""scripts/bench_wakeup.py's measurement of what an idle costs the thread that comes back from it."""

from __future__ import annotations

from scripts.bench_wakeup import after_idle, idle_driver


def test_the_work_after_an_idle_is_timed_after_a_sleep_and_after_a_spin() -> None:
    # Two blocks of each kind, each of 4 timed turns after one left out: `count` timed of each.
    report = after_idle(count=8, gap_s=0.0005, blocks=2)
    assert set(report) == {"after_sleep_us", "after_spin_us"}
    for times in report.values():
        assert times["turns"] == 8
        assert 0 < times["median"] <= times["p90"]


def test_the_idle_driver_is_read_from_sys_or_left_unsaid(tmp_path) -> None:
    cpuidle = tmp_path / "devices" / "system" / "cpu" / "cpuidle"
    cpuidle.mkdir(parents=True)
    (cpuidle / "current_driver").write_text("haltpoll\n")
    (cpuidle / "current_governor").write_text("menu\n")
    assert idle_driver(str(tmp_path)) == {"driver": "haltpoll", "governor": "menu", "guest_halt_poll_ns": None}
    (cpuidle / "current_governor_ro").write_text("haltpoll\n")
    polling = tmp_path / "module" / "haltpoll" / "parameters"
    polling.mkdir(parents=True)
    (polling / "guest_halt_poll_ns").write_text("0\n")
    assert idle_driver(str(tmp_path)) == {"driver": "haltpoll", "governor": "haltpoll", "guest_halt_poll_ns": "0"}
    assert idle_driver(str(tmp_path / "absent")) == {"driver": None, "governor": None, "guest_halt_poll_ns": None}
