"""A correctly signed PREPARE with any one field mutated to an extreme value is refused with a coded
ProtocolError or accepted, never anything else, and whatever is accepted is safe to run: every page
id and slot in range, positions where the page tables put them, lengths that agree, sampling
parameters the sampler is exact at. When the refusal names sequences, the rest of the frame is
sound: resetting just those sequences' own fields makes it valid."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import decode, encode
from protocol.errors import ProtocolError, RejectCode
from protocol.frames import ARRAY_DTYPES, Frame, Prepare
from protocol.grammar import GRAMMAR_MAX_BYTES, GrammarKind
from protocol.page_tables import HeldPageTables
from protocol.sampling_limits import (
    FLOAT32_MAX,
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MAX_ENTRIES,
    PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    TEMPERATURE_MIN,
    TOP_LOGPROBS_MAX,
    TOP_P_MIN,
)
from protocol.validate import validate_prepare
from tests.protocol.wire_samples import GEOMETRY as G
from tests.protocol.wire_samples import KEY, valid_prepare

DTYPES = ARRAY_DTYPES[Prepare]
FIELDS = sorted(DTYPES)
I32 = np.iinfo(np.int32)
I64 = np.iinfo(np.int64)

EXTREMES = {
    "i4": [I32.min, I32.min + 1, -1, 0, 1, I32.max, I32.max - 1, G.num_kv_pages, G.num_kv_pages - 1, G.max_model_len,
           G.max_model_len + 1, G.vocab_size, G.page_size, G.max_pages_per_seq + 1, G.num_host_pages],
    "i8": [I64.min, -2, -1, 0, 1000, I64.max],
    "f4": [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 1e-40, 5e-6, TEMPERATURE_MIN, TOP_P_MIN, 1.0, 1.0000001, FLOAT32_MAX],
    "u1": [0, 1, 2, 255],
}


@st.composite
def valid_prepares(draw) -> Prepare:
    n = draw(st.integers(0, 5))
    query = [draw(st.integers(1, 8)) for _ in range(n)]
    context = [draw(st.integers(q, 200)) for q in query]
    pages = draw(st.lists(st.integers(0, G.num_kv_pages - 1), unique=True, max_size=12))
    cleared = sorted(pages[:4])
    restore = [(p, s) for p, s in zip(pages[4:7], range(3))]
    offload = [(p, s) for p, s in zip(pages[7:9], range(3, 5))]
    return valid_prepare(
        tuple(query), tuple(context), cleared_pages=tuple(cleared), restore=tuple(restore), offload=tuple(offload),
        poison_pages=tuple(pages[9:]), seed=draw(st.integers(0, 99)),
    )


@st.composite
def mutated(draw) -> Prepare:
    p = draw(valid_prepares())
    name = draw(st.sampled_from(FIELDS))
    dtype = DTYPES[name]
    values = getattr(p, name).copy()
    extreme = st.sampled_from(EXTREMES[dtype.str.lstrip("<|")])
    kind = draw(st.sampled_from(["one", "all", "truncate", "extend", "huge", "empty"]))
    if kind == "one" and values.size:
        values[draw(st.integers(0, values.size - 1))] = draw(extreme)
    elif kind == "all":
        values = np.full(values.size, draw(extreme), dtype=dtype)
    elif kind == "truncate" and values.size:
        values = values[: draw(st.integers(0, values.size - 1))]
    elif kind == "extend":
        values = np.append(values, draw(st.lists(extreme, min_size=1, max_size=3))).astype(dtype)
    elif kind == "huge":
        values = np.full(draw(st.sampled_from([G.max_num_seqs + 1, 70_000])), draw(extreme), dtype=dtype)
    elif kind == "empty":
        values = values[:0]
    return dataclasses.replace(p, **{name: np.ascontiguousarray(values, dtype=dtype)})


def assert_safe(p: Prepare) -> None:
    """What an executor relies on once a PREPARE passed validation."""
    n = len(p.seq_ids)
    assert n <= G.max_num_seqs and len(set(p.seq_ids.tolist())) == n
    for name in ("query_lens", "context_lens", "page_table_lens", "page_table_base", "sample", "temperature", "top_p",
                 "top_k", "seeds", "feedback", "num_logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "sampling_state", "history_lens", "history_prompt_lens", "logit_bias_lens",
                 "banned_lens", "min_p", "grammar_lens"):
        assert len(getattr(p, name)) == n
    q, c = p.query_lens.astype(np.int64), p.context_lens.astype(np.int64)
    assert (q >= 1).all() and (c >= q).all() and (c <= G.max_model_len).all()
    assert q.sum() <= G.max_num_batched_tokens and len(p.token_ids) == len(p.positions) == q.sum()
    lens, base = p.page_table_lens.astype(np.int64), p.page_table_base.astype(np.int64)
    assert (base >= 0).all() and (base <= lens).all() and (lens <= G.max_pages_per_seq).all()
    assert (lens * G.page_size >= c).all() and len(p.page_table) == (lens - base).sum()
    expected = np.concatenate([np.arange(ci - qi, ci) for qi, ci in zip(q, c)]) if n else np.zeros(0)
    assert np.array_equal(p.positions, expected) and ((p.positions >= 0) & (p.positions < G.max_model_len)).all()
    assert ((p.token_ids >= 0) & (p.token_ids < G.vocab_size)).all()
    for name in ("page_table", "cleared_pages", "restore_pages", "offload_pages", "poison_pages"):
        v = getattr(p, name)
        assert ((v >= 0) & (v < G.num_kv_pages)).all(), name
    for name in ("restore_slots", "offload_slots"):
        v = getattr(p, name)
        assert ((v >= 0) & (v < G.num_host_pages)).all(), name
    assert len(p.restore_pages) == len(p.restore_slots) and len(p.offload_pages) == len(p.offload_slots)
    assert (np.diff(p.cleared_pages.astype(np.int64)) > 0).all()
    assert not set(p.cleared_pages.tolist()) & set(p.restore_pages.tolist())
    t = p.temperature
    assert ((t == 0) | ((t >= TEMPERATURE_MIN) & (t <= FLOAT32_MAX))).all()
    assert ((p.top_p >= TOP_P_MIN) & (p.top_p <= 1)).all() and (p.top_k >= 0).all() and (p.seeds >= -1).all()
    assert (p.feedback <= 1).all() and ((p.feedback == 0) | (p.query_lens == 1)).all()
    # Logits processing: counts that match the flat arrays, ids in the vocabulary, values in range.
    for counts, flats in (("history_lens", ("history",)), ("logit_bias_lens", ("logit_bias_ids", "logit_bias")),
                          ("banned_lens", ("banned_ids",)), ("grammar_lens", ("grammar",))):
        c = getattr(p, counts).astype(np.int64)
        assert (c >= 0).all() and all(len(getattr(p, f)) == c.sum() for f in flats)
    assert (p.history_lens <= G.max_model_len).all() and (p.logit_bias_lens <= LOGIT_BIAS_MAX_ENTRIES).all()
    assert (p.grammar_lens <= GRAMMAR_MAX_BYTES).all() and ((p.min_p >= 0) & (p.min_p <= 1)).all()
    grammar_starts = (np.cumsum(p.grammar_lens, dtype=np.int64) - p.grammar_lens)[p.grammar_lens > 0]
    assert np.isin(p.grammar[grammar_starts], [int(k) for k in GrammarKind]).all()
    assert ((p.history_prompt_lens >= 0) & (p.history_prompt_lens <= p.history_lens)).all()
    for name in ("history", "logit_bias_ids", "banned_ids"):
        v = getattr(p, name)
        assert ((v >= 0) & (v < G.vocab_size)).all(), name
    assert (np.abs(p.logit_bias) <= LOGIT_BIAS_MAX).all() and (p.num_logprobs <= TOP_LOGPROBS_MAX).all()
    assert (np.abs(p.presence_penalty) <= PENALTY_MAX).all() and (np.abs(p.frequency_penalty) <= PENALTY_MAX).all()
    assert ((p.repetition_penalty >= REPETITION_PENALTY_MIN) & (p.repetition_penalty <= FLOAT32_MAX)).all()
    penalized = (p.presence_penalty != 0) | (p.frequency_penalty != 0) | (p.repetition_penalty != 1)
    carries = (p.history_lens != 0) | (p.logit_bias_lens != 0) | (p.grammar_lens != 0)
    assert (p.sampling_state <= 2).all() and not (penalized & (p.sampling_state == 0)).any()
    assert not (carries & (p.sampling_state != 1)).any()
    starts = np.cumsum(p.logit_bias_lens, dtype=np.int64) - p.logit_bias_lens
    for start, count in zip(starts.tolist(), p.logit_bias_lens.tolist()):
        assert (np.diff(p.logit_bias_ids[start : start + count].astype(np.int64)) > 0).all()


def reset_own_fields(p: Prepare, seq_ids: tuple[int, ...]) -> Prepare:
    rows = np.isin(p.seq_ids, seq_ids)

    def flat(name: str, counts: np.ndarray, value) -> np.ndarray:
        out = getattr(p, name).copy()
        out[np.repeat(rows, counts)] = value
        return out

    bias_ids = p.logit_bias_ids.copy()
    starts = np.cumsum(p.logit_bias_lens, dtype=np.int64) - p.logit_bias_lens
    for start, count in zip(starts[rows].tolist(), p.logit_bias_lens[rows].tolist()):
        bias_ids[start : start + count] = np.arange(count)  # ascending, in the vocabulary
    grammar = p.grammar.copy()
    starts = np.cumsum(p.grammar_lens, dtype=np.int64) - p.grammar_lens
    grammar[starts[rows & (p.grammar_lens > 0)]] = int(GrammarKind.JSON_OBJECT)
    carries = (p.history_lens != 0) | (p.logit_bias_lens != 0) | (p.grammar_lens != 0)
    return dataclasses.replace(
        p,
        temperature=np.where(rows, 0, p.temperature).astype(np.float32),
        top_p=np.where(rows, 1, p.top_p).astype(np.float32),
        top_k=np.where(rows, 0, p.top_k).astype(np.int32),
        seeds=np.where(rows, -1, p.seeds).astype(np.int64),
        feedback=np.where(rows, 0, p.feedback).astype(np.uint8),
        token_ids=flat("token_ids", p.query_lens, 0),
        num_logprobs=np.where(rows, 0, p.num_logprobs).astype(np.uint8),
        presence_penalty=np.where(rows, 0, p.presence_penalty).astype(np.float32),
        frequency_penalty=np.where(rows, 0, p.frequency_penalty).astype(np.float32),
        repetition_penalty=np.where(rows, 1, p.repetition_penalty).astype(np.float32),
        sampling_state=np.where(rows, carries.astype(np.uint8), p.sampling_state).astype(np.uint8),
        history=flat("history", p.history_lens, 0),
        logit_bias_ids=bias_ids,
        logit_bias=flat("logit_bias", p.logit_bias_lens, 0.0),
        banned_ids=flat("banned_ids", p.banned_lens, 0),
        min_p=np.where(rows, 0, p.min_p).astype(np.float32),
        grammar=grammar,
    )


MUTATIONS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(p: Prepare) -> None:
    try:
        validate_prepare(p, G)
    except ProtocolError as exc:
        assert isinstance(exc.code, RejectCode)
        if exc.seq_ids:
            assert set(exc.seq_ids) <= set(p.seq_ids.tolist())
            validate_prepare(reset_own_fields(p, exc.seq_ids), G)
        return
    assert_safe(p)
    try:
        tables = HeldPageTables().apply(p)
    except ProtocolError as exc:  # a base > 0 against nothing held
        assert exc.code == RejectCode.PAGE_TABLE_BASE_MISMATCH
        return
    assert ((tables >= 0) & (tables < G.num_kv_pages)).all()


BASES = [
    valid_prepare(),  # prefill and decode rows, restores, offloads, poison
    valid_prepare((1,), (17,), cleared_pages=(), restore=(), offload=(), poison_pages=()),
    valid_prepare((1, 1, 1), (16, 17, 1024), seed=3),
]


def test_every_field_at_every_extreme() -> None:
    """Each field of each base set to each extreme value, at its first entry, its last, and all of
    them: every combination, not a sample."""
    for base in BASES:
        for name in FIELDS:
            dtype = DTYPES[name]
            original = getattr(base, name)
            for value in EXTREMES[dtype.str.lstrip("<|")]:
                variants = [np.full(original.size, value, dtype=dtype)]
                for at in {0, original.size - 1} if original.size else ():
                    one = original.copy()
                    one[at] = value
                    variants.append(one)
                for values in variants:
                    check(dataclasses.replace(base, **{name: values}))


@MUTATIONS
@given(mutated())
def test_a_mutated_prepare_is_refused_with_a_code_or_is_safe(p: Prepare) -> None:
    check(p)


@MUTATIONS
@given(mutated())
def test_over_the_wire_the_verdict_is_the_same(p: Prepare) -> None:
    try:
        validate_prepare(p, G)
        verdict = None
    except ProtocolError as exc:
        verdict = (exc.code, exc.seq_ids)
    received = decode(encode(Frame(3, 1, "r", 1, 1, p), KEY), KEY).body
    try:
        validate_prepare(received, G)
        assert verdict is None
    except ProtocolError as exc:
        assert (exc.code, exc.seq_ids) == verdict
