"""PREPARE's logits-processing fields as the scheduler plans them: neutral for requests that use none,
a sampling state sent whole exactly when the page table is (the prompt only for the repetition
penalty, including the part a prefix hit never sends as step tokens; the output so far; the logit
bias), held otherwise; stop tokens banned from the samples before min_tokens; alternatives asked for
and handed back with each token; parameters out of range refused."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.codec import decode, encode
from protocol.frames import ARRAY_DTYPES, Frame, Prepare, Result
from scheduler import InvalidSamplingParams, SamplingParams, Scheduler, SchedulerConfig

EOS = 2


def make(**kw) -> Scheduler:
    base = dict(num_kv_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                eos_token_ids=(EOS,))
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def run(s: Scheduler, plan, tokens: dict[int, int], alternatives: dict[int, list[tuple[int, float]]] | None = None):
    p = plan.prepare
    sampled = p.seq_ids[p.sample == 1]
    alternatives = alternatives or {}
    ids = [t for rid in sampled.tolist() for t, _ in alternatives.get(rid, [])]
    lps = [lp for rid in sampled.tolist() for _, lp in alternatives.get(rid, [])]
    result = Result(
        seq_ids=sampled.astype(np.int64), token_ids=np.array([tokens[r] for r in sampled.tolist()], dtype=np.int32),
        logprobs=np.full(sampled.shape[0], -0.5, dtype=np.float32), finite=np.ones(sampled.shape[0], dtype=np.uint8),
        top_token_ids=np.array(ids, dtype=np.int32), top_logprobs=np.array(lps, dtype=np.float32),
    )
    return s.on_result(plan, result)


def row(p: Prepare, rid: int) -> int:
    return p.seq_ids.tolist().index(rid)


def flat(p: Prepare, counts: str, values: str, i: int) -> list:
    c = getattr(p, counts)
    start = int(c[:i].sum())
    return getattr(p, values)[start : start + int(c[i])].tolist()


def test_a_plain_step_carries_neutral_processing_fields_with_the_wire_dtypes():
    s = make()
    s.add_request(1, [5, 6, 7], SamplingParams(max_tokens=3))
    p = s.plan_step().prepare
    for name, dtype in ARRAY_DTYPES[Prepare].items():
        assert getattr(p, name).dtype == dtype, name
    assert p.sampling_state.tolist() == [0] and p.num_logprobs.tolist() == [0]
    assert p.repetition_penalty.tolist() == [1.0] and p.presence_penalty.tolist() == [0.0]
    for name in ("history", "logit_bias_ids", "logit_bias", "banned_ids"):
        assert getattr(p, name).shape == (0,)
    decoded = decode(encode(Frame(3, 1, "r", 1, 1, p), b"k" * 32), b"k" * 32).body
    assert decoded.history_lens.tolist() == [0]


def test_the_state_travels_whole_once_then_is_held():
    s = make()
    prompt = [5, 6, 7, 8, 9]
    s.add_request(1, prompt, SamplingParams(max_tokens=4, repetition_penalty=1.2, presence_penalty=0.5,
                                            logit_bias=((3, -5.0), (11, 2.5))))
    s.add_request(2, [5, 6], SamplingParams(max_tokens=4, frequency_penalty=1.0))  # no repetition: no prompt
    s.add_request(3, [4, 4], SamplingParams(max_tokens=4))
    plan = s.plan_step()
    p = plan.prepare
    i, j, k = row(p, 1), row(p, 2), row(p, 3)
    assert p.sampling_state[[i, j, k]].tolist() == [1, 1, 0]
    assert flat(p, "history_lens", "history", i) == prompt and p.history_prompt_lens[i] == 5
    assert flat(p, "history_lens", "history", j) == [] and p.history_prompt_lens[j] == 0
    assert flat(p, "logit_bias_lens", "logit_bias_ids", i) == [3, 11]
    assert flat(p, "logit_bias_lens", "logit_bias", i) == [-5.0, 2.5]
    assert p.repetition_penalty[i] == np.float32(1.2) and p.frequency_penalty[j] == 1.0
    run(s, plan, {1: 20, 2: 21, 3: 22})
    p = s.plan_step().prepare
    assert p.sampling_state[[row(p, 1), row(p, 2), row(p, 3)]].tolist() == [2, 2, 0]
    assert p.history.shape == (0,) and p.logit_bias_ids.shape == (0,)


def test_after_an_abort_the_state_is_sent_whole_with_the_output_so_far():
    s = make()
    s.add_request(1, [5, 6, 7], SamplingParams(max_tokens=6, presence_penalty=1.0, repetition_penalty=1.1))
    run(s, s.plan_step(), {1: 30})
    run(s, s.plan_step(), {1: 31})
    s.on_abort(s.plan_step(), "rank 1 rejected the frame", failed_seq_ids=frozenset())
    p = s.plan_step().prepare
    assert p.sampling_state.tolist() == [1] and p.page_table_base.tolist() == [0]
    assert flat(p, "history_lens", "history", 0) == [5, 6, 7, 30, 31] and p.history_prompt_lens.tolist() == [3]


def test_a_prefix_hit_still_sends_the_whole_prompt_once():
    s = make()
    prompt = list(range(10, 23))
    s.add_request(1, prompt, SamplingParams(max_tokens=2))
    plan = s.plan_step()
    run(s, plan, {1: 30})
    run(s, s.plan_step(), {1: EOS})
    s.add_request(2, prompt, SamplingParams(max_tokens=2, repetition_penalty=1.5))
    p = s.plan_step().prepare
    assert p.query_lens.tolist() == [1]  # the prefix cache holds the rest: it never travels as step tokens
    assert flat(p, "history_lens", "history", 0) == prompt


def test_stop_tokens_are_banned_from_the_samples_before_min_tokens():
    s = make()
    s.add_request(1, [5, 6], SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(9, 4)))
    s.add_request(2, [5, 6], SamplingParams(max_tokens=5, min_tokens=2, ignore_eos=True))
    banned = []
    for token in (30, 31, 32):
        plan = s.plan_step()
        p = plan.prepare
        banned.append([flat(p, "banned_lens", "banned_ids", row(p, rid)) for rid in (1, 2)])
        run(s, plan, {1: token, 2: token})
    # Samples 0 and 1 may not be a stop token (eos 2 and its stop ids; eos ignored for request 2).
    assert banned == [[[2, 4, 9], []], [[2, 4, 9], []], [[], []]]
    assert s.plan_step().prepare.sampling_state.tolist() == [0, 0]  # min_tokens needs no state


def test_alternatives_are_asked_for_and_handed_back_with_each_token():
    s = make()
    s.add_request(1, [5, 6], SamplingParams(max_tokens=2, top_logprobs=2))
    s.add_request(2, [5, 7], SamplingParams(max_tokens=2))
    plan = s.plan_step()
    assert plan.prepare.num_logprobs.tolist() == [2, 0]
    outs = {o.request_id: o for o in run(s, plan, {1: 8, 2: 9}, {1: [(8, -0.25), (3, -2.5)]})}
    assert outs[1].top_logprobs == (((8, -0.25), (3, -2.5)),) and outs[2].top_logprobs == ()
    # A RESULT whose alternatives do not add up fails the step's requests, as any mismatched RESULT.
    plan = s.plan_step()
    outs = run(s, plan, {1: 8, 2: 9}, {1: [(8, -0.1)]})
    assert {o.request_id: o.finish_reason for o in outs} == {1: "error", 2: "error"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5}, {"frequency_penalty": -2.5}, {"repetition_penalty": 0.0},
        {"repetition_penalty": float("nan")}, {"min_tokens": 5}, {"min_tokens": -1},
        {"logit_bias": ((5, 1.0), (5, 2.0))}, {"logit_bias": ((6, 1.0), (5, 2.0))}, {"logit_bias": ((5, 101.0),)},
        {"logit_bias": tuple((i, 1.0) for i in range(301))}, {"top_logprobs": 21},
    ],
)
def test_out_of_range_parameters_are_refused(kwargs):
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(max_tokens=4, **kwargs)


def test_the_one_assembly_path_fills_every_declared_prepare_field():
    """scheduler.plan's row columns and computed arrays cover PREPARE's declarations between them
    (a field declared in protocol.frames and filled by neither would fail Prepare's constructor;
    one in both would be filled twice)."""
    from protocol.frames import PREPARE_FIELDS, Extent
    from scheduler.plan import PROCESSED, ROW_COLUMNS

    per_sequence = {f.name for f in PREPARE_FIELDS if f.extent is Extent.SEQUENCE}
    computed = {"query_lens", "context_lens", "page_table_lens", "page_table_base", "sample", "feedback"}
    processed = {f.name for f in PROCESSED if f.extent is Extent.SEQUENCE}
    assert set(ROW_COLUMNS) | computed | processed == per_sequence
    assert not (set(ROW_COLUMNS) & computed) and not (set(ROW_COLUMNS) & processed) and not (computed & processed)
