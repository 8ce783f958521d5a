"""The launcher's view of its children (tp_runtime.launcher.live_children), which the stragglers'
watch and the stop path act on: every child, whichever thread started it, and no other process.
The suite's process may hold other children (servers of session fixtures): the tests look at
their own."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from tp_runtime import launcher


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for child in started:
        child.kill()
        child.wait()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_every_child_is_found_whichever_thread_started_it(children: list[subprocess.Popen]) -> None:
    children.append(_sleeper())
    # A child of a thread that has ended: the kernel hands it to a thread still running.
    thread = threading.Thread(target=lambda: children.append(_sleeper()))
    thread.start()
    thread.join()
    expected = {child.pid for child in children}
    found = launcher.live_children()
    assert expected <= set(found)
    parents = (launcher._stat_fields(pid) for pid in found)
    assert all(fields is None or fields[1] == str(os.getpid()) for fields in parents)  # None: it just ended
    assert all(found[pid] in "RSD" for pid in expected)


def test_an_exited_child_not_yet_reaped_is_not_live(children: list[subprocess.Popen]) -> None:
    child = subprocess.Popen(["true"])
    children.append(_sleeper())
    # A zombie until waited for: poll its state until it has exited, without reaping it.
    deadline = time.monotonic() + 30
    while launcher.process_state(child.pid) != "Z":
        assert time.monotonic() < deadline, "the child did not exit within 30 s"
        time.sleep(0.01)
    found = launcher.live_children()
    assert children[0].pid in found and child.pid not in found
    child.wait()
