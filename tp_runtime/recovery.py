"""Recovery of a failed executor group, the engine's side: the policy, the crash-loop window, what
the engine keeps across groups, and the faults a failed request is counted under.

Under `tp-runtime serve` the frontend outlives the executor group (tp_runtime/supervisor.py starts
it beside torchrun's elastic agent, tp_runtime/group_broker.py hands each group its run id and
frame key). When a rank dies or hangs the engine fails the requests the dead group held, answers
/health with 503, has the group killed, and serves again from a new group with a new run id, a new
frame key and a new scheduler: every page marked, no prefix snapshot, no host copy. Requests that
never reached a step start again from their prompts.

The crash-loop window is counted here, not by torchrun: its --max-restarts counts over the agent's
whole life, so a server up for months would end after that many unrelated faults. The agent runs
with a bound it never reaches (AGENT_MAX_RESTARTS) and `RestartWindow` ends the service once more
than `max_restarts` groups died within `window_s`.

This module imports no torch: it runs in the frontend.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from protocol.errors import TPRuntimeError
from tp_runtime.stats import BucketCounter
from tp_runtime.step_loop import RankFailure

if TYPE_CHECKING:
    from protocol.transport import SchedulerEndpoint

# torchrun's --max-restarts under `tp-runtime serve`: the agent never gives up by itself; the
# frontend's RestartWindow decides (its count has a window, torchrun's has none).
AGENT_MAX_RESTARTS = 1_000_000
# Seconds in vLLM's buckets' spirit: a CPU group restarts in tens of seconds, a GPU one in minutes.
RECOVERY_TIME_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0, 600.0)


class Fault:
    """The `fault` label of tp_runtime_request_errors_total: why the runtime failed a request."""

    RANK_FAILURE = "rank_failure"  # its group died or hung under it
    RECOVERY_TIMEOUT = "recovery_timeout"  # it waited longer than --recovery-timeout for a new group
    RUNTIME_DOWN = "runtime_down"  # the service ended: a crash loop, a refused handshake, the frontend's parent gone
    SHUTDOWN = "shutdown"  # the drain after SIGTERM ran out
    STEP = "step"  # its own step failed: non-finite logits, a refused frame
    OTHER = "other"


@dataclass(frozen=True)
class RecoveryPolicy:
    """--max-restarts, --restart-window and --recovery-timeout."""

    max_restarts: int = 3  # group restarts allowed within window_s; one more ends the service
    window_s: float = 600.0
    recovery_timeout_s: float = 60.0  # longer than this, waiting requests get 503 + Retry-After

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.recovery_timeout_s <= 0:
            raise ValueError(f"a recovery policy needs max_restarts >= 0 and positive times, got {self}")


class CrashLoop(TPRuntimeError):
    """More groups died within the window than the policy allows: the service ends."""


@dataclass(frozen=True)
class GroupDeath:
    restart: int  # torchrun's restart count of the group (TORCHELASTIC_RESTART_COUNT)
    at: float  # time.monotonic()
    cause: str  # names the rank and why


class RestartWindow:
    """Counts group deaths over a sliding window: the (max_restarts + 1)th within window_s ends
    the service."""

    def __init__(self, policy: RecoveryPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self._clock = clock
        self._deaths: deque[GroupDeath] = deque()

    def record(self, death: GroupDeath) -> None:
        """Raises CrashLoop when this death is one too many; its message names every death counted."""
        self._deaths.append(death)
        horizon = self._clock() - self._policy.window_s
        while self._deaths and self._deaths[0].at < horizon:
            self._deaths.popleft()
        if len(self._deaths) > self._policy.max_restarts:
            now = self._clock()
            causes = "; ".join(f"{now - d.at:.0f} s ago: {d.cause}" for d in self._deaths)
            raise CrashLoop(
                f"the executor group died {len(self._deaths)} times within {self._policy.window_s:g} s "
                f"(--max-restarts {self._policy.max_restarts} in --restart-window {self._policy.window_s:g}): {causes}"
            )


def exit_cause(rank: int, exitcode: int) -> str:
    """One rank's end as its parent saw it (a negative code is the signal that ended it)."""
    if exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with code {exitcode}"


def carry_totals(before: object, now: object) -> object:
    """`now` (a frozen dataclass of one group's counts) with `before`'s running totals added: the
    `*_total` fields of SchedulerStats, every field of PeerStats. Prometheus counters then never
    go back when a new group starts from zero."""
    every = not any(f.name.endswith("_total") for f in dataclasses.fields(now))
    added = {
        f.name: getattr(now, f.name) + getattr(before, f.name)
        for f in dataclasses.fields(now)
        if every or f.name.endswith("_total")
    }
    return dataclasses.replace(now, **added)


class GroupSource(Protocol):
    """What the engine needs of tp_runtime.group_broker.GroupBroker."""

    wake: Callable[[], None]

    def open_group(self) -> SchedulerEndpoint: ...
    def claimed_restart(self) -> int | None: ...
    def kill(self, restart: int) -> None: ...
    def take_deaths(self) -> list[DeathReport]: ...
    def wait_death(self, restart: int, timeout_s: float) -> DeathReport | None: ...


class DeathReport(Protocol):
    restart: int
    exits: tuple[tuple[int, int], ...]

    def cause(self) -> str: ...


# How long the engine waits for the agent's word on a group it had killed: the agent looks every
# 0.2 s (--monitor-interval); without its word the death is counted with the frontend's cause only.
DEATH_REPORT_WAIT_S = 10.0


class Recovery:
    """The engine's recovery state, driven from the engine thread: whether a group is being
    replaced and since when, the crash-loop window, the restarts and their times for /metrics.
    `recovering_since`, `reason` and `expired` are read by the HTTP thread (plain attributes,
    each written whole)."""

    def __init__(self, groups: GroupSource, policy: RecoveryPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.groups = groups
        self.policy = policy
        self._clock = clock
        self._window = RestartWindow(policy, clock)
        self._reported: DeathReport | None = None  # the serving group's death, as the launcher told it
        self.recovering_since: float | None = None
        self.reason = ""
        self.expired = False  # waiting requests were failed: new ones get 503 until a group is back
        self.restarts_total = 0
        self.times = BucketCounter(RECOVERY_TIME_BUCKETS)
        self._last_time_s: float | None = None

    def begin(self, cause: str) -> None:
        if self.recovering_since is None:
            self.recovering_since = self._clock()
        self.reason = cause

    def end_group(self, cause: str) -> None:
        """The group that served is dead or hung: has it killed, takes the agent's word on how its
        ranks ended, and counts the death (CrashLoop when it is one too many)."""
        restart = self.groups.claimed_restart()
        report = self._reported
        self._reported = None
        if restart is not None:
            self.groups.kill(restart)
            if report is None or report.restart != restart:
                report = self.groups.wait_death(restart, DEATH_REPORT_WAIT_S)
        if report is not None and report.exits and report.cause() not in cause:
            cause = f"{cause} ({report.cause()})"
        self.reason = cause
        self._window.record(GroupDeath(restart if restart is not None else -1, self._clock(), cause))

    def check_deaths(self) -> None:
        """Takes the launcher's reports: the serving group's death raises RankFailure (the engine then
        calls end_group); a group that died before its rank 0 came for its keys is counted here."""
        current = self.groups.claimed_restart()
        for report in self.groups.take_deaths():
            if current is not None and report.restart == current:
                self._reported = report
                raise RankFailure(f"the executor group ended: {report.cause()}")
            self.begin(f"the executor group ended before its handshake: {report.cause()}")
            self._window.record(GroupDeath(report.restart, self._clock(), self.reason))

    def timed_out(self) -> bool:
        since = self.recovering_since
        return since is not None and self._clock() - since > self.policy.recovery_timeout_s

    def group_ready(self) -> None:
        if self.recovering_since is None:
            return
        self._last_time_s = self._clock() - self.recovering_since
        self.times.observe(self._last_time_s)
        self.restarts_total += 1
        self.recovering_since = None
        self.expired = False
        self.reason = ""

    def retry_after_s(self) -> float:
        """What a 503 during recovery suggests: as long as the last recovery took, 10 s before any."""
        return max(1.0, self._last_time_s or 10.0)
