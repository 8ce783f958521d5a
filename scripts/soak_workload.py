"""The soak's request stream, and what the run observed of it.

Requests are token-id prompts built from the embedded corpus (scripts/prompts.py): long and short
ones alternate, a share starts with one of the shared system prompts (what prefix snapshots key
on), a share is sampled with a seed, a share is cancelled by the client mid-stream. Request i of a
seed is always the same request, so a run can be repeated and a reference run can replay it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scripts.harness.client import CompletionRequest, StreamResult
from scripts.harness.metrics import MetricsSample
from scripts.prompts import SYSTEM_PROMPTS, PromptBuilder


@dataclass(frozen=True)
class WorkloadShape:
    long_tokens: tuple[int, int] = (300, 900)  # user text of a long prompt
    short_tokens: tuple[int, int] = (20, 60)
    max_tokens: tuple[int, int] = (16, 96)  # long enough that decoding outgrows the pool: preemption
    shared_prefix_fraction: float = 0.6  # prompts that start with one of the shared system prompts
    sampled_fraction: float = 0.25  # seeded sampled requests; the rest are greedy
    cancel_fraction: float = 0.15  # requests whose client hangs up mid-stream


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str  # "long" | "short"
    system_prompt: int | None  # index into SYSTEM_PROMPTS: the shared prefix
    request: CompletionRequest

    @property
    def greedy(self) -> bool:
        return self.request.temperature == 0.0


def build_request(builder: PromptBuilder, index: int, seed: int, shape: WorkloadShape) -> SoakRequest:
    """Request `index` of the stream; the same (index, seed) always gives the same request."""
    rng = random.Random(f"soak:{seed}:{index}")
    kind = "long" if index % 2 == 0 else "short"
    low, high = shape.long_tokens if kind == "long" else shape.short_tokens
    system = rng.randrange(len(SYSTEM_PROMPTS)) if rng.random() < shape.shared_prefix_fraction else None
    user = builder.body(rng, rng.randint(low, high)) + builder.question(rng)
    prompt = builder.chat(SYSTEM_PROMPTS[system] if system is not None else None, user)
    max_tokens = rng.randint(*shape.max_tokens)
    sampled = rng.random() < shape.sampled_fraction
    cancel = rng.random() < shape.cancel_fraction
    request = CompletionRequest(
        prompt_ids=tuple(prompt),
        max_tokens=max_tokens,
        temperature=0.8 if sampled else 0.0,
        top_p=0.95 if sampled else 1.0,
        seed=rng.randrange(1 << 31) if sampled else None,
        cancel_after_tokens=rng.randint(1, max_tokens - 1) if cancel else None,
    )
    return SoakRequest(index=index, kind=kind, system_prompt=system, request=request)


def max_request_tokens(builder: PromptBuilder, shape: WorkloadShape) -> int:
    """An upper bound of prompt + output tokens of any request of this shape."""
    template = max(len(builder.chat(system, [])) for system in SYSTEM_PROMPTS)
    longest_user = max(shape.long_tokens[1], shape.short_tokens[1]) + builder.longest_question
    return template + longest_user + shape.max_tokens[1]


def outcome_of(result: StreamResult) -> str:
    """completed, cancelled (by the client, on purpose), failed (with a stated reason) or lost."""
    if result.cancelled and result.error is None:
        return "cancelled"
    if result.error is not None:
        return "lost" if result.error.startswith("lost:") else "failed"
    if result.finish_reason in ("length", "stop"):
        return "completed"
    return "lost"  # the stream ended without a finish reason or an error: nobody said why


@dataclass
class RunRecord:
    """Everything one soak run observed."""

    requests: list[SoakRequest] = field(default_factory=list)
    results: dict[int, StreamResult] = field(default_factory=dict)
    metrics: list[MetricsSample] = field(default_factory=list)
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    t0: float = 0.0  # perf_counter at the start of the stream of requests
    warmup_end: float = 0.0  # seconds after t0
    final_metrics: dict[str, float] | None = None
    faults: list[tuple[float, str]] = field(default_factory=list)  # --kill-every: (seconds after t0, rank killed)
