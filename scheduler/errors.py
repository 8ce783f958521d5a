"""The scheduler's errors: a request that can never run is kept apart from a caller driving the
scheduler out of order, and both from a broken configuration."""

from __future__ import annotations

from protocol.errors import TPRuntimeError


class SchedulerError(TPRuntimeError):
    """The base of every error the scheduler raises on purpose."""


class SchedulerConfigError(SchedulerError, ValueError):
    """A SchedulerConfig field is out of range or inconsistent with another."""


class AdmissionError(SchedulerError):
    """A request that could never run: refused at add_request, nothing else is affected."""


class SchedulerStateError(SchedulerError, RuntimeError):
    """The caller drove the scheduler out of order (e.g. on_result for a step that is not the oldest
    in flight). A bug in the caller, never a property of a request."""
