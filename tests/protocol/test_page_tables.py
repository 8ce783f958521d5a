"""Page-table deltas: what an executor rebuilds from them is the table the sender meant."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import Prepare
from protocol.page_tables import HeldPageTables, delta_index


def step(tables: dict[int, list[int]], bases: dict[int, int]) -> Prepare:
    """A decode step of these sequences: whole tables in `tables`, pages below each base held."""
    ids = list(tables)
    lens = [len(tables[i]) for i in ids]
    base = [bases.get(i, 0) for i in ids]
    p = Prepare.greedy_decode(np.maximum(lens, 1), np.zeros(len(ids)), lens, [])
    return dataclasses.replace(
        p,
        seq_ids=np.asarray(ids, dtype=np.int64),
        page_table_base=np.asarray(base, dtype=np.int32),
        page_table=np.asarray([pg for i, b in zip(ids, base) for pg in tables[i][b:]], dtype=np.int32),
    )


def whole(tables: dict[int, list[int]]) -> list[int]:
    return [pg for t in tables.values() for pg in t]


# A run of steps: each picks the sequences it runs (in any order) and grows or replaces their tables.
steps_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(0, 7), unique=True, max_size=6),  # sequences in the step, in order
        st.lists(st.integers(0, 3), min_size=8, max_size=8),  # pages each one adds
        st.lists(st.booleans(), min_size=8, max_size=8),  # sent whole even though held
        st.booleans(),  # the step is aborted after its PREPARE
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(steps_strategy)
def test_deltas_rebuild_exactly_the_whole_tables(steps):
    """A sender that remembers what the receiver holds (as the scheduler does) and a receiver that
    applies the deltas agree at every step; an abort makes both forget everything."""
    held = HeldPageTables()
    tables: dict[int, list[int]] = {}
    sent: dict[int, int] = {}  # the sender's view of what the receiver holds
    next_page = 0
    for order, grow, resend, aborted in steps:
        now: dict[int, list[int]] = {}
        for seq in order:
            table = list(tables.get(seq, []))
            table.extend(range(next_page, next_page + grow[seq]))
            next_page += grow[seq]
            now[seq] = table
        bases = {seq: 0 if resend[seq] else sent.get(seq, 0) for seq in order}
        got = held.apply(step(now, bases))
        assert got.tolist() == whole(now)
        tables = {**tables, **now}
        if aborted:
            held.drop()
            sent = {}
        else:
            sent = {seq: len(t) for seq, t in now.items()}  # absent sequences are forgotten
            assert held.held(np.asarray(order, dtype=np.int64)).tolist() == [len(now[s]) for s in order]


def test_a_base_that_is_not_held_is_refused_and_changes_nothing():
    held = HeldPageTables()
    held.apply(step({1: [4, 5], 2: [6]}, {}))
    for bases in ({1: 3}, {1: 1}, {2: 2}, {3: 1}):
        with pytest.raises(ProtocolError) as err:
            held.apply(step({1: [4, 5, 7], 2: [6, 8], 3: [9]}, bases))
        assert err.value.code == RejectCode.PAGE_TABLE_BASE_MISMATCH
    assert held.held(np.array([1, 2, 3])).tolist() == [2, 1, 0]
    assert held.apply(step({2: [6, 8], 1: [4, 5, 7]}, {1: 2, 2: 1})).tolist() == [6, 8, 4, 5, 7]


def test_a_sequence_absent_from_a_step_is_forgotten():
    held = HeldPageTables()
    held.apply(step({1: [4, 5], 2: [6]}, {}))
    held.apply(step({2: [6]}, {2: 1}))
    with pytest.raises(ProtocolError):
        held.apply(step({1: [4, 5], 2: [6]}, {1: 2, 2: 1}))
    assert held.apply(step({1: [4, 5], 2: [6]}, {2: 1})).tolist() == [4, 5, 6]


def test_delta_index_puts_each_page_after_its_base():
    rows, cols = delta_index(np.array([2, 0, 1]), np.array([3, 2, 1]))
    assert rows.tolist() == [0, 1, 1] and cols.tolist() == [2, 0, 1]
