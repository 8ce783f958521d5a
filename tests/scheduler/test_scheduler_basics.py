"""Admission, stop conditions, cancellation, results, the PREPARE's shape, and no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from protocol import codec
from protocol.frames import ARRAY_DTYPES, Frame, Prepare, Result
from scheduler import (
    AdmissionError,
    InvalidSamplingParams,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    SchedulerStateError,
)


def cfg(**kw) -> SchedulerConfig:
    base = dict(num_kv_pages=16, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, eos_token_ids=(2,))
    base.update(kw)
    return SchedulerConfig(**base)


def result_for(plan, tokens, finite=None) -> Result:
    idx = np.flatnonzero(plan.prepare.sample)
    n = idx.shape[0]
    return Result(
        seq_ids=plan.prepare.seq_ids[idx].astype(np.int64),
        token_ids=np.array(tokens[:n], dtype=np.int32),
        logprobs=np.full(n, -0.5, dtype=np.float32),
        finite=np.ones(n, dtype=np.uint8) if finite is None else np.array(finite, dtype=np.uint8),
    )


def test_scheduler_imports_no_torch():
    code = "import sys, scheduler, scheduler.scheduler, protocol.frames; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=".", timeout=60).returncode == 0


def test_admission_errors_are_clear():
    s = Scheduler(cfg())
    with pytest.raises(AdmissionError, match="prompt of 30 tokens \\+ max_tokens 5 exceeds max_model_len 32"):
        s.add_request(0, [3] * 30, SamplingParams(max_tokens=5))
    small = Scheduler(cfg(num_kv_pages=2))
    with pytest.raises(AdmissionError, match="needs 3 pages of 4 tokens but the cache has only 2"):
        small.add_request(0, [3] * 9, SamplingParams(max_tokens=2))
    with pytest.raises(AdmissionError, match="empty prompt"):
        s.add_request(1, [], SamplingParams())
    with pytest.raises(AdmissionError, match="negative token"):
        s.add_request(1, [3, -1], SamplingParams())
    arrays = (np.array([[3, 4]]), np.array([3, 1.5]), np.array([3, 2**40]))
    for bad in ([3, 1.5], [3, "7"], (3, 2**31), [[3, 4]], *arrays):
        with pytest.raises(AdmissionError, match="invalid prompt"):
            s.add_request(1, bad, SamplingParams())
    s.add_request(1, [3], SamplingParams())
    with pytest.raises(AdmissionError, match="already in use"):
        s.add_request(1, [3], SamplingParams())
    assert s.stats().waiting == 1


def test_a_prompt_is_the_same_whatever_sequence_type_carries_it():
    s = Scheduler(cfg())
    ids = [3, 2**31 - 1, 0, 7]
    for rid, prompt in enumerate((ids, tuple(ids), np.array(ids, dtype=np.int64), np.array(ids, dtype=np.int32))):
        s.add_request(rid, prompt, SamplingParams(max_tokens=2))
    p = s.plan_step().prepare
    assert p.token_ids.dtype == np.int32 and p.token_ids.tolist() == ids * 4


def test_bad_config_and_params_are_refused():
    with pytest.raises(SchedulerConfigError, match="max_num_batched_tokens"):
        cfg(max_num_batched_tokens=2)
    with pytest.raises(SchedulerConfigError, match="page_size"):
        cfg(page_size=0)
    with pytest.raises(InvalidSamplingParams, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidSamplingParams, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_prepare_arrays_have_the_wire_dtypes_and_sampling_fields():
    s = Scheduler(cfg())
    s.add_request(7, [3, 4, 5, 6, 7], SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=11))
    s.add_request(8, [3, 4], SamplingParams())
    plan = s.plan_step()
    p = plan.prepare
    for name, dtype in ARRAY_DTYPES[Prepare].items():
        assert getattr(p, name).dtype == dtype, name
    assert p.seq_ids.tolist() == [7, 8] and p.query_lens.tolist() == [5, 2]
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert p.temperature.tolist() == pytest.approx([0.7, 0.0]) and p.top_k.tolist() == [5, 0]
    assert p.seeds.tolist() == [11, -1] and p.sample.tolist() == [1, 1]
    assert p.page_table_lens.tolist() == [2, 1] and p.page_table.tolist() == [0, 1, 2]
    assert plan.step == 1


def test_prepare_encodes_with_the_codec():
    s = Scheduler(cfg())
    s.add_request(1, [3, 4, 5], SamplingParams())
    plan = s.plan_step()
    key = b"k" * 32
    frame = Frame(version=1, layout=1, run_id="r", step=plan.step, seq=1, body=plan.prepare)
    back = codec.decode(codec.encode(frame, key), key)
    assert np.array_equal(back.body.page_table, plan.prepare.page_table)


def test_stop_conditions():
    s = Scheduler(cfg())
    s.add_request(0, [3, 4], SamplingParams(max_tokens=5))  # eos
    s.add_request(1, [3, 4], SamplingParams(max_tokens=5, ignore_eos=True))  # eos ignored, length
    s.add_request(2, [3, 4], SamplingParams(max_tokens=5, stop_token_ids=(9,)))  # stop token
    outs = []
    toks = {0: [5, 2], 1: [2, 2, 2, 2, 2], 2: [5, 9]}
    i = 0
    while s.has_work():
        plan = s.plan_step()
        ids = plan.prepare.seq_ids[plan.prepare.sample.astype(bool)].tolist()
        outs += s.on_result(plan, result_for(plan, [toks[r][i] for r in ids]))
        i += 1
    ends = {o.request_id: (o.finish_reason, o.token_ids) for o in outs if o.finished}
    assert ends == {0: ("stop", (2,)), 1: ("length", (2,)), 2: ("stop", (9,))}
    streamed = [t for o in outs if o.request_id == 1 for t in o.token_ids]
    assert streamed == [2, 2, 2, 2, 2]


def test_non_finite_row_fails_only_that_request_and_emits_nothing():
    s = Scheduler(cfg())
    s.add_request(0, [3, 4], SamplingParams())
    s.add_request(1, [5, 6], SamplingParams())
    plan = s.plan_step()
    outs = s.on_result(plan, result_for(plan, [7, 8], finite=[0, 1]))
    by_id = {o.request_id: o for o in outs}
    assert by_id[0].finish_reason == "error" and by_id[0].token_ids == ()
    assert "not finite" in by_id[0].error
    assert by_id[1].token_ids == (8,) and not by_id[1].finished
    assert s.stats().running == 1


def test_cancel_waiting_running_and_in_flight():
    s = Scheduler(cfg(max_num_seqs=1, max_num_batched_tokens=8))
    s.add_request(0, [3, 4], SamplingParams())
    s.add_request(1, [3, 4], SamplingParams())
    s.add_request(2, [3, 4], SamplingParams())
    s.cancel(2)  # waiting
    assert [(o.request_id, o.finish_reason) for o in s.drain_outputs()] == [(2, "cancelled")]
    plan = s.plan_step()
    s.cancel(0)  # in flight: ends now, its token is never emitted, its pages wait for the step
    s.finish(1)  # waiting
    assert sorted((o.request_id, o.finish_reason, o.token_ids) for o in s.drain_outputs()) == [
        (0, "cancelled", ()), (1, "stop", ())
    ]
    assert s.request_state(0).page_table == (0,) and s.running_requests() == ()
    assert s.on_result(plan, result_for(plan, [9])) == []
    assert s.request_state(0) is None
    assert not s.has_work() and s.pool.free_count + s.cache.evictable_count == 16
    s.cancel(0)  # unknown now: ignored
    assert s.drain_outputs() == []


def test_step_numbers_count_aborted_steps_and_order_is_enforced():
    s = Scheduler(cfg())
    s.add_request(0, [3, 4], SamplingParams(max_tokens=4))
    s.add_request(1, [3, 5], SamplingParams(max_tokens=4))
    p1 = s.plan_step()
    with pytest.raises(SchedulerStateError, match="still in flight"):
        s.plan_step()
    s.on_abort(p1, "timeout")
    with pytest.raises(SchedulerStateError):
        s.on_result(p1, result_for(p1, [1, 1]))
    s.add_request(2, [3, 4], SamplingParams(max_tokens=4))
    p2 = s.plan_step()
    assert (p1.step, p2.step) == (1, 2)
    assert s.stats().aborted_steps_total == 1 and s.stats().steps_total == 2


def test_result_that_does_not_match_the_plan_fails_the_step():
    s = Scheduler(cfg())
    s.add_request(0, [3, 4], SamplingParams())
    plan = s.plan_step()
    bad = Result(seq_ids=np.array([5], dtype=np.int64), token_ids=np.array([1], dtype=np.int32),
                 logprobs=np.zeros(1, dtype=np.float32), finite=np.ones(1, dtype=np.uint8))
    outs = s.on_result(plan, bad)
    assert [(o.request_id, o.finish_reason) for o in outs] == [(0, "error")]
    assert "do not match" in outs[0].error


def test_chunked_prefill_mixes_with_decode_under_the_budget():
    s = Scheduler(cfg(max_num_batched_tokens=6, max_model_len=64, num_kv_pages=32))
    s.add_request(0, [3, 4], SamplingParams(max_tokens=20, ignore_eos=True))
    plan = s.plan_step()
    s.on_result(plan, result_for(plan, [5]))
    s.add_request(1, list(range(3, 23)), SamplingParams(max_tokens=2))  # 20 tokens
    chunks = []
    for _ in range(5):
        plan = s.plan_step()
        p = plan.prepare
        assert int(p.query_lens.sum()) <= 6
        chunks.append(dict(zip(p.seq_ids.tolist(), p.query_lens.tolist())))
        s.on_result(plan, result_for(plan, [5, 5]))
    assert chunks[:4] == [{0: 1, 1: 5}] * 4
    assert chunks[4] == {0: 1, 1: 1}


def test_pages_of_a_non_finite_row_never_become_snapshots():
    s = Scheduler(cfg())
    s.add_request(0, list(range(3, 11)), SamplingParams())  # two full pages
    plan = s.plan_step()
    s.on_result(plan, result_for(plan, [7], finite=[0]))
    assert s.stats().pages_cached == 0
    s.add_request(1, list(range(3, 11)), SamplingParams(max_tokens=2))
    plan = s.plan_step()
    assert plan.prepare.query_lens.tolist() == [8]  # no prefix hit: recomputed from scratch


def test_decode_steps_send_only_the_pages_the_executors_do_not_hold():
    s = Scheduler(cfg(num_kv_pages=32, max_num_seqs=3))
    for rid, n in ((0, 3), (1, 6), (2, 9)):
        s.add_request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=12, ignore_eos=True))
    held: dict[int, int] = {}
    whole = 0
    for _ in range(10):
        plan = s.plan_step()
        p = plan.prepare
        for i, rid in enumerate(p.seq_ids.tolist()):
            assert int(p.page_table_base[i]) == held.get(rid, 0)
        assert p.page_table.shape[0] == int((p.page_table_lens - p.page_table_base).sum())
        whole += int(p.page_table_base.sum() == 0)
        held = dict(zip(p.seq_ids.tolist(), p.page_table_lens.tolist()))
        s.on_result(plan, result_for(plan, [7] * 3))
    assert whole == 1  # only the step that admitted them sent whole tables


def test_after_an_aborted_step_every_table_is_sent_whole():
    s = Scheduler(cfg())
    s.add_request(0, [3, 4, 5, 6, 7], SamplingParams(max_tokens=8))
    plan = s.plan_step()
    s.on_result(plan, result_for(plan, [9]))
    s.add_request(1, [3, 4, 5], SamplingParams(max_tokens=8))
    plan = s.plan_step()
    assert plan.prepare.page_table_base.tolist() == [2, 0]
    s.on_abort(plan, "rank 1 rejected the frame")
    s.add_request(2, [3, 4, 5], SamplingParams(max_tokens=8))
    plan = s.plan_step()
    assert plan.prepare.page_table_base.tolist() == [0]
    assert plan.prepare.page_table.shape[0] == int(plan.prepare.page_table_lens.sum())


def test_an_admission_round_shares_each_prompt_s_own_prefix_hit():
    s = Scheduler(cfg(num_kv_pages=32, max_num_seqs=5, max_num_batched_tokens=64))
    cached = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # three full pages
    s.add_request(0, cached + [5], SamplingParams(max_tokens=1))
    plan = s.plan_step()
    s.on_result(plan, result_for(plan, [9]))
    snapshot = plan.prepare.page_table[:3].tolist()
    prompts = {
        1: cached + [6],  # all three pages
        2: cached[:8] + [30, 31, 32, 33, 7],  # the first two, then its own
        3: cached + [8, 9],  # all three again, after a round-mate that had two
        4: [40] + cached[1:] + [5],  # none: it differs in the first token
    }
    for rid, prompt in prompts.items():
        s.add_request(rid, prompt, SamplingParams(max_tokens=2))
    plan = s.plan_step()
    p = plan.prepare
    tables = np.split(p.page_table, np.cumsum(p.page_table_lens)[:-1])  # all sent whole: new rows
    assert p.page_table_base.tolist() == [0, 0, 0, 0]
    got = {rid: t.tolist() for rid, t in zip(p.seq_ids.tolist(), tables)}
    assert got[1][:3] == snapshot and got[3][:3] == snapshot
    assert got[2][:2] == snapshot[:2] and got[2][2] not in snapshot
    assert not set(got[4]) & set(snapshot)
    assert s.stats().prefix_hit_pages_total == 8
    assert [int(s.pool.refcount[page]) for page in snapshot] == [3, 3, 2]


def test_errors_derive_from_the_runtime_base_and_misuse_stays_apart():
    from protocol.errors import TPRuntimeError
    from scheduler import PagePoolError

    for err in (AdmissionError, SchedulerStateError, SchedulerConfigError, InvalidSamplingParams, PagePoolError):
        assert issubclass(err, TPRuntimeError), err
    assert not issubclass(AdmissionError, SchedulerStateError) and not issubclass(SchedulerStateError, AdmissionError)
    assert issubclass(SchedulerConfigError, ValueError) and issubclass(InvalidSamplingParams, ValueError)
