"""torchrun's agent as the launcher runs it (tp_runtime/supervisor.py `observed_agent`): what its
stop adds to torch's."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from tp_runtime.supervisor import observed_agent


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
