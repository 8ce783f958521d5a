"""How long a step may run before its group is taken for hung (tp_runtime.step_loop.StepDeadlines)."""

from __future__ import annotations

import random

from tp_runtime.step_loop import EngineTimeouts, StepDeadlines

TIMEOUTS = EngineTimeouts(first_step_s=120.0, step_floor_s=5.0, step_margin=10.0)


def test_each_kind_of_step_gets_the_first_step_deadline_until_one_of_its_kind_was_measured() -> None:
    deadlines = StepDeadlines(TIMEOUTS)
    assert deadlines.allowed(128, decode=False) == 120.0
    assert deadlines.allowed(1, decode=True) == 120.0
    deadlines.observe(128, 0.3, decode=False)  # a prefill, eager on a CPU
    assert deadlines.allowed(128, decode=False) == 5.0  # 10 x 0.3 s is under the floor
    # The first decode step runs other code (compiled layers, their first call): the prefill says
    # nothing of it (a new group's first decode once took past 5 s on a loaded machine).
    assert deadlines.allowed(1, decode=True) == 120.0
    deadlines.observe(1, 0.02, decode=True)
    assert deadlines.allowed(1, decode=True) == 5.0


def test_a_measured_deadline_scales_with_the_tokens_and_the_longest_step_and_keeps_its_floor() -> None:
    deadlines = StepDeadlines(TIMEOUTS)
    deadlines.observe(100, 1.0, decode=False)
    deadlines.observe(1, 0.01, decode=True)
    assert deadlines.allowed(100, decode=False) == 10.0
    assert deadlines.allowed(400, decode=False) == 40.0  # four times the tokens of the longest
    assert deadlines.allowed(1, decode=True) == 10.0  # the longest step of any kind, once both are seen
    quick = StepDeadlines(TIMEOUTS)
    quick.observe(1, 0.001, decode=True)
    assert quick.allowed(1, decode=True) == 5.0


def test_the_deadline_equals_the_longest_scaled_step_of_the_recent_history() -> None:
    """allowed() keeps two maxima instead of walking the history: it must give what the walk gives,
    old steps falling out of the history included."""
    rng = random.Random(7)
    deadlines = StepDeadlines(EngineTimeouts(first_step_s=120.0, step_floor_s=0.0, step_margin=1.0), history=8)
    recent: list[tuple[int, float]] = []
    for _ in range(200):
        tokens, seconds = rng.randint(1, 512), rng.uniform(0.001, 2.0)
        deadlines.observe(tokens, seconds, decode=True)
        recent = (recent + [(tokens, seconds)])[-8:]
        asked = rng.randint(1, 2048)
        walked = max(s * max(1.0, asked / m) for m, s in recent)
        assert abs(deadlines.allowed(asked, decode=True) - walked) <= 1e-9 * walked
