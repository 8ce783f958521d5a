"""The batched paths equal their one-at-a-time forms: staged admission leaves exactly the state
that admitting one request at a time does, the prefix keys hashed for many rows at once are the
keys hashed one by one, and a running row's fast RequestOutput is the dataclass's own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.frames import Result
from scheduler import AdmissionError, RequestOutput, SamplingParams, Scheduler, SchedulerConfig
from scheduler.prefix import PrefixHasher
from scheduler.scheduler import _running_output
from tests.scheduler.sched_sim import check_pool

PREFIXES = [[], [7, 8, 9, 10, 11], [7, 8, 9, 10, 11, 12, 13, 14], [3] * 12]

ROW_ARRAYS = (
    "_row_req", "_row_arrival", "_row_ncomp", "_row_ntok", "_row_npages", "_row_nres", "_row_sent",
    "_row_maxpages", "_row_last", "_row_temp", "_row_top_p", "_row_top_k", "_row_seed",
)


def state(s: Scheduler) -> dict:
    n = s._n
    held = s._row_npages[:n] + s._row_nres[:n]
    return {
        "rows": {name: getattr(s, name)[:n].tolist() for name in ROW_ARRAYS},
        "tables": [s._row_pages[r, : held[r]].tolist() for r in range(n)],
        "row_reqs": [req.request_id for req in s._rows[:n]],
        "refcount": s.pool.refcount.tolist(),
        "marked": s.pool.marked.tolist(),
        "free_stack": s.pool.free_pages().tolist(),
        "lru": list(s.cache._lru),
        "cached_pages": sorted(s.cache._key_of),
        "waiting": [(r.request_id, r.state, r.num_computed, tuple(r.slot_ids)) for r in s._waiting],
        "registered": {r.request_id: r.num_registered for r in s._requests.values()},
        "host_free": list(s._host_free),
        "stats": dataclasses.asdict(s.stats()),
    }


def check_keys(s: Scheduler) -> None:
    """Every request's prefix keys are those of its tokens hashed from position 0."""
    for req in s._requests.values():
        n = len(req.page_keys)
        if n:
            keys, state = s.hasher.extend((0, 0), req.tokens, 0, n * s.config.page_size)
            assert req.page_keys == keys and req.hash_state == state


def prepare_fields(plan) -> dict:
    if plan is None:
        return {}
    p = plan.prepare
    out = {f.name: np.asarray(getattr(p, f.name)).tolist() for f in dataclasses.fields(p)}
    out["rows"] = plan.rows.tolist()
    return out


def fake_result(plan, rng: np.random.Generator) -> Result:
    idx = np.flatnonzero(plan.prepare.sample)
    n = idx.shape[0]
    return Result(
        seq_ids=plan.prepare.seq_ids[idx].astype(np.int64),
        token_ids=rng.integers(2, 40, size=n).astype(np.int32),
        logprobs=np.zeros(n, dtype=np.float32),
        finite=np.ones(n, dtype=np.uint8),
    )


op = st.one_of(
    st.tuples(
        st.just("add"), st.integers(1, 8), st.sampled_from(range(len(PREFIXES))),
        st.lists(st.integers(3, 39), max_size=10), st.integers(1, 10),
    ),
    st.tuples(st.just("step"), st.integers(0, 2**16)),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([2, 4]),
    num_kv_pages=st.integers(8, 40),
    max_num_seqs=st.integers(1, 8),
    extra_budget=st.integers(0, 24),
    num_host_pages=st.sampled_from([0, 16]),
    lookahead=st.integers(0, 2),
    prefix=st.booleans(),
    ops=st.lists(op, min_size=1, max_size=40),
)
def test_staged_admission_equals_one_by_one(
    page_size, num_kv_pages, max_num_seqs, extra_budget, num_host_pages, lookahead, prefix, ops
):
    cfg = SchedulerConfig(
        num_kv_pages=num_kv_pages, page_size=page_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + extra_budget, max_model_len=32, eos_token_ids=(2,),
        num_host_pages=num_host_pages, enable_prefix_cache=prefix, decode_lookahead=lookahead,
    )
    batched, single = Scheduler(cfg), Scheduler(cfg)
    single._admit_batch = 0
    rid = 0
    for o in ops + [("step", 0)] * 3:
        if o[0] == "add":
            _, count, which, tail, max_tokens = o
            for k in range(count):
                prompt = (PREFIXES[which] + tail[k % (len(tail) + 1) :]) or [4]
                refused = []
                for s in (batched, single):
                    try:
                        s.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
                    except AdmissionError:
                        refused.append(s)
                assert len(refused) in (0, 2)
                rid += 1
        elif o[0] == "step":
            plans = [s.plan_step() for s in (batched, single)]
            assert prepare_fields(plans[0]) == prepare_fields(plans[1])
            if plans[0] is not None:
                check_pool(batched, plans[0])
                assert state(batched) == state(single)
                for s, plan in zip((batched, single), plans):
                    s.on_result(plan, fake_result(plan, np.random.default_rng(o[1])))
        else:
            for s in (batched, single):
                s.cancel(o[1])
        check_pool(batched)
        check_keys(batched)
        assert state(batched) == state(single)


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    data=st.data(),
)
def test_hashing_one_page_of_many_rows_equals_extend(page_size, data):
    h = PrefixHasher(page_size, 64, seed=data.draw(st.integers(0, 2**32)))
    rows = data.draw(st.integers(1, 6))
    streams, starts, states, want = [], [], [], []
    for _ in range(rows):
        pages = data.draw(st.integers(1, 64 // page_size))
        size = pages * page_size
        tokens = np.array(data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=size, max_size=size)), dtype=np.int32)
        keys, _ = h.extend((0, 0), tokens, 0, pages * page_size)
        start = (pages - 1) * page_size
        streams.append(tokens[start:])
        starts.append(start)
        states.append(keys[-2] if pages > 1 else (0, 0))
        want.append(keys[-1])
    assert h.next_pages(states, np.stack(streams), np.array(starts)) == want


def test_a_running_row_s_fast_output_is_the_dataclass_s_own():
    fast = _running_output(7, (3,), (-0.25,))
    slow = RequestOutput(7, (3,), (-0.25,), False, None)
    assert fast == slow and repr(fast) == repr(slow) and hash(fast) == hash(slow)
    assert dataclasses.asdict(fast) == dataclasses.asdict(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.finished = True
