"""The runtime's /metrics as numbers: parsing, scraping, and the names the tools read.

The names are tp_runtime/metrics.py's (docs/http_api.md lists them); counters carry prometheus'
`_total` suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

M_RUNNING = "tp_runtime_requests_running"
M_WAITING = "tp_runtime_requests_waiting"
M_PREEMPTED = "tp_runtime_requests_preempted"
M_FREE = "tp_runtime_kv_pages_free"
M_USED = "tp_runtime_kv_pages_used"
M_CACHED = "tp_runtime_kv_pages_cached"
M_MARKED = "tp_runtime_kv_pages_marked"
M_CLEARED = "tp_runtime_kv_pages_cleared_total"
M_PREEMPTIONS = "tp_runtime_preemptions_total"
M_OFFLOADS = "tp_runtime_kv_offloads_total"
M_RESTORES = "tp_runtime_kv_restores_total"
M_EVICTIONS = "tp_runtime_prefix_evictions_total"
M_STEPS = "tp_runtime_steps_total"
M_MODEL_BUSY_SECONDS = "tp_runtime_model_busy_seconds_total"
M_MODEL_IDLE_SECONDS = "tp_runtime_model_idle_seconds_total"
M_REJECTS = "tp_runtime_step_rejects_total"
M_ABORTS = "tp_runtime_step_aborts_total"
M_ABORTED_STEPS = "tp_runtime_aborted_steps_total"
M_REQUEST_REJECTS = "tp_runtime_request_rejects_total"
M_CANCELS = "tp_runtime_request_cancels_total"
M_PLAN_SECONDS = "tp_runtime_plan_seconds_total"
M_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
M_PREFIX_HITS = "vllm:prefix_cache_hits_total"
M_PROTOCOL_SECONDS = "tp_runtime_protocol_seconds_total"
M_STEP_SECONDS = "tp_runtime_step_seconds_total"
M_REQUEST_ERRORS = "tp_runtime_request_errors_total"
M_EXECUTOR_RESTARTS = "tp_runtime_executor_restarts_total"
M_PEER_LONGEST_SILENCE = "tp_runtime_peer_longest_silence_seconds"
# The scheduler's frame socket (protocol.transport.PeerStats): connections, and what it ignored.
M_FRAME_CONNECTIONS = "tp_runtime_frame_socket_connections_total"
M_FRAME_UNBOUND_DISCONNECTS = "tp_runtime_frame_socket_unbound_disconnects_total"
M_FRAME_UNAUTHENTICATED = "tp_runtime_frame_socket_unauthenticated_frames_total"
M_FRAME_UNBOUND_FRAMES = "tp_runtime_frame_socket_unbound_frames_total"
M_FRAME_HANDSHAKE_FAILURES = "tp_runtime_frame_socket_handshake_failures_total"
M_FRAME_RANK_DISCONNECTS = "tp_runtime_frame_socket_rank_disconnects_total"
FRAME_SOCKET_METRICS = (
    M_FRAME_CONNECTIONS, M_FRAME_UNBOUND_DISCONNECTS, M_FRAME_UNAUTHENTICATED, M_FRAME_UNBOUND_FRAMES,
    M_FRAME_HANDSHAKE_FAILURES, M_FRAME_RANK_DISCONNECTS,
)  # fmt: skip


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> sample name -> value, summed over label sets (`_bucket` samples dropped)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


M_THREAD_CPU = "tp_runtime_thread_cpu_seconds_total"
M_THREAD_WAKEUPS = "tp_runtime_thread_wakeups_total"


@dataclass(frozen=True)
class ThreadReadings:
    """From /metrics text: each of the frontend's threads, by name, its CPU seconds and its
    wake-ups so far; None where the server does not say (another runtime behind --url, or one from
    before the metric)."""

    cpu_s: dict[str, float] | None
    wakeups: dict[str, float] | None

    @classmethod
    def of(cls, text: str) -> ThreadReadings:
        by_metric: dict[str, dict[str, float]] = {M_THREAD_CPU: {}, M_THREAD_WAKEUPS: {}}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values = by_metric.get(sample.name)
                if values is not None:
                    thread = sample.labels.get("thread", "")
                    values[thread] = values.get(thread, 0.0) + float(sample.value)
        return cls(by_metric[M_THREAD_CPU] or None, by_metric[M_THREAD_WAKEUPS] or None)


def labelled_value(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics by its labels (0 when absent), e.g. the request errors of one fault."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


@dataclass(frozen=True)
class MetricsSample:
    t: float  # seconds since the run started
    values: dict[str, float]

    def get(self, name: str) -> float | None:
        return self.values.get(name)


async def metrics_text(client: httpx.AsyncClient, url: str) -> str | None:
    """The server's /metrics text, or None where it has none (another runtime behind --url)."""
    try:
        response = await client.get(f"{url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The server's /metrics as numbers, or None where it has none."""
    text = await metrics_text(client, url)
    return None if text is None else parse_metrics(text)


def read_metrics(url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """scrape_metrics without an event loop."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None
