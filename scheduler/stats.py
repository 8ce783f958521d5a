"""What the scheduler counts, and the read-only views it gives of its state."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import RequestState


@dataclass
class Counters:
    """Running totals, bumped where the events happen (so that stats() costs O(1))."""

    waiting: int = 0  # waiting requests that were never preempted
    preempted: int = 0  # waiting requests that were
    preemptions: int = 0
    offloads: int = 0  # requests
    restores: int = 0  # requests
    pages_offloaded: int = 0
    pages_restored: int = 0
    aborted: int = 0
    prefix_queries: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found there
    prefix_hit_pages: int = 0
    pages_cleared_last_step: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    """Counts for /metrics. pages_used = pages off the free list (request pages, reservations and
    snapshots); pages_cached = snapshot pages, referenced or not; pages_evictable = snapshots nobody
    references; waiting excludes preempted requests, which preempted counts. offloads_total and
    restores_total count requests, pages_offloaded_total and pages_restored_total their pages.
    prefix_queries_total and prefix_hits_total count tokens, as vLLM's prefix-cache metrics do: the
    known tokens of each request admitted while prefix caching is on, and those of them that a
    prefix hit supplied."""

    running: int
    waiting: int
    preempted: int
    pages_free: int
    pages_used: int
    pages_cached: int
    pages_marked: int
    pages_cleared_total: int
    preemptions_total: int
    offloads_total: int
    restores_total: int
    evictions_total: int
    steps_total: int
    aborted_steps_total: int
    pages_evictable: int = 0
    pages_reserved: int = 0
    host_pages_free: int = 0
    prefix_hit_pages_total: int = 0
    prefix_queries_total: int = 0
    prefix_hits_total: int = 0
    pages_offloaded_total: int = 0
    pages_restored_total: int = 0
    pages_cleared_last_step: int = 0
    steps_in_flight: int = 0


@dataclass(frozen=True)
class RequestView:
    """One request as the scheduler holds it (a copy: tests and debugging read it)."""

    request_id: int
    state: RequestState
    num_tokens: int  # known: prompt + samples received
    num_computed: int  # tokens whose KV is written or planned (RUNNING), held in host slots (OFFLOADED)
    pending_samples: int  # samples of steps in flight not received yet
    page_table: tuple[int, ...]  # committed pages (a row, live or held for a step in flight)
    reserved_pages: tuple[int, ...]
    host_slots: tuple[int, ...]
    live: bool  # planned in the next step (RUNNING); false for a row only held for a step in flight
    prefix_leader: int | None  # the request whose prompt pages it waits to share
