"""check_own_fields' shortcut (plainly_valid) may only pass what the rule-by-rule check passes, and it
must settle a server's usual steps, or it saves nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given

from protocol.errors import ProtocolError
from protocol.validate.own_fields import check_each_rule, plainly_valid
from protocol.validate.prepare import _check_shapes
from tests.protocol.test_prepare_mutations import BASES, DTYPES, EXTREMES, FIELDS, MUTATIONS, mutated
from tests.protocol.wire_samples import GEOMETRY as G
from tests.protocol.wire_samples import valid_prepare


def passes_each_rule(p) -> bool:
    try:
        check_each_rule(p, G)
    except ProtocolError:
        return False
    return True


def decode_step(n: int, **fields: np.ndarray):
    p = valid_prepare((1,) * n, tuple(range(20, 20 + n)), cleared_pages=(), restore=(), offload=(), poison_pages=())
    return dataclasses.replace(p, **fields)


def test_a_servers_usual_steps_are_settled_by_the_shortcut() -> None:
    n = 6
    f32 = np.float32
    steps = {
        "greedy": decode_step(n, temperature=np.zeros(n, f32)),
        "sampled": decode_step(n, temperature=np.full(n, 0.7, f32), top_p=np.full(n, 0.9, f32)),
        "greedy and sampled": decode_step(n),
        "fed back, seeded, top-k, logprobs": decode_step(
            n, feedback=np.ones(n, np.uint8), seeds=np.arange(n, dtype=np.int64), top_k=np.full(n, 40, np.int32),
            num_logprobs=np.full(n, 5, np.uint8), min_p=np.full(n, 0.05, f32),
        ),
        "banned ids": decode_step(n, banned_lens=np.full(n, 1, np.int32), banned_ids=np.full(n, 2, np.int32)),
        "prefill and decode": valid_prepare(),
    }
    for name, p in steps.items():
        assert passes_each_rule(p), name
        assert plainly_valid(p, G), name


def test_a_penalty_or_a_carried_list_goes_rule_by_rule() -> None:
    n = 3
    penalized = decode_step(
        n, presence_penalty=np.full(n, 0.5, np.float32), sampling_state=np.full(n, 2, np.uint8)
    )
    assert passes_each_rule(penalized) and not plainly_valid(penalized, G)


def check(p) -> None:
    if plainly_valid(p, G):
        assert passes_each_rule(p)


def test_every_own_field_at_every_extreme() -> None:
    for base in BASES:
        for name in FIELDS:
            dtype = DTYPES[name]
            for value in EXTREMES[dtype.str.lstrip("<|")]:
                original = getattr(base, name)
                for at in {0, original.size - 1} if original.size else ():
                    one = original.copy()
                    one[at] = value
                    check(dataclasses.replace(base, **{name: one}))


@MUTATIONS
@given(mutated())
def test_the_shortcut_passes_nothing_the_rules_refuse(p) -> None:
    # Only frames whose shapes are sound reach the own fields; others make no claim here.
    try:
        _check_shapes(p, G)
    except ProtocolError:
        return
    check(p)
