"""Which steps the scheduler says as a CONTINUE, and that each one is exactly the PREPARE it would
have sent otherwise: the same workload planned twice, once with CONTINUE turned off, step by step."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.frames import ARRAY_DTYPES, Prepare
from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler import plan as plan_module
from tests.scheduler.sched_sim import Driver

EOS = 2
PLAIN = SamplingParams(max_tokens=9, temperature=0.7, seed=3, ignore_eos=True)
PROCESSED = SamplingParams(
    max_tokens=11, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, min_tokens=4, stop_token_ids=(5,),
    logit_bias=((9, 2.0),),
)


def workload(inflight: int) -> Driver:
    """Requests that come and go while others decode: plain ones, and ones with a sampling state
    and stop tokens banned before min_tokens."""
    cfg = SchedulerConfig(
        num_kv_pages=48, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=40,
        eos_token_ids=(EOS,), max_inflight_steps=inflight,
    )
    d = Driver(Scheduler(cfg), vocab=30, seeded_model=True)
    d.add(0, [7, 8, 9, 10, 11], PLAIN)
    d.add(1, [7, 8, 12], PROCESSED)
    for _ in range(8):  # as run_to_end plans: as many steps ahead as the config allows
        if d.can_plan and d.plan() is not None and d.can_plan:
            continue
        d.complete()
    d.add(2, [13, 14, 15, 16, 17, 18, 19], PLAIN)
    d.add(3, [20, 21], PROCESSED)
    d.run_to_end()
    d.check_outputs()
    return d


@pytest.mark.parametrize("inflight", [1, 2])
def test_a_continue_is_the_prepare_the_scheduler_would_send(monkeypatch: pytest.MonkeyPatch, inflight: int) -> None:
    briefed = workload(inflight)  # the Driver checks each CONTINUE's expansion against the plan's PREPARE
    with monkeypatch.context() as m:
        m.setattr(plan_module, "_continued", lambda *args: None)
        whole = workload(inflight)
    assert len(briefed.plans) == len(whole.plans)
    for a, b in zip(briefed.plans, whole.plans):
        assert b.brief is None
        for name, dtype in ARRAY_DTYPES[Prepare].items():
            x, y = getattr(a.prepare, name), getattr(b.prepare, name)
            assert x.dtype == y.dtype == dtype and np.array_equal(x, y), f"step {a.step}: {name} {x} != {y}"
    if inflight == 1:
        # A step planned after the one before has ended feeds no sample back: never a CONTINUE.
        assert briefed.continued == 0
        return
    sent = [p for p in briefed.plans if p.brief is not None]
    # Steady runs between the admissions and ends (a step or two after each, while a row that ended
    # is held for the step in flight, goes whole): 7 of this workload's 19 steps.
    assert briefed.continued == len(sent) >= 6
    for p in sent:
        prep = p.prepare
        assert prep.feedback.all() and prep.sample.all()
        assert not prep.banned_lens.any(), "a step that bans stop tokens is sent whole"
        assert not (prep.sampling_state == 1).any()
    # While a request is before its min_tokens, its stop tokens are banned: those steps are PREPAREs.
    assert any(p.prepare.banned_lens.any() and p.brief is None and p.prepare.feedback.all() for p in briefed.plans)
