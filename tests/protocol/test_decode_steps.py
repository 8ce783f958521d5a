"""decode_steps: a steady decode step that runs several forwards on one frame (protocol 9), as the
validator, the codec and a CONTINUE after it see it; and CUT, which ends such a step early."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import decode, encode
from protocol.continuation import expand
from protocol.conversation import CutReceived, GoReceived, PrepareReceived
from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import LAYOUT_VERSION, MAX_DECODE_STEPS, PROTOCOL_VERSION, Continue, Cut, Frame, Go, Prepare, Ready
from protocol.validate import validate_continued, validate_prepare
from tests.protocol.conversation_helpers import PREPARE, frame, result, running_scheduler, welcomed_executor
from tests.protocol.wire_samples import GEOMETRY, KEY, valid_prepare, with_arrays

I32 = np.int32
PS = GEOMETRY.page_size


def decode_step(context_lens=(3, 20, 32, 50), steps: int = 4, **arrays: object) -> Prepare:
    """A plain decode step of `steps` forwards whose page tables hold the last forward's context."""
    p = valid_prepare((1,) * len(context_lens), context_lens, restore=(), offload=())
    final = [c + steps - 1 for c in context_lens]
    tables = [list(range(100 * i, 100 * i + -(-f // PS))) for i, f in enumerate(final)]
    return dataclasses.replace(
        with_arrays(p, page_table_lens=[len(t) for t in tables], page_table=sum(tables, []), **arrays),
        decode_steps=steps,
    )


def refusal(p: Prepare) -> RejectCode:
    with pytest.raises(ProtocolError) as err:
        validate_prepare(p, GEOMETRY)
    return err.value.code


def test_a_plain_decode_step_of_several_forwards_passes_and_round_trips() -> None:
    p = decode_step()
    validate_prepare(p, GEOMETRY)
    assert p.final_context_lens.tolist() == [6, 23, 35, 53]
    got = decode(encode(Frame(PROTOCOL_VERSION, LAYOUT_VERSION, "run", 3, 1, p), KEY), KEY).body
    assert got.decode_steps == 4
    assert got.final_context_lens.tolist() == p.final_context_lens.tolist()


@pytest.mark.parametrize("steps", [0, -1, PS + 1, MAX_DECODE_STEPS + 1])
def test_a_count_outside_one_to_the_page_size_is_refused(steps: int) -> None:
    assert refusal(dataclasses.replace(decode_step(), decode_steps=steps)) is RejectCode.BAD_DECODE_STEPS


def test_several_forwards_only_for_a_plain_decode() -> None:
    prefill = dataclasses.replace(valid_prepare(restore=(), offload=()), decode_steps=2)
    assert refusal(prefill) is RejectCode.BAD_DECODE_STEPS
    assert refusal(with_arrays(decode_step(), sample=[1, 0, 1, 1])) is RejectCode.BAD_DECODE_STEPS
    banned = with_arrays(decode_step(), banned_lens=[0, 1, 0, 0], banned_ids=[2])
    validate_prepare(dataclasses.replace(banned, decode_steps=1), GEOMETRY)  # a ban alone is fine
    assert refusal(banned) is RejectCode.BAD_DECODE_STEPS


def test_the_tables_must_hold_the_last_forwards_context() -> None:
    # Sequence 2 fills its second page at the first forward: the fourth needs a third page.
    short = decode_step(steps=1)
    validate_prepare(short, GEOMETRY)
    assert refusal(dataclasses.replace(short, decode_steps=4)) is RejectCode.PAGE_TABLE_TOO_SHORT


def test_no_forward_may_pass_max_model_len() -> None:
    m = GEOMETRY.max_model_len
    validate_prepare(decode_step((3, m - 3), steps=4), GEOMETRY)
    # Tables of max_pages_per_seq, as long as any may be: the fourth forward would write position m.
    past = dataclasses.replace(decode_step((3, m - 2), steps=3), decode_steps=4)
    assert refusal(past) is RejectCode.BAD_CONTEXT_LEN


def test_a_continue_after_several_forwards_starts_one_past_the_last() -> None:
    held = decode_step(steps=4)
    got = expand(held, Continue(np.array([-1, 300, -1, -1], I32), np.array([300], I32), np.zeros(0, I32), 2))
    validate_prepare(got, GEOMETRY)
    assert got.positions.tolist() == [6, 23, 35, 53]
    assert got.context_lens.tolist() == [7, 24, 36, 54]
    assert got.decode_steps == 2 and got.final_context_lens.tolist() == [8, 25, 37, 55]
    assert got.page_table_lens.tolist() == [1, 3, 3, 4]


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(-2, PS + 2), grow=st.lists(st.booleans(), min_size=4, max_size=4), held_steps=st.integers(1, 4))
def test_validate_continued_agrees_with_validate_prepare(steps: int, grow: list[bool], held_steps: int) -> None:
    """The CONTINUE's rules are the PREPARE's: the same verdict, the same code, on its expansion."""
    held = decode_step(steps=held_steps)
    validate_prepare(held, GEOMETRY)
    new_pages = np.array([400 + i if g else -1 for i, g in enumerate(grow)], I32)
    got = expand(held, Continue(new_pages, np.zeros(0, I32), np.zeros(0, I32), steps))
    verdicts = []
    for check in (validate_prepare, validate_continued):
        try:
            check(got, GEOMETRY)
            verdicts.append(None)
        except ProtocolError as exc:
            verdicts.append(exc.code)
    assert verdicts[0] == verdicts[1]


# -- CUT ----------------------------------------------------------------------------------------


def test_a_cut_reaches_a_running_step_and_changes_nothing_else() -> None:
    ex = welcomed_executor(0, 2)
    assert isinstance(ex.receive(frame(PREPARE, 1))[0], PrepareReceived)
    ex.ready(1)
    assert ex.receive(frame(Cut(), 1)) == []  # staged, not GOed: nothing runs yet
    assert isinstance(ex.receive(frame(Go(), 1))[0], GoReceived)
    assert ex.receive(frame(Cut(), 1)) == [CutReceived(1)]
    ex.result(1, result())
    assert ex.receive(frame(Cut(), 1)) == []  # crossed its RESULT on the wire: nothing to cut, nothing refused
    assert ex.receive(frame(Cut(), 7)) == []


def test_the_scheduler_cuts_only_a_goed_step_in_flight() -> None:
    conv = running_scheduler(world=2)
    conv.prepare(1, PREPARE)
    with pytest.raises(UsageError, match="not a GOed step"):
        conv.cut(1)
    for rank in (0, 1):
        conv.receive(rank, frame(Ready(rank), 1), 0.0)
    conv.go(1)
    body, step = conv.cut(1)
    assert isinstance(body, Cut) and step == 1
    got = decode(encode(Frame(PROTOCOL_VERSION, LAYOUT_VERSION, "run", 1, 2, body), KEY), KEY).body
    assert got == Cut()
    with pytest.raises(UsageError):
        conv.cut(2)
