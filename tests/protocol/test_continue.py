"""CONTINUE: a steady decode step said after the PREPARE before it (protocol/continuation.py), as
both halves of the conversation send, refuse and expand it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import decode, encode
from protocol.continuation import CARRIED, KEPT, UNUSED, WORKED_OUT, expand
from protocol.conversation import PrepareReceived, Refused
from protocol.errors import ProtocolError, RejectCode
from protocol.frames import ARRAY_DTYPES, PREPARE_FIELDS, Abort, Continue, Extent, Go, Prepare, Ready
from protocol.page_tables import HeldPageTables
from protocol.validate import validate_continued, validate_prepare
from tests.protocol.conversation_helpers import frame, result, running_scheduler, welcomed_executor
from tests.protocol.wire_samples import GEOMETRY, KEY, valid_prepare, with_arrays

I32 = np.int32


def held_prepare(**arrays: object) -> Prepare:
    """A valid PREPARE whose third sequence fills its second page exactly, so its next token needs
    a third; the second sequence has a sampling state sent whole, the third one held."""
    p = with_arrays(valid_prepare(context_lens=(3, 20, 32, 50)), sampling_state=[0, 1, 2, 0], **arrays)
    validate_prepare(p, GEOMETRY)
    return p


def brief(new_pages: object = (-1, -1, 77, -1), cleared: object = (77,), poison: object = (300,)) -> Continue:
    return Continue(np.asarray(new_pages, I32), np.asarray(cleared, I32), np.asarray(poison, I32))


def assert_same_prepare(got: Prepare, want: Prepare) -> None:
    for name, dtype in ARRAY_DTYPES[Prepare].items():
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == dtype, name
        assert np.array_equal(a, b), f"{name}: {a} != {b}"


def test_a_continue_is_the_step_before_one_token_on() -> None:
    held = held_prepare()
    got = expand(held, brief())
    validate_prepare(got, GEOMETRY)
    assert got.context_lens.tolist() == [4, 21, 33, 51]
    assert got.positions.tolist() == [3, 20, 32, 50]
    assert got.query_lens.tolist() == got.sample.tolist() == got.feedback.tolist() == [1, 1, 1, 1]
    assert got.token_ids.tolist() == [0, 0, 0, 0]  # placeholders: the executors feed the samples back
    assert got.page_table_base.tolist() == held.page_table_lens.tolist() == [1, 2, 2, 4]
    assert got.page_table_lens.tolist() == [1, 2, 3, 4]
    assert got.page_table.tolist() == [77]
    assert got.sampling_state.tolist() == [0, 2, 2, 0]  # sent whole at the step before: held now
    for name in KEPT:
        assert np.array_equal(getattr(got, name), getattr(held, name)), name
    assert got.cleared_pages.tolist() == [77] and got.poison_pages.tolist() == [300]
    for f in UNUSED:  # at their declared defaults: nothing restored, offloaded, banned or sent whole
        want = np.full(4 if f.extent is Extent.SEQUENCE else 0, f.default, dtype=f.dtype)
        assert np.array_equal(getattr(got, f.name), want), f.name
    # The executors' page tables grow by the CONTINUE's page, on the tables the step before left.
    tables = HeldPageTables()
    tables.apply(held)
    table = tables.apply(got)
    ends = np.cumsum(got.page_table_lens)
    assert table[ends[2] - 1] == 77 and table[: ends[1]].tolist() == held.page_table[: ends[1]].tolist()


def test_every_prepare_field_has_exactly_one_rule() -> None:
    names = [*KEPT, *CARRIED, *WORKED_OUT, *(f.name for f in UNUSED)]
    assert sorted(names) == sorted(f.name for f in PREPARE_FIELDS)
    assert len(names) == len(set(names))


def test_expanded_arrays_are_read_only_like_decoded_ones() -> None:
    got = expand(held_prepare(), brief())
    for name in ("query_lens", "token_ids", "sample", "feedback", "history", "restore_pages"):
        with pytest.raises(ValueError):
            getattr(got, name)[:1] = 1


@pytest.mark.parametrize(
    ("continuation", "sample", "code"),
    [
        (brief(new_pages=(-1, -1, 77)), (1, 1, 1, 1), RejectCode.LENGTH_MISMATCH),
        (brief(new_pages=(-1, -2, 77, -1)), (1, 1, 1, 1), RejectCode.PAGE_OUT_OF_RANGE),
        (brief(), (1, 0, 1, 1), RejectCode.FEEDBACK_WITHOUT_SAMPLE),
    ],
)
def test_a_continue_that_does_not_fit_the_step_before_is_refused(continuation: Continue, sample: tuple, code: RejectCode) -> None:
    held = held_prepare(sample=sample)
    with pytest.raises(ProtocolError) as err:
        expand(held, continuation)
    assert err.value.code is code


def test_the_codec_carries_a_continue() -> None:
    sent = frame(brief(), 2)
    got = decode(encode(sent, KEY), KEY).body
    assert isinstance(got, Continue)
    assert [got.new_pages.tolist(), got.cleared_pages.tolist(), got.poison_pages.tolist()] == [[-1, -1, 77, -1], [77], [300]]


# -- the executor's half -----------------------------------------------------------------------------


def run_step(conv, step: int, body) -> list:
    events = conv.receive(frame(body, step))
    if len(events) == 1 and isinstance(events[0], PrepareReceived):
        conv.ready(step)
        assert conv.receive(frame(Go(), step))
    return events


def test_an_executor_answers_a_continue_as_the_prepare_it_expands_to() -> None:
    conv = welcomed_executor(0, 1)
    held = held_prepare()
    (first,) = run_step(conv, 1, held)
    (second,) = run_step(conv, 2, brief())
    assert isinstance(second, PrepareReceived) and second.step == 2
    assert_same_prepare(second.prepare, expand(held, brief()))
    # A chain: step 3 continues the expansion of step 2.
    (third,) = run_step(conv, 3, brief(new_pages=(-1, -1, -1, 78), cleared=(78,), poison=()))
    assert isinstance(third, PrepareReceived)
    assert third.prepare.context_lens.tolist() == [5, 22, 34, 52]
    assert third.prepare.page_table_base.tolist() == [1, 2, 3, 4] and third.prepare.page_table.tolist() == [78]


def test_a_continue_with_no_step_before_held_is_refused() -> None:
    conv = welcomed_executor(0, 1)
    (event,) = conv.receive(frame(brief(), 1))
    assert isinstance(event, Refused) and event.error.code is RejectCode.STEP_NOT_HELD


def test_a_continue_after_a_refused_prepare_is_refused() -> None:
    conv = welcomed_executor(0, 1)
    run_step(conv, 1, held_prepare())
    (bad,) = conv.receive(frame(with_arrays(held_prepare(), cleared_pages=[9, 8]), 2))
    assert isinstance(bad, Refused) and bad.error.code is RejectCode.CLEARED_NOT_SORTED_UNIQUE
    conv.reject(2, bad.error)
    assert conv.receive(frame(Abort("refused"), 2))
    (event,) = conv.receive(frame(brief(), 3))
    assert isinstance(event, Refused) and event.error.code is RejectCode.STEP_NOT_HELD


def test_a_continue_after_the_step_before_was_aborted_is_refused() -> None:
    conv = welcomed_executor(0, 2)
    run_step(conv, 1, held_prepare())
    (staged,) = conv.receive(frame(brief(), 2))
    assert isinstance(staged, PrepareReceived)
    conv.ready(2)
    assert conv.receive(frame(Abort("rank 1 refused"), 2))[0].dropped
    (event,) = conv.receive(frame(brief(), 3))
    assert isinstance(event, Refused) and event.error.code is RejectCode.STEP_NOT_HELD


def test_a_continue_whose_expansion_breaks_a_rule_is_refused_by_that_rule() -> None:
    conv = welcomed_executor(0, 1)
    run_step(conv, 1, held_prepare())
    run_step(conv, 2, brief())
    none = brief(new_pages=(-1, -1, -1, -1), cleared=(), poison=())
    for step in range(3, 14):
        assert isinstance(run_step(conv, step, none)[0], PrepareReceived)
    # The second sequence's 33rd token needs a third page, and the CONTINUE gives it none.
    (event,) = conv.receive(frame(none, 14))
    assert isinstance(event, Refused) and event.error.code is RejectCode.PAGE_TABLE_TOO_SHORT
    conv.reject(14, event.error)
    conv.receive(frame(Abort("refused"), 14))
    (after,) = conv.receive(frame(none, 15))
    assert isinstance(after, Refused) and after.error.code is RejectCode.STEP_NOT_HELD


# -- the scheduler's half ----------------------------------------------------------------------------


def test_the_scheduler_sends_a_continue_only_after_the_step_before_went_out() -> None:
    conv = running_scheduler(world=1, max_inflight=2)
    held, short = held_prepare(), brief()
    assert conv.prepare(1, held, short).body is held  # nothing held yet
    conv.receive(0, frame(Ready(0), 1), 0.0)
    conv.go(1)
    assert conv.prepare(2, held, short).body is short
    conv.receive(0, frame(Ready(0), 2), 0.0)
    conv.abort(2, "a rank refused it")
    assert conv.prepare(3, held, short).body is held  # step 2 was aborted: the ranks hold nothing
    conv.receive(0, frame(Ready(0), 3), 0.0)
    conv.go(3)
    conv.receive(0, frame(result((1000, 1001, 1002, 1003)), 1), 0.0)
    assert conv.prepare(4, held).body is held  # no CONTINUE offered


# -- validation -----------------------------------------------------------------------------------

pages = st.integers(-1, GEOMETRY.num_kv_pages + 2)


@st.composite
def held_and_continue(draw: st.DrawFn) -> tuple[Prepare, Continue]:
    """A valid PREPARE of 1-6 decode sequences anywhere up to max_model_len, and a CONTINUE after it
    that may break any rule a CONTINUE can: a context past max_model_len, a table too short or past
    max_pages_per_seq, page ids out of range, clears out of order."""
    n = draw(st.integers(1, 6))
    max_len, size = GEOMETRY.max_model_len, GEOMETRY.page_size
    contexts = draw(st.lists(st.sampled_from([1, size - 1, size, size + 1, max_len - size, max_len - 1, max_len]), min_size=n, max_size=n))
    held = valid_prepare((1,) * n, tuple(contexts), cleared_pages=(), restore=(), offload=(), poison_pages=())
    held = with_arrays(held, sampling_state=draw(st.lists(st.sampled_from([0, 1, 2]), min_size=n, max_size=n)))
    validate_prepare(held, GEOMETRY)
    new_pages = draw(st.lists(st.one_of(st.just(-1), st.just(-1), pages), min_size=n, max_size=n))
    cleared = draw(st.lists(pages, max_size=4).map(lambda c: c if draw(st.booleans()) else sorted(set(c))))
    poison = draw(st.lists(pages, max_size=2))
    return held, brief(new_pages, cleared, poison)


def verdict(check, p: Prepare) -> RejectCode | None:
    try:
        check(p, GEOMETRY)
    except ProtocolError as exc:
        return exc.code
    return None


@settings(max_examples=400, deadline=None)
@given(held_and_continue())
def test_a_continues_short_validation_gives_the_whole_validations_verdict(case: tuple[Prepare, Continue]) -> None:
    held, c = case
    p = expand(held, c)
    assert verdict(validate_continued, p) == verdict(validate_prepare, p)


def test_the_short_validation_refuses_what_a_continue_can_break() -> None:
    # Each rule the property above must have seen fail, by hand.
    at_limit = valid_prepare((1,), (GEOMETRY.max_model_len,), cleared_pages=(), restore=(), offload=(), poison_pages=())
    full_table = valid_prepare((1,), (GEOMETRY.max_model_len - 1,), cleared_pages=(), restore=(), offload=(), poison_pages=())
    fits = valid_prepare((1,), (20,), cleared_pages=(), restore=(), offload=(), poison_pages=())
    cases = [
        (expand(at_limit, brief((-1,), (), ())), RejectCode.BAD_CONTEXT_LEN),
        (expand(full_table, brief((5,), (), ())), RejectCode.LIMIT_EXCEEDED),
        (expand(fits, brief((GEOMETRY.num_kv_pages,), (), ())), RejectCode.PAGE_OUT_OF_RANGE),
        (expand(fits, brief((-1,), (9, 8), ())), RejectCode.CLEARED_NOT_SORTED_UNIQUE),
        (expand(fits, brief((-1,), (), (GEOMETRY.num_kv_pages,))), RejectCode.PAGE_OUT_OF_RANGE),
    ]
    for p, code in cases:
        assert verdict(validate_continued, p) is code == verdict(validate_prepare, p)
