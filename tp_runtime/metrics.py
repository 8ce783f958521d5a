"""Prometheus metrics of the runtime, read from `Engine.stats()` at scrape time.

The engine keeps plain counters; this collector turns one `EngineStats` snapshot per scrape into
metric families, so nothing on the engine's hot path touches prometheus_client. Every name starts
with `tp_runtime_`; docs/http_api.md lists them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tp_runtime.engine import Engine, EngineStats

PREFIX = "tp_runtime"
# Decode steps take milliseconds on a GPU and tens of milliseconds on a CPU at TP=2; a long
# prefill chunk takes seconds.
STEP_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# (metric suffix, SchedulerStats field, help)
_SCHEDULER_GAUGES = (
    ("requests_running", "running", "Requests in the running batch."),
    ("requests_waiting", "waiting", "Requests admitted and waiting for a slot."),
    ("requests_preempted", "preempted", "Requests preempted and waiting to resume."),
    ("kv_pages_free", "pages_free", "KV cache pages in the free pool."),
    ("kv_pages_used", "pages_used", "KV cache pages out of the free pool: requests' and prefix snapshots'."),
    ("kv_pages_cached", "pages_cached", "KV cache pages in prefix snapshots, shared with requests or not."),
    ("kv_pages_evictable", "pages_evictable", "Prefix snapshot pages no request holds: reclaimable at once."),
    ("kv_pages_marked", "pages_marked", "KV cache pages marked to be zeroed before their next use."),
)
_SCHEDULER_COUNTERS = (
    ("kv_pages_cleared", "pages_cleared_total", "KV pages zeroed by the executors before first use."),
    ("preemptions", "preemptions_total", "Requests preempted to free KV pages."),
    ("kv_offloads", "offloads_total", "KV pages copied to host memory on preemption."),
    ("kv_restores", "restores_total", "KV pages copied back from host memory."),
    ("prefix_evictions", "evictions_total", "Prefix snapshot pages evicted to free memory."),
    ("steps", "steps_total", "Model steps run."),
    ("aborted_steps", "aborted_steps_total", "Steps aborted (a rank rejected the frame or timed out)."),
)


class EngineCollector(Collector):
    """Collects one engine's metrics; register it with a private CollectorRegistry."""

    def __init__(self, engine: Engine, clock=time.monotonic):
        self._engine = engine
        self._clock = clock
        # Not registered anywhere: collect() observes the latencies that arrived since the previous
        # scrape and then yields this histogram's samples itself.
        self._step_latency = Histogram(
            f"{PREFIX}_step_latency_seconds",
            "Time from PREPARE sent to the step's result, per model step.",
            buckets=STEP_LATENCY_BUCKETS,
            registry=None,
        )
        self._last_tokens: int | None = None
        self._last_time = 0.0
        self._tokens_per_second = 0.0

    def describe(self) -> list[Metric]:
        # Registration calls describe() instead of collect(): no engine call at start-up.
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        yield from self._scheduler_metrics(stats)
        yield _counter(
            "step_rejects", "Steps that a rank rejected or did not get ready for in time.", stats.rejects_total
        )
        yield _counter("step_aborts", "Steps aborted on every rank.", stats.aborts_total)
        yield _counter("generation_tokens", "Tokens generated.", stats.tokens_generated_total)
        yield _counter("requests_finished", "Requests that ended, for any reason.", stats.requests_finished_total)
        yield _counter("plan_seconds", "Time the scheduler spent planning steps.", stats.plan_time_s_total)
        yield _counter(
            "protocol_seconds",
            "Time from a planned step to GO: encode, send, validation on every rank, READY.",
            stats.protocol_time_s_total,
        )
        yield _counter("step_seconds", "Time from PREPARE sent to the step's result.", stats.step_time_s_total)
        yield _gauge(
            "generation_tokens_per_second",
            "Tokens generated per second since the previous scrape.",
            self._throughput(stats.tokens_generated_total),
        )
        for latency in stats.step_latency_s:
            self._step_latency.observe(latency)
        yield from self._step_latency.collect()

    def _scheduler_metrics(self, stats: EngineStats) -> Iterator[Metric]:
        for suffix, field, help_text in _SCHEDULER_GAUGES:
            yield _gauge(suffix, help_text, getattr(stats.scheduler, field))
        for suffix, field, help_text in _SCHEDULER_COUNTERS:
            yield _counter(suffix, help_text, getattr(stats.scheduler, field))

    def _throughput(self, tokens_total: int) -> float:
        now = self._clock()
        if self._last_tokens is not None and now > self._last_time:
            self._tokens_per_second = (tokens_total - self._last_tokens) / (now - self._last_time)
        self._last_tokens, self._last_time = tokens_total, now
        return self._tokens_per_second


def _gauge(suffix: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{suffix}", help_text, value=value)


def _counter(suffix: str, help_text: str, value: float) -> CounterMetricFamily:
    # CounterMetricFamily appends the `_total` suffix to the sample itself.
    return CounterMetricFamily(f"{PREFIX}_{suffix}", help_text, value=value)


class Metrics:
    """The registry that /metrics exposes: the engine's collector plus the HTTP layer's counters."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests answered, by endpoint and status code.",
            ("endpoint", "status"),
            registry=self.registry,
        )
        self.request_rejects = Counter(
            f"{PREFIX}_request_rejects",
            "Requests refused before generation, by reason (invalid, admission, unavailable).",
            ("reason",),
            registry=self.registry,
        )
        self.request_cancels = Counter(
            f"{PREFIX}_request_cancels",
            "Requests cancelled because the client went away.",
            registry=self.registry,
        )
        self.request_errors = Counter(
            f"{PREFIX}_request_errors",
            "Requests that the runtime failed after admission (a rank failure, non-finite logits).",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
