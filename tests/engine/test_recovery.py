"""The engine's side of recovery (tp_runtime/recovery.py), with fake ranks and a fake group source:
which requests fail when a group dies, which wait for the next, the recovery deadline, the crash
loop, the totals /metrics keeps across groups; and the parts on their own (the window, the broker's
claims, the death causes)."""

from __future__ import annotations

import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from protocol.auth import new_key
from protocol.transport import SchedulerEndpoint, ipc_address
from scheduler.request import RequestOutput, SamplingParams
from tests.server.fake_rank import GEOMETRY, MAX_MODEL_LEN, FakeRank, fake_scheduler
from tp_runtime.bootstrap import Bootstrap, BootstrapRequest, request_bootstrap
from tp_runtime.config import RuntimeConfig
from tp_runtime.engine import Engine, EngineTimeouts, EngineUnavailable
from tp_runtime.group_broker import BootstrapServer, DeathReport, GroupBroker
from tp_runtime.recovery import CrashLoop, Fault, GroupDeath, Recovery, RecoveryPolicy, RestartWindow, carry_totals

pytestmark = pytest.mark.timeout(120)


class FakeGroups:
    """A GroupSource whose groups are FakeRanks the test starts: `start_rank(restart)` is what a
    group's rank 0 claiming its bootstrap would do."""

    def __init__(self) -> None:
        self.wake: Callable[[], None] = lambda: None
        self.groups: list[tuple[SchedulerEndpoint, bytes, str]] = []
        self.ranks: list[FakeRank] = []
        self.killed: list[int] = []
        self.deaths: list[DeathReport] = []
        self.claimed: int | None = None

    def open_group(self) -> SchedulerEndpoint:
        key, run_id = new_key(), uuid.uuid4().hex
        endpoint = SchedulerEndpoint(ipc_address(), key, run_id)
        self.groups.append((endpoint, key, run_id))
        self.claimed = None
        return endpoint

    def start_rank(self, restart: int, step_delay_s: float = 0.02) -> FakeRank:
        endpoint, key, run_id = self.groups[-1]
        self.claimed = restart
        rank = FakeRank(endpoint.address, key, run_id, 7, step_delay_s)
        rank.start()
        self.ranks.append(rank)
        return rank

    def claimed_restart(self) -> int | None:
        return self.claimed

    def kill(self, restart: int) -> None:
        self.killed.append(restart)

    def take_deaths(self) -> list[DeathReport]:
        deaths, self.deaths = self.deaths, []
        return deaths

    def wait_death(self, restart: int, timeout_s: float) -> DeathReport | None:
        return DeathReport(restart, ((0, -signal.SIGKILL),))

    def report(self, death: DeathReport) -> None:
        self.deaths.append(death)
        self.wake()


@contextmanager
def recovering_engine(policy: RecoveryPolicy, groups: FakeGroups) -> Iterator[Engine]:
    engine = Engine(
        scheduler=fake_scheduler(), endpoint=groups.open_group(), world_size=1, model_name="fake", max_model_len=MAX_MODEL_LEN,
        timeouts=EngineTimeouts(handshake_s=60), recovery=Recovery(groups, policy),
    )  # fmt: skip
    groups.start_rank(0)
    engine.start()
    try:
        engine.wait_ready(20)
        yield engine
    finally:
        engine.shutdown("test over")
        for rank in groups.ranks:
            rank.vanish.set()
            rank.join(timeout=20)
        engine.close()
        for endpoint, _, _ in groups.groups:
            endpoint.close()


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def first_event(stream) -> RequestOutput:  # noqa: ANN001 (RequestStream)
    return next(iter(stream))


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_a_dead_group_fails_its_requests_keeps_the_untouched_ones_and_serves_again() -> None:
    groups = FakeGroups()
    with recovering_engine(RecoveryPolicy(max_restarts=3), groups) as engine:
        running = [engine.submit([5, 6, 7 + i], params(200)) for i in range(GEOMETRY.max_num_seqs)]
        for stream in running:
            assert first_event(stream).token_ids  # every slot runs
        untouched = engine.submit([10, 11, 12], params(4))  # waits for a slot: no step has taken it
        steps_before = engine.stats().scheduler.steps_total
        groups.ranks[0].vanish.set()
        for stream in running:
            events = list(stream)
            assert events[-1].finish_reason == "error" and events[-1].fault == Fault.RANK_FAILURE, events[-1]
            assert "rank 0" in events[-1].error, events[-1].error
        assert not engine.health().ok and "restarting the executor group" in engine.health().reason
        wait_until(lambda: groups.killed == [0])
        assert engine.retry_after_s() is not None
        held = engine.submit([13, 14], params(3))  # arrives during the recovery: waits in the queue
        wait_until(lambda: len(groups.groups) == 2)  # the new group's endpoint, under a new run id and key
        assert groups.groups[0][2] != groups.groups[1][2] and groups.groups[0][1] != groups.groups[1][1]
        groups.start_rank(1)
        for stream, tokens in ((untouched, 4), (held, 3)):
            events = list(stream)
            assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == tokens, events
        assert engine.health().ok and engine.retry_after_s() is None
        stats = engine.stats()
        assert stats.executor_restarts_total == 1 and stats.recovery_time is not None and stats.recovery_time.count == 1
        assert stats.scheduler.steps_total > steps_before  # carried across groups, not started again from 0


def test_requests_waiting_past_the_recovery_timeout_fail_and_new_ones_are_refused_with_a_retry() -> None:
    groups = FakeGroups()
    with recovering_engine(RecoveryPolicy(max_restarts=3, recovery_timeout_s=0.5), groups) as engine:
        groups.ranks[0].vanish.set()
        wait_until(lambda: not engine.health().ok)
        held = engine.submit([5, 6], params(3))
        event = first_event(held)
        assert event.fault == Fault.RECOVERY_TIMEOUT and "--recovery-timeout" in event.error, event
        with pytest.raises(EngineUnavailable) as refused:
            engine.submit([5, 6], params(3))
        assert refused.value.retry_after_s is not None
        groups.start_rank(1)
        wait_until(lambda: engine.health().ok)
        assert list(engine.submit([5, 6], params(2)))[-1].finish_reason == "length"


def test_groups_that_keep_dying_end_the_engine_naming_each_death() -> None:
    groups = FakeGroups()
    with recovering_engine(RecoveryPolicy(max_restarts=1, window_s=600), groups) as engine:
        groups.ranks[0].vanish.set()
        wait_until(lambda: len(groups.groups) == 2)
        groups.report(DeathReport(1, ((1, -signal.SIGKILL), (0, -signal.SIGTERM))))  # died before its handshake
        wait_until(lambda: engine.failed)
        reason = engine.health().reason
        assert "died 2 times within 600 s" in reason and "rank 1 was killed by SIGKILL" in reason, reason
        assert "rank 0 was killed by SIGTERM" not in reason  # the agent's own stop of the others
        with pytest.raises(EngineUnavailable):
            engine.submit([5], params(1))


def test_the_window_forgets_deaths_older_than_it() -> None:
    now = [0.0]
    window = RestartWindow(RecoveryPolicy(max_restarts=2, window_s=100), clock=lambda: now[0])
    for t in (0.0, 50.0, 120.0, 160.0):  # never more than 2 within 100 s
        now[0] = t
        window.record(GroupDeath(0, t, f"at {t}"))
    now[0] = 170.0
    with pytest.raises(CrashLoop, match="died 3 times within 100 s"):
        window.record(GroupDeath(0, 170.0, "again"))


def test_totals_carry_over_and_gauges_do_not() -> None:
    from scheduler.stats import SchedulerStats

    def stats(running: int, steps: int) -> SchedulerStats:
        return SchedulerStats(running, 0, 0, 10, 5, 0, 0, 3, 0, 0, 0, 0, steps, 0)

    carried = carry_totals(stats(4, 100), stats(1, 7))
    assert carried.steps_total == 107 and carried.pages_cleared_total == 6 and carried.running == 1


def test_the_broker_gives_each_group_its_own_keys_and_a_new_group_replaces_an_old_claim() -> None:
    ours, theirs = socket.socketpair()
    broker = GroupBroker(ours, RuntimeConfig(model="m"))
    server = BootstrapServer(broker)
    server.start()
    try:
        first = broker.open_group()
        got = Bootstrap.unpack(request_bootstrap(server.path, BootstrapRequest(0), timeout_s=10))
        assert (got.run_id, got.address) == (first.run_id, first.address) and broker.claimed_restart() == 0
        woken = []
        broker.wake = lambda: woken.append(1)
        # Restart 1 asks while restart 0 holds the group: 0 is dead, and 1 waits for the next group.
        second: list[Bootstrap] = []
        asked = threading.Thread(target=lambda: second.append(Bootstrap.unpack(request_bootstrap(server.path, BootstrapRequest(1), 10))))
        asked.start()
        wait_until(lambda: bool(woken))
        assert [d.restart for d in broker.take_deaths()] == [0]
        opened = broker.open_group()
        asked.join(10)
        assert second[0].run_id == opened.run_id != first.run_id and second[0].key_hex != got.key_hex
        broker.kill(1)
        assert theirs.recv(100) == b'{"kill": 1}\n'
        first.close()
        opened.close()
    finally:
        server.close()
        broker.close()
        ours.close()
        theirs.close()


def test_a_death_on_another_host_is_said_to_be_there():
    # Node 0's agent restarts its ranks when another host's agent re-enters the rendezvous: its
    # report holds no exit of its own, and the cause points the operator to the other host.
    assert "another host" in DeathReport(2, ()).cause()
    assert DeathReport(2, ((1, -signal.SIGKILL), (0, -signal.SIGTERM))).cause() == "rank 1 was killed by SIGKILL"
