"""When a killed rank takes its peer down with it (the peer's collective fails and it exits), both
connections close within a millisecond and one liveness check sees both: the rank whose close was
seen first is named as the cause, the other follows it. A frame sent to a rank that died before the
monitor reported its connection closed fails that rank, not the engine."""

from __future__ import annotations

import time

import pytest

from protocol.errors import TransportError
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.protocol.conversation_helpers import running_scheduler
from tp_runtime.step_loop import EngineTimeouts, RankFailure, StepLoop


class ClosedInOrder:
    """The part of SchedulerEndpoint a liveness check reads: connections closed, in the order seen."""

    run_id = "closed-in-order"

    def __init__(self, closed: list[int]) -> None:
        self._closed = closed

    def disconnected_ranks(self) -> list[int]:
        closed, self._closed = self._closed, []
        return closed


def loop_over(endpoint: ClosedInOrder) -> StepLoop:
    config = SchedulerConfig(num_kv_pages=16, page_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    return StepLoop(
        scheduler=Scheduler(config), endpoint=endpoint, world_size=3, timeouts=EngineTimeouts(),  # type: ignore[arg-type]
        deliver=lambda outputs: None, on_scheduled=lambda plan: None,
    )  # fmt: skip


@pytest.mark.parametrize(("closed", "cause", "then"), [([1, 0], "rank 1", "rank 0"), ([2, 0, 1], "rank 2", "rank 0")])
def test_the_first_connection_seen_closing_is_named_as_the_cause(closed: list[int], cause: str, then: str) -> None:
    with pytest.raises(RankFailure) as failure:
        loop_over(ClosedInOrder(closed))._duties(time.monotonic())
    message = str(failure.value)
    assert message.startswith(f"the connection of {cause}") and "its process ended (then " in message, message
    assert message.index(cause) < message.index(then), message


def test_one_closed_connection_is_named_alone() -> None:
    with pytest.raises(RankFailure, match=r"^the connection of rank 1\b[^(]*closed: its process ended$"):
        loop_over(ClosedInOrder([1]))._duties(time.monotonic())


class Unreachable(ClosedInOrder):
    """A socket that can no longer reach rank 1 (ROUTER_MANDATORY's EHOSTUNREACH); its monitor
    reports the closed connection only after the first liveness check, or never."""

    def __init__(self, closed_later: list[int]) -> None:
        super().__init__([])
        self._later = closed_later

    def send_all(self, ranks: tuple[int, ...], body: object, step: int) -> None:
        self._closed, self._later = self._later, []
        raise TransportError(f"rank 1 is not connected to ipc://{self.run_id}")


@pytest.mark.parametrize(
    ("closed_later", "said"),
    [([1], r"^the connection of rank 1\b.*closed: its process ended$"), ([], r"^rank 1 is not connected .*its process has ended$")],
)
def test_a_send_to_a_rank_that_died_unseen_is_that_ranks_failure(closed_later: list[int], said: str) -> None:
    # The heartbeat is the duties' send; before this, its TransportError ended the engine, not the
    # group, and recovery never ran (tests/e2e/test_recovery.py met it once in a CI run).
    loop = loop_over(Unreachable(closed_later))
    loop.conversation = running_scheduler(world=3)  # every rank heard at 0.0
    heartbeat_due = loop.timeouts.heartbeat_s  # and no rank silent yet
    assert heartbeat_due < loop.timeouts.peer_silence_s
    with pytest.raises(RankFailure, match=said):
        loop._duties(heartbeat_due)
