"""PREPARE's array fields are declared once (protocol.frames.PREPARE_FIELDS) and everything else is
derived from the declarations: the codec's dtypes, the validator's length rules, the defaults of
hand-built steps and the scheduler's assembly."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import ARRAY_DTYPES, PREPARE_FIELDS, CacheGeometry, Extent, KVDtype, Prepare, unused_fields
from protocol.validate import prepare as rules
from protocol.validate.prepare import validate_prepare


def test_the_declarations_are_prepares_fields_in_order_and_give_the_codecs_dtypes():
    names = [f.name for f in fields(Prepare)]
    assert [f.name for f in PREPARE_FIELDS] == names[: len(PREPARE_FIELDS)]
    assert names[len(PREPARE_FIELDS) :] == ["decode_steps"]  # the one scalar, after the arrays
    assert ARRAY_DTYPES[Prepare] == {f.name: f.dtype for f in PREPARE_FIELDS}
    for f in PREPARE_FIELDS:
        if f.extent is Extent.COUNTED:
            assert f.counts in {g.name for g in PREPARE_FIELDS if g.extent is Extent.SEQUENCE}, f.name


def test_the_validators_lists_are_derived_from_the_declarations():
    per_sequence = {f.name for f in PREPARE_FIELDS if f.extent is Extent.SEQUENCE} - {"seq_ids"}
    assert set(rules._PER_SEQUENCE) == per_sequence
    assert {name for _, names, _ in rules._FLAT for name in names} == {
        f.name for f in PREPARE_FIELDS if f.extent is Extent.COUNTED
    }
    assert set(rules._PER_TOKEN) == {"token_ids", "positions"}


def test_a_per_sequence_field_of_the_wrong_length_is_rejected_by_name():
    geometry = CacheGeometry(
        num_kv_pages=16, page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype=KVDtype.FP32.value,
        vocab_size=64, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64, num_host_pages=0,
    )
    good = Prepare.greedy([1, 1], [3, 5], [1, 2], [1, 2], [0, 1, 2])
    validate_prepare(good, geometry)
    arrays = {f.name: getattr(good, f.name) for f in PREPARE_FIELDS}
    for f in PREPARE_FIELDS:
        if f.extent is not Extent.SEQUENCE or f.name == "seq_ids":
            continue
        broken = Prepare(**{**arrays, f.name: np.append(arrays[f.name], arrays[f.name][:1])})
        with pytest.raises(ProtocolError) as raised:
            validate_prepare(broken, geometry)
        assert raised.value.code == RejectCode.LENGTH_MISMATCH and f.name in str(raised.value)


def test_unused_fields_take_each_declared_default():
    arrays = unused_fields(3)
    for f in PREPARE_FIELDS:
        expected = 3 if f.extent is Extent.SEQUENCE else 0
        assert arrays[f.name].shape == (expected,) and arrays[f.name].dtype == f.dtype
        assert (arrays[f.name] == f.default).all()
