"""What the engine publishes for /metrics and /health: immutable snapshots made on the engine thread.

The scheduler is not thread-safe, and the HTTP thread must never walk its queues while the engine
thread changes them. So the engine thread builds one `EngineStats` as the last step in flight ends
and otherwise at most once a second, and swaps it in whole; readers only ever see a finished snapshot. Latencies are kept as bucket
counts, not as lists: their memory is fixed whether or not anything scrapes. This module imports no
prometheus_client (the CLI's generate job uses the engine without the serve extras).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from protocol.transport import PeerStats
from scheduler.scheduler import SchedulerStats

# Decode steps take milliseconds on a GPU and tens of milliseconds on a CPU at TP=2; a long
# prefill chunk takes seconds.
STEP_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's buckets for vllm:request_queue_time_seconds.
QUEUE_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Observations so far, by bucket: counts[i] holds the values in (bounds[i-1], bounds[i]],
    and the last count the values above every bound (Prometheus' +Inf bucket)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(le, count of values <= le) pairs, inf last, as Prometheus exposes them (its client
        spells the bounds: tp_runtime/http/metrics.py)."""
        running, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append((float(bound), running))
        return out


class BucketCounter:
    """A histogram that one thread fills; `snapshot()` gives the others an immutable copy."""

    def __init__(self, bounds: tuple[float, ...]):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {bounds}")
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left puts a value equal to a bound into that bound's bucket: Prometheus' `le`.
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self._bounds, tuple(self._counts), self._total)


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    rejects_total: int
    aborts_total: int
    tokens_generated_total: int
    requests_finished_total: int
    step_latency: HistogramSnapshot  # PREPARE sent -> RESULT in, per step
    plan_time_s_total: float  # the scheduler's work: planning steps and taking their results, summed
    protocol_time_s_total: float  # PREPARE sent -> GO sent (encode, send, validation on every rank, READY)
    step_time_s_total: float  # PREPARE sent -> RESULT in, summed
    prompt_tokens_total: int  # prompt tokens of the requests the scheduler accepted
    prefix_cache_queries_total: int  # prompt tokens looked up in the prefix cache (0 when it is off)
    prefix_cache_hits_total: int  # tokens found there: whole pages of a cached prefix
    # Rank 0's model, over steps that followed each other with work waiting: the time it ran them
    # (forward and sampling) and the time it sat idle between them, waiting for the control plane
    # (results, planning, PREPARE, READY, GO): the share that planning ahead hides.
    model_busy_s_total: float = 0.0
    model_idle_s_total: float = 0.0
    steps_planned_ahead_total: int = 0  # planned, sent and staged while the step before them ran
    forwards_total: int = 0  # forwards the steps ran: more than steps where one ran several (--num-scheduler-steps)
    steps_cut_total: int = 0  # steps of several forwards ended early (CUT) because a request waited
    peer_longest_silence_s: float = 0.0  # the longest a rank went unheard at a liveness check
    # Filled in by the engine once it times them (the metrics export each one that is set):
    queue_time: HistogramSnapshot | None = None  # seconds from submit to the first scheduled step
    pages_cleared_per_step: HistogramSnapshot | None = None  # len(cleared_pages) of each PREPARE
    peer_stats: PeerStats | None = None  # the scheduler's frame socket: connections, what it ignored
    # Under a supervised launch (tp_runtime/recovery.py): executor groups started to replace a failed
    # one, and how long each took, from the fault to the new group's handshake.
    executor_restarts_total: int = 0
    recovery_time: HistogramSnapshot | None = None
