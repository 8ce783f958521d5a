"""Prometheus metrics: the engine's published snapshot, and what the HTTP side times itself.

Two families of names. `vllm:*` are vLLM's names and shapes (a `model_name` label, the same
histograms), so dashboards and alerts written for vLLM work here (docs/grafana-dashboard.json).
`tp_runtime_*` are this runtime's own (KV page lifecycle, protocol timing). The engine values come
from one `EngineStats` snapshot per scrape (tp_runtime/stats.py): nothing here touches live
scheduler state, and nothing on the engine's hot path touches prometheus_client. Request latencies
(time to first token, inter-token, end-to-end) are measured where the client sees them, from the
moment the route took the request. docs/http_api.md lists every metric.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tp_runtime.stats import BucketCounter

if TYPE_CHECKING:
    from tp_runtime.engine import Engine
    from tp_runtime.stats import EngineStats, HistogramSnapshot

PREFIX = "tp_runtime"
MODEL_LABEL = "model_name"
# vLLM's buckets, so that quantiles computed from either server compare.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)

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
    ("kv_offloads", "offloads_total", "Preempted requests whose KV pages were copied to host memory."),
    ("kv_restores", "restores_total", "Requests whose KV pages were copied back from host memory to resume."),
    ("kv_pages_offloaded", "pages_offloaded_total", "KV pages copied to host memory when their request was preempted."),
    ("kv_pages_restored", "pages_restored_total", "KV pages copied back from host memory to resume their request."),
    ("prefix_evictions", "evictions_total", "Prefix snapshot pages evicted to free memory."),
    ("steps", "steps_total", "Model steps run."),
    ("aborted_steps", "aborted_steps_total", "Steps aborted (a rank rejected the frame or timed out)."),
)
# (metric suffix, PeerStats field, help): the scheduler's frame socket, strangers on it included.
_FRAME_SOCKET_COUNTERS = (
    ("frame_socket_connections", "connections_accepted", "Connections accepted on the scheduler's frame socket."),
    (
        "frame_socket_unbound_disconnects", "unbound_disconnects",
        "Connections to the frame socket that closed without becoming a rank's (strangers, probes).",
    ),
    (
        "frame_socket_unauthenticated_frames", "unauthenticated_frames",
        "Frames ignored for failing the part count, size or MAC: not from a holder of the launch's key.",
    ),
    (
        "frame_socket_unbound_frames", "unbound_frames",
        "Authenticated frames ignored because no HELLO had bound their connection to a rank.",
    ),
    ("frame_socket_handshake_failures", "handshake_failures", "ZMTP or CURVE handshakes the frame socket refused."),
    ("frame_socket_rank_disconnects", "rank_disconnects", "Launched ranks' connections that closed."),
)


def size_buckets(largest: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest`: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return tuple(float(b) for b in buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class EngineCollector(Collector):
    """Collects one engine's metrics; register it with a private CollectorRegistry."""

    def __init__(self, engine: Engine, model_name: str, clock=time.monotonic):
        self._engine = engine
        self._labels = [model_name]
        self._clock = clock
        self._last_tokens: int | None = None
        self._last_time = 0.0
        self._tokens_per_second = 0.0

    def describe(self) -> list[Metric]:
        # Registration calls describe() instead of collect(): no engine call at start-up.
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        yield from self._runtime_metrics(stats)
        yield from self._vllm_metrics(stats)

    def _runtime_metrics(self, stats: EngineStats) -> Iterator[Metric]:
        for suffix, field, help_text in _SCHEDULER_GAUGES:
            yield _gauge(f"{PREFIX}_{suffix}", help_text, getattr(stats.scheduler, field))
        for suffix, field, help_text in _SCHEDULER_COUNTERS:
            yield _counter(f"{PREFIX}_{suffix}", help_text, getattr(stats.scheduler, field))
        yield _counter(
            f"{PREFIX}_step_rejects",
            "Steps that a rank rejected or did not get ready for in time.",
            stats.rejects_total,
        )
        yield _counter(f"{PREFIX}_step_aborts", "Steps aborted on every rank.", stats.aborts_total)
        yield _counter(f"{PREFIX}_generation_tokens", "Tokens generated.", stats.tokens_generated_total)
        yield _counter(
            f"{PREFIX}_requests_finished", "Requests that ended, for any reason.", stats.requests_finished_total
        )
        yield _counter(
            f"{PREFIX}_plan_seconds", "Time the scheduler spent planning steps and taking their results.",
            stats.plan_time_s_total,
        )
        yield _counter(
            f"{PREFIX}_protocol_seconds",
            "Time from a step's PREPARE to its GO: encode, send, validation on every rank, READY.",
            stats.protocol_time_s_total,
        )
        yield _counter(
            f"{PREFIX}_step_seconds", "Time from PREPARE sent to the step's result.", stats.step_time_s_total
        )
        yield _counter(
            f"{PREFIX}_model_busy_seconds",
            "Time rank 0's model spent running steps that followed each other with work waiting (forward and "
            "sampling).",
            stats.model_busy_s_total,
        )
        yield _counter(
            f"{PREFIX}_steps_planned_ahead",
            "Steps planned, sent and staged on every rank while the step before them still ran (--async-scheduling).",
            stats.steps_planned_ahead_total,
        )
        yield _counter(
            f"{PREFIX}_model_forwards",
            "Forwards the finished steps ran: more than the steps where a steady decode step ran several on one frame "
            "(--num-scheduler-steps).",
            stats.forwards_total,
        )
        yield _counter(
            f"{PREFIX}_steps_cut",
            "Steps of several forwards ended after the forward running (CUT) because a request arrived, which would "
            "otherwise have waited for all of them.",
            stats.steps_cut_total,
        )
        yield _counter(
            f"{PREFIX}_model_idle_seconds",
            "Time rank 0's model sat idle between those steps, waiting for the control plane (results, planning, "
            "PREPARE, READY, GO): what planning ahead hides.",
            stats.model_idle_s_total,
        )
        yield _gauge(
            f"{PREFIX}_peer_longest_silence_seconds",
            "The longest any rank had gone without a frame reaching the scheduler, at a liveness check, since the "
            "server started: the margin this machine's load leaves below the silence that takes a rank for stopped.",
            stats.peer_longest_silence_s,
        )
        yield _gauge(
            f"{PREFIX}_generation_tokens_per_second",
            "Tokens generated per second since the previous scrape.",
            self._throughput(stats.tokens_generated_total),
        )
        yield _histogram(
            f"{PREFIX}_step_latency_seconds", "Time from PREPARE sent to the step's result, per model step.",
            stats.step_latency,
        )
        if stats.pages_cleared_per_step is not None:
            yield _histogram(
                f"{PREFIX}_kv_pages_cleared_per_step", "KV pages a step's PREPARE listed to be zeroed.",
                stats.pages_cleared_per_step,
            )
        yield _counter(
            f"{PREFIX}_executor_restarts",
            "Executor groups started to replace one that died or hung (tp-runtime serve restarts them).",
            stats.executor_restarts_total,
        )
        if stats.recovery_time is not None:
            yield _histogram(
                f"{PREFIX}_recovery_seconds",
                "Time from a failed executor group to the handshake of the group that replaced it.",
                stats.recovery_time,
            )
        if stats.peer_stats is not None:
            for suffix, field, help_text in _FRAME_SOCKET_COUNTERS:
                yield _counter(f"{PREFIX}_{suffix}", help_text, getattr(stats.peer_stats, field))

    def _vllm_metrics(self, stats: EngineStats) -> Iterator[Metric]:
        s, labels = stats.scheduler, self._labels
        total_pages = s.pages_used + s.pages_free
        # As vLLM counts it: a cached page nobody holds is as good as free.
        usage = (s.pages_used - s.pages_evictable) / total_pages if total_pages else 0.0
        yield _gauge("vllm:num_requests_running", "Requests in the running batch.", s.running, labels)
        waiting = s.waiting + s.preempted
        yield _gauge("vllm:num_requests_waiting", "Requests waiting for a slot, preempted ones too.", waiting, labels)
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (0 to 1).", usage, labels)
        queries = stats.prefix_cache_queries_total
        yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries, labels)
        yield _counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits_total, labels
        )
        yield _counter("vllm:num_preemptions", "Requests preempted to free KV pages.", s.preemptions_total, labels)
        yield _counter("vllm:prompt_tokens", "Prompt tokens of requests admitted.", stats.prompt_tokens_total, labels)
        yield _counter("vllm:generation_tokens", "Tokens generated.", stats.tokens_generated_total, labels)
        if stats.queue_time is not None:
            yield _histogram(
                "vllm:request_queue_time_seconds", "Time from submit to a request's first scheduled step.",
                stats.queue_time, labels,
            )

    def _throughput(self, tokens_total: int) -> float:
        now = self._clock()
        if self._last_tokens is not None and now > self._last_time:
            self._tokens_per_second = (tokens_total - self._last_tokens) / (now - self._last_time)
        self._last_tokens, self._last_time = tokens_total, now
        return self._tokens_per_second


def _gauge(name: str, help_text: str, value: float, labels: list[str] | None = None) -> GaugeMetricFamily:
    if labels is None:
        return GaugeMetricFamily(name, help_text, value=value)
    family = GaugeMetricFamily(name, help_text, labels=[MODEL_LABEL])
    family.add_metric(labels, value)
    return family


def _counter(name: str, help_text: str, value: float, labels: list[str] | None = None) -> CounterMetricFamily:
    # CounterMetricFamily appends the `_total` suffix to the sample itself.
    if labels is None:
        return CounterMetricFamily(name, help_text, value=value)
    family = CounterMetricFamily(name, help_text, labels=[MODEL_LABEL])
    family.add_metric(labels, value)
    return family


def _histogram(
    name: str, help_text: str, snapshot: HistogramSnapshot, labels: list[str] | None = None
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help_text, labels=[MODEL_LABEL] if labels else None)
    # Spelled as prometheus_client's own Histogram spells its bounds ("1e+06", "+Inf"), vLLM's too.
    buckets = [(floatToGoString(bound), count) for bound, count in snapshot.cumulative()]
    family.add_metric(labels or [], buckets=buckets, sum_value=snapshot.total)
    return family


class ThreadCollector(Collector):
    """The CPU time and the wake-ups of each of this process's Python threads, by name (the engine
    loop, the HTTP server, the signal watch): which part of the frontend a per-token cost lands on,
    and in how many bursts (on cores shared with the model each wake-up starts on cold caches:
    docs/control_plane.md). Read at scrape time from Linux's account of each thread
    (/proc/self/task/TID: schedstat's nanoseconds, status's voluntary context switches), which a
    thread that has just ended leaves missing rather than reused. Threads of one name are summed;
    threads outside Python (ZeroMQ's I/O thread) are in the process's total only. No samples where
    /proc has no such account."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily(
            f"{PREFIX}_thread_cpu_seconds", "CPU time of each of the frontend's threads, by thread name.", labels=["thread"]
        )
        wakeups = CounterMetricFamily(
            f"{PREFIX}_thread_wakeups",
            "Times each of the frontend's threads woke from a wait (voluntary context switches), by thread name.",
            labels=["thread"],
        )
        seconds: dict[str, float] = {}
        woken: dict[str, int] = {}
        for thread in threading.enumerate():
            try:
                used, waits = _thread_account(thread.native_id)
            except (OSError, ValueError, IndexError):  # ended since the enumeration, not started, no /proc
                continue
            seconds[thread.name] = seconds.get(thread.name, 0.0) + used
            woken[thread.name] = woken.get(thread.name, 0) + waits
        for name, value in seconds.items():
            cpu.add_metric([name], value)
            wakeups.add_metric([name], woken[name])
        yield cpu
        yield wakeups


def _thread_account(tid: int | None) -> tuple[float, int]:
    """A thread's CPU seconds and voluntary context switches so far, from /proc."""
    with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
        used = int(f.read().split()[0]) / 1e9
    with open(f"/proc/self/task/{tid}/status", "rb") as f:
        status = f.read()
    waits = int(status.split(b"\nvoluntary_ctxt_switches:", 1)[1].split()[0])
    return used, waits


class RequestHistograms(Collector):
    """vLLM's request histograms, filled on the HTTP thread as each request's tokens come and read
    by /metrics on the same thread. Plain bucket counts (tp_runtime.stats.BucketCounter) rather
    than prometheus_client's Histogram, whose observe() walks the buckets in Python under two
    locks: the inter-token latency is observed once per piece of every stream."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self._labels = [model_name]
        sizes = size_buckets(max_model_len)
        self.time_to_first_token = BucketCounter(TTFT_BUCKETS)
        self.inter_token_latency = BucketCounter(TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = BucketCounter(TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = BucketCounter(REQUEST_LATENCY_BUCKETS)
        self.prompt_length = BucketCounter(sizes)
        self.generation_length = BucketCounter(sizes)
        self.exposed = (  # (name, help, counter), as /metrics shows them
            ("vllm:time_to_first_token_seconds", "Time from taking a request to its first generated token.",
             self.time_to_first_token),
            ("vllm:inter_token_latency_seconds", "Time between a request's successive token events.",
             self.inter_token_latency),
            ("vllm:request_time_per_output_token_seconds",
             "Per request: time from its first token to its last, over its tokens after the first.",
             self.time_per_output_token),
            ("vllm:e2e_request_latency_seconds", "Time from taking a request to its last token.", self.e2e_latency),
            ("vllm:request_prompt_tokens", "Prompt tokens per finished request.", self.prompt_length),
            ("vllm:request_generation_tokens", "Generated tokens per finished request.", self.generation_length),
        )  # fmt: skip

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, help_text, counter in self.exposed:
            yield _histogram(name, help_text, counter.snapshot(), self._labels)


class Metrics:
    """The registry /metrics exposes: the engine's collector plus the HTTP side's own metrics."""

    def __init__(self, engine: Engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.registry.register(ThreadCollector())
        self.model_name = model_name
        registry = self.registry
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests answered, by endpoint and status code.", ("endpoint", "status"),
            registry=registry,
        )
        self.request_rejects = Counter(
            f"{PREFIX}_request_rejects",
            "Requests refused before generation, by reason (invalid, admission, overloaded, unavailable).",
            ("reason",),
            registry=registry,
        )
        self.request_cancels = Counter(
            f"{PREFIX}_request_cancels", "Requests cancelled because the client went away.", registry=registry
        )
        self.request_errors = Counter(
            f"{PREFIX}_request_errors",
            "Requests that the runtime failed after admission, by fault (rank_failure, recovery_timeout, "
            "runtime_down, shutdown, step, other).",
            ("fault",),
            registry=registry,
        )
        self.latencies = RequestHistograms(model_name, max(engine.max_model_len, 1))
        registry.register(self.latencies)
        self._request_success = Counter(
            "vllm:request_success", "Requests that ended, by finish reason (stop, length, abort, error).",
            (MODEL_LABEL, "finished_reason"), registry=registry,
        )

    def count_http_answer(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint, str(status)).inc()

    def timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def request_ended(self, reason: str) -> None:
        self._request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's timing (a generation.RequestObserver), on the monotonic clock."""

    def __init__(self, metrics: Metrics, arrival: float):
        self._metrics = metrics
        self._arrival = arrival
        self._first: float | None = None
        self._last = arrival

    def tokens(self, count: int, now: float) -> None:
        if self._first is None:
            self._first = now
            self._metrics.latencies.time_to_first_token.observe(now - self._arrival)
        else:
            self._metrics.latencies.inter_token_latency.observe(now - self._last)
        self._last = now

    def ended(self, reason: str, prompt_tokens: int, completion_tokens: int, now: float) -> None:
        self._metrics.request_ended(reason)
        if reason not in ("stop", "length"):
            return
        m = self._metrics.latencies
        m.e2e_latency.observe(now - self._arrival)
        m.prompt_length.observe(prompt_tokens)
        m.generation_length.observe(completion_tokens)
        if self._first is not None and completion_tokens > 1:
            m.time_per_output_token.observe((self._last - self._first) / (completion_tokens - 1))
