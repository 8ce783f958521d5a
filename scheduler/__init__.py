"""Rank-0 scheduler: page pool with clear marks, prefix snapshots, continuous batching. No torch."""

from scheduler.pages import PagePool, PagePoolError
from scheduler.prefix import PrefixCache, PrefixHasher
from scheduler.request import InvalidSamplingParams, Request, RequestState, SamplingParams
from scheduler.scheduler import (
    AdmissionError,
    RequestOutput,
    RequestView,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    SchedulerStateError,
    SchedulerStats,
    StepPlan,
)

__all__ = [
    "AdmissionError",
    "InvalidSamplingParams",
    "PagePool",
    "PagePoolError",
    "PrefixCache",
    "PrefixHasher",
    "Request",
    "RequestOutput",
    "RequestState",
    "RequestView",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerStateError",
    "SchedulerStats",
    "StepPlan",
]
