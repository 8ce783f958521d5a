"""torchrun's agent as the launcher runs it (tp_runtime/supervisor.py `observed_agent`): what its
stop adds to torch's."""

from __future__ import annotations

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
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda self, death_sig, timeout: stopped.append(death_sig))
    agent_class = observed_agent(None)
    agent = agent_class.__new__(agent_class)
    handler = Handler()
    agent._pcontext = None
    agent._worker_group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=handler))
    agent._shutdown()
    assert len(stopped) == 1 and handler.heartbeats_stopped == 1

