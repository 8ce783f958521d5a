"""What the scheduler plans with: the cache geometry, the batch limits and the policies."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.frames import MAX_DECODE_STEPS, max_decode_steps
from scheduler.errors import SchedulerConfigError


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_pages: int
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    num_host_pages: int = 0  # pages of host offload buffer; 0 means preempt by recompute only
    enable_prefix_cache: bool = True
    poison_freed_pages: bool = False  # debug: list pages freed since the last step in poison_pages
    decode_lookahead: int = 0  # pages reserved ahead of a decoding request's committed pages
    # Steps planned before the oldest one's RESULT is in: 1 is serial, 2 plans step N+1 while step
    # N runs (its continuing rows feed back the token N samples).
    max_inflight_steps: int = 1
    # Forwards a steady decode step may run on one frame (vLLM's --num-scheduler-steps): while
    # every running request decodes and none waits, the ranks run up to this many forwards per
    # PREPARE, feeding each one's samples to the next, and the control plane's work per step is
    # paid once per frame (docs/control_plane.md). 1: every forward is a frame of its own.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("num_kv_pages", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise SchedulerConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SchedulerConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running sequence takes a token every step"
            )
        if self.num_host_pages < 0 or self.decode_lookahead < 0:
            raise SchedulerConfigError("num_host_pages and decode_lookahead must be >= 0")
        if not 1 <= self.num_scheduler_steps <= max_decode_steps(self.page_size):
            raise SchedulerConfigError(
                f"num_scheduler_steps must be 1 to {max_decode_steps(self.page_size)} (at most page_size "
                f"{self.page_size} and {MAX_DECODE_STEPS}), got {self.num_scheduler_steps}"
            )
        if self.max_inflight_steps not in (1, 2):
            raise SchedulerConfigError(f"max_inflight_steps must be 1 or 2, got {self.max_inflight_steps}")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)
