"""How the launcher's threads stop torchrun's agent (tp_runtime/agent_stop.py) and watch for the end
of the service across hosts (tp_runtime/service_end.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from tp_runtime import service_end
from tp_runtime.agent_stop import AgentStop


@pytest.fixture
def sigints() -> Iterator[list[int]]:
    """The SIGINTs this process receives while the test runs."""
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def store() -> dist.TCPStore:
    """A rendezvous store as node 0's launcher hosts it."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def test_the_agent_is_stopped_once_while_it_runs(sigints: list[int]) -> None:
    agent = AgentStop()
    assert agent.stop() and not agent.stop()
    assert sigints == [signal.SIGINT] and agent.sent


def test_no_sigint_once_the_agent_has_returned(sigints: list[int]) -> None:
    # A SIGINT then would raise in the launcher's finishing code, not in the agent.
    agent = AgentStop()
    agent.returned()
    assert not agent.stop() and not agent.sent
    assert sigints == []


def test_a_host_sees_the_end_of_the_service_and_ends_its_launch(store: dist.TCPStore) -> None:
    ended = threading.Event()
    watch = service_end.EndWatch("127.0.0.1", store.port, ended.set)
    try:
        assert service_end.announce(store, 3, others=1, timeout_s=30.0)
        assert ended.wait(30.0) and watch.code == 3
    finally:
        watch.finish()


def test_node_0_stops_waiting_for_a_host_that_never_looks(store: dist.TCPStore) -> None:
    assert not service_end.announce(store, 0, others=1, timeout_s=0.3)
    assert store.get(service_end.END_KEY) == b"0"


WATCH_THEN_EXIT = """
import sys
import time
from datetime import timedelta
import torch.distributed as dist
from tp_runtime import service_end
service_end.POLL_S = 0.0  # the watch is inside a store call nearly all the time
master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
watch = service_end.EndWatch("127.0.0.1", master.port, lambda: None)
time.sleep(0.2)  # connected, and polling
if sys.argv[1] == "finish":
    watch.finish()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("finish", ["finish", "leave"])
def test_a_launcher_leaves_only_after_its_watch_has(finish: str) -> None:
    # The watch polls the store from a daemon thread. A launcher that exited while it was inside a
    # store call aborted at interpreter exit ("terminate called without an active exception", -6:
    # node 0 of tests/e2e/test_multinode.py's drain, once in CI). Leaving without finish() is
    # shown to abort, so that the test tells the two apart.
    codes = []
    for _ in range(2 if finish == "finish" else 3):
        done = subprocess.run([sys.executable, "-c", WATCH_THEN_EXIT, finish], capture_output=True, text=True, timeout=120)
        codes.append(done.returncode)
        if finish == "finish":
            assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr
        elif done.returncode == -signal.SIGABRT:
            break
    if finish == "leave":
        assert -signal.SIGABRT in codes
