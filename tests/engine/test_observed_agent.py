"""torchrun's agent as the launcher runs it (tp_runtime/supervisor.py `observed_agent`): what its
stop adds to torch's, and its looks at the ranks on one host, which wait for a rank to exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from tp_runtime import supervisor
from tp_runtime.supervisor import RankExits, observed_agent


class Handler:
    """A rendezvous handler with a keep-alive timer, as torch's c10d one has (a handler without one,
    say a static rendezvous, is passed over)."""

    def __init__(self) -> None:
        self.heartbeats_stopped = 0

    def _stop_heartbeats(self) -> None:
        self.heartbeats_stopped += 1


def test_the_agents_stop_stops_the_rendezvous_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's launcher skips the handler's shutdown after a signal; a timer left running joined its
    # own thread when the handler was freed there ("cannot join current thread" in a host's log at
    # the end of a drain across hosts, tests/e2e/test_multinode.py).
    stopped: list[object] = []
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda self, death_sig, timeout=30: stopped.append(death_sig))
    agent_class = observed_agent(None)
    agent = agent_class.__new__(agent_class)
    handler = Handler()
    agent._pcontext = None
    agent._worker_group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=handler))
    agent._shutdown()
    assert len(stopped) == 1 and handler.heartbeats_stopped == 1



@pytest.mark.parametrize("torch_version", ["2.11", "2.13"])
def test_the_agents_stop_calls_torchs_stop_as_its_run_does(monkeypatch: pytest.MonkeyPatch, torch_version: str) -> None:
    # torch 2.11's run() calls _shutdown(sig) and _shutdown(), and its _shutdown takes no timeout;
    # 2.13's passes timeout= and takes it. The device check's server crashed at its stop on 2.11
    # ("takes from 1 to 2 positional arguments but 3 were given") while the override passed both.
    received: list[tuple[object, ...]] = []
    if torch_version == "2.11":

        def base(self, death_sig=signal.SIGTERM):  # noqa: ANN001, ANN202
            received.append((death_sig,))

        calls = [((signal.SIGTERM,), {}), ((), {})]
    else:

        def base(self, death_sig=signal.SIGTERM, timeout=30):  # noqa: ANN001, ANN202
            received.append((death_sig, timeout))

        calls = [((signal.SIGINT,), {"timeout": 7}), ((), {"timeout": 9})]
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", base)
    agent_class = observed_agent(None)
    agent = agent_class.__new__(agent_class)
    agent._pcontext = None
    agent._worker_group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=Handler()))
    for args, kwargs in calls:
        agent._shutdown(*args, **kwargs)
    expected = [(signal.SIGTERM,), (signal.SIGTERM,)] if torch_version == "2.11" else [(signal.SIGINT, 7), (signal.SIGTERM, 9)]
    assert received == expected


class Waiting:
    """A rendezvous handler with another host in its wait list."""

    def num_nodes_waiting(self) -> int:
        return 1


@pytest.mark.parametrize("hosts, waiting", [(1, 0), (2, 1)])
def test_only_a_launch_across_hosts_asks_who_waits_to_join(monkeypatch: pytest.MonkeyPatch, hosts: int, waiting: int) -> None:
    # torch's agent asks at every look at its ranks; a host of its own asks a store nobody else can
    # join (and a stranger that joined it would restart the group).
    monkeypatch.setattr(LocalElasticAgent, "__init__", lambda self, spec, *args, **kwargs: None)
    spec = SimpleNamespace(rdzv_handler=Waiting())
    observed_agent(None, hosts)(spec)
    assert spec.rdzv_handler.num_nodes_waiting() == waiting


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _waited(exits: RankExits, pids: list[int], timeout_s: float) -> float:
    started = time.monotonic()
    exits.wait(pids, timeout_s)
    return time.monotonic() - started


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's")
def test_rank_exits_waits_until_a_rank_exits_and_leaves_its_exit_code_to_read(child: subprocess.Popen) -> None:
    exits = RankExits()
    try:
        assert _waited(exits, [child.pid], 0.3) >= 0.25  # running: the whole timeout
        killer = threading.Timer(0.2, child.kill)
        killer.start()
        assert _waited(exits, [child.pid], 30) < 10  # woken by the exit, not by the timeout
        killer.join()
        assert _waited(exits, [child.pid], 30) < 10  # exited: at once, however often it is asked
        assert child.wait(timeout=10) == -signal.SIGKILL  # not reaped by the wait
    finally:
        exits.close()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's")
def test_rank_exits_returns_at_once_for_a_rank_reaped_already_and_closes_its_descriptors(child: subprocess.Popen) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    fds_before = len(os.listdir("/proc/self/fd"))
    exits = RankExits()
    assert _waited(exits, [child.pid, gone.pid], 30) < 10
    exits.wait([child.pid], 0.01)  # a new group: the old descriptors go, the new one is opened
    assert len(os.listdir("/proc/self/fd")) == fds_before + 1
    exits.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before


class Processes:
    def __init__(self, pids: list[int]) -> None:
        self._pids = pids

    def pids(self) -> dict[int, int]:
        return dict(enumerate(self._pids))


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's")
@pytest.mark.parametrize("hosts", [1, 2])
def test_a_one_host_agent_looks_again_when_a_rank_exits_not_five_times_a_second(
    monkeypatch: pytest.MonkeyPatch, child: subprocess.Popen, hosts: int
) -> None:
    looks: list[float] = []

    def torch_look(self, worker_group):  # noqa: ANN001, ANN202
        looks.append(time.monotonic())
        return RunResult(state=WorkerState.HEALTHY if child.poll() is None else WorkerState.FAILED)

    monkeypatch.setattr(LocalElasticAgent, "__init__", lambda self, spec, *args, **kwargs: None)
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", torch_look)
    monkeypatch.setattr(supervisor, "QUIET_LOOK_S", 30.0)
    agent = observed_agent(None, hosts)(SimpleNamespace(rdzv_handler=Waiting()))
    agent._pcontext = Processes([child.pid])
    try:
        assert agent._monitor_workers(None).state == WorkerState.HEALTHY  # the first look: at once
        killer = threading.Timer(0.3, child.kill)
        started = time.monotonic()
        killer.start()
        result = agent._monitor_workers(None)
        killer.join()
        if hosts == 1:  # waited for the exit, then torch's look found it
            assert 0.25 <= looks[-1] - started < 10 and result.state == WorkerState.FAILED
        else:  # across hosts torch's cadence: the look is at once
            assert looks[-1] - started < 0.25
    finally:
        if agent._exits is not None:
            agent._exits.close()
