"""Each validation rule rejects a frame that breaks it, with its own code; a good frame passes."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import PREPARE_FIELDS, Frame, Go, Prepare
from protocol.validate import check_envelope, check_geometry, negotiate_version, validate_prepare
from tests.protocol.wire_samples import GEOMETRY, valid_prepare, with_arrays

G = GEOMETRY


def test_a_valid_prepare_passes() -> None:
    validate_prepare(valid_prepare(), G)


def test_a_step_with_page_table_deltas_passes() -> None:
    p = valid_prepare((3, 1, 1, 2), (3, 20, 33, 50))
    validate_prepare(with_arrays(p, page_table_base=[0, 1, 2, 4], page_table=p.page_table[[0, 2, 5]]), G)


def test_a_step_with_logits_processing_passes() -> None:
    validate_prepare(PP, G)


def test_an_empty_step_passes() -> None:
    validate_prepare(valid_prepare((), (), cleared_pages=(), restore=(), offload=(), poison_pages=()), G)


def test_a_step_at_every_limit_passes() -> None:
    n = G.max_num_seqs
    q = G.max_num_batched_tokens // n
    prepare = valid_prepare((q,) * n, (G.max_model_len,) * n, cleared_pages=(0, G.num_kv_pages - 1))
    validate_prepare(prepare, G)


P = valid_prepare((3, 1, 1, 2), (3, 20, 33, 50))  # a mixed prefill/decode step, valid
# The same with logits processing on: sequence 0 sends its state whole (a prompt of 3 and an output
# of 1), 1 keeps its state, 3 sends a logit bias; 1 and 2 have stop tokens banned.
PP = with_arrays(
    P, num_logprobs=[0, 3, 0, 20], presence_penalty=[0.5, 0, 0, 0], repetition_penalty=[1, 1.3, 1, 1],
    frequency_penalty=[0, 0, 0, -2], sampling_state=[1, 2, 0, 1], history_lens=[4, 0, 0, 0],
    history_prompt_lens=[3, 0, 0, 0], history=[1, 2, 3, 4], logit_bias_lens=[0, 0, 0, 2], logit_bias_ids=[5, 999],
    logit_bias=[-100, 100], banned_lens=[0, 1, 2, 0], banned_ids=[2, 0, 999],
)
LAST_PAGES = G.max_pages_per_seq + 1
MANY = G.max_num_seqs + 1

RULES: list[tuple[str, Prepare, RejectCode]] = [
    # array lengths agree
    ("per-sequence array short", with_arrays(P, top_k=P.top_k[:-1]), RejectCode.LENGTH_MISMATCH),
    ("sample array long", with_arrays(P, sample=np.append(P.sample, 1)), RejectCode.LENGTH_MISMATCH),
    ("token_ids != sum(query_lens)", with_arrays(P, token_ids=P.token_ids[:-1]), RejectCode.LENGTH_MISMATCH),
    ("positions != sum(query_lens)", with_arrays(P, positions=np.append(P.positions, 0)), RejectCode.LENGTH_MISMATCH),
    ("page_table != sum(lens)", with_arrays(P, page_table=P.page_table[:-1]), RejectCode.LENGTH_MISMATCH),
    ("restore pairs unequal", with_arrays(P, restore_slots=P.restore_slots[:-1]), RejectCode.LENGTH_MISMATCH),
    ("offload pairs unequal", with_arrays(P, offload_pages=[]), RejectCode.LENGTH_MISMATCH),
    ("negative page_table_lens", with_arrays(P, page_table_lens=[-1, 2, 3, 4]), RejectCode.LENGTH_MISMATCH),
    ("negative page_table_base", with_arrays(P, page_table_base=[-1, 0, 0, 0]), RejectCode.LENGTH_MISMATCH),
    ("page_table_base above the table", with_arrays(P, page_table_base=[0, 0, 0, 5]), RejectCode.LENGTH_MISMATCH),
    ("page_table != sum(lens - base)", with_arrays(P, page_table_base=[1, 0, 0, 0]), RejectCode.LENGTH_MISMATCH),
    # sizes under the limits
    ("too many sequences", valid_prepare((1,) * MANY, (5,) * MANY), RejectCode.LIMIT_EXCEEDED),
    (
        "too many tokens",
        valid_prepare((G.max_num_batched_tokens + 1,), (G.max_num_batched_tokens + 1,)),
        RejectCode.LIMIT_EXCEEDED,
    ),
    (
        "page table longer than max context",
        with_arrays(P, page_table_lens=[1, 2, 3, LAST_PAGES], page_table=np.zeros(6 + LAST_PAGES)),
        RejectCode.LIMIT_EXCEEDED,
    ),
    # per-sequence lengths
    (
        "query_lens 0",
        with_arrays(P, query_lens=[3, 0, 1, 2], token_ids=P.token_ids[:-1], positions=P.positions[:-1]),
        RejectCode.BAD_QUERY_LEN,
    ),
    ("context shorter than query", with_arrays(P, context_lens=[2, 20, 33, 50]), RejectCode.BAD_CONTEXT_LEN),
    (
        "context beyond max_model_len",
        with_arrays(P, context_lens=[3, 20, 33, G.max_model_len + 1]),
        RejectCode.BAD_CONTEXT_LEN,
    ),
    (
        "page table too short",
        with_arrays(P, context_lens=[3, 20, 33, 65], positions=[0, 1, 2, 19, 32, 63, 64]),
        RejectCode.PAGE_TABLE_TOO_SHORT,
    ),
    ("duplicate seq id", with_arrays(P, seq_ids=[1, 2, 3, 2]), RejectCode.DUPLICATE_SEQ_ID),
    # feedback: 0 or 1, and 1 only where a sequence takes one new token
    ("feedback on a prefill row", with_arrays(P, feedback=[1, 0, 0, 0]), RejectCode.BAD_FEEDBACK),
    ("feedback value 2", with_arrays(P, feedback=[0, 2, 0, 0]), RejectCode.BAD_FEEDBACK),
    # page ids in [0, num_kv_pages)
    (
        "page table id too big",
        with_arrays(P, page_table=np.append(P.page_table[:-1], G.num_kv_pages)),
        RejectCode.PAGE_OUT_OF_RANGE,
    ),
    ("page table id negative", with_arrays(P, page_table=np.append(-1, P.page_table[1:])), RejectCode.PAGE_OUT_OF_RANGE),
    ("cleared page outside", with_arrays(P, cleared_pages=[7, 8, G.num_kv_pages]), RejectCode.PAGE_OUT_OF_RANGE),
    ("cleared page negative", with_arrays(P, cleared_pages=[-1, 7]), RejectCode.PAGE_OUT_OF_RANGE),
    ("restore page outside", with_arrays(P, restore_pages=[100, G.num_kv_pages + 5]), RejectCode.PAGE_OUT_OF_RANGE),
    ("offload page outside", with_arrays(P, offload_pages=[-3]), RejectCode.PAGE_OUT_OF_RANGE),
    ("poison page outside", with_arrays(P, poison_pages=[G.num_kv_pages]), RejectCode.PAGE_OUT_OF_RANGE),
    # host slots in [0, num_host_pages)
    ("restore slot outside", with_arrays(P, restore_slots=[1, G.num_host_pages]), RejectCode.SLOT_OUT_OF_RANGE),
    ("offload slot negative", with_arrays(P, offload_slots=[-1]), RejectCode.SLOT_OUT_OF_RANGE),
    # cleared pages sorted, unique, disjoint from restore targets
    ("cleared not sorted", with_arrays(P, cleared_pages=[8, 7, 40]), RejectCode.CLEARED_NOT_SORTED_UNIQUE),
    ("cleared repeated", with_arrays(P, cleared_pages=[7, 8, 8, 40]), RejectCode.CLEARED_NOT_SORTED_UNIQUE),
    ("cleared page restored", with_arrays(P, cleared_pages=[7, 8, 101]), RejectCode.CLEARED_RESTORE_OVERLAP),
    # tokens and positions
    (
        "token id = vocab",
        with_arrays(P, token_ids=np.append(P.token_ids[:-1], G.vocab_size)),
        RejectCode.TOKEN_OUT_OF_RANGE,
    ),
    ("token id negative", with_arrays(P, token_ids=np.append(-1, P.token_ids[1:])), RejectCode.TOKEN_OUT_OF_RANGE),
    ("position negative", with_arrays(P, positions=np.append(-1, P.positions[1:])), RejectCode.POSITION_OUT_OF_RANGE),
    (
        "position = max_model_len",
        with_arrays(P, positions=np.append(P.positions[:-1], G.max_model_len)),
        RejectCode.POSITION_OUT_OF_RANGE,
    ),
    (
        "position not at the context's end",
        with_arrays(P, positions=np.append(P.positions[:-1], 40)),
        RejectCode.POSITION_MISMATCH,
    ),
    # sampling parameters (protocol/sampling_limits.py)
    ("negative temperature", with_arrays(P, temperature=[0, -0.5, 1, 1]), RejectCode.BAD_SAMPLING),
    ("NaN temperature", with_arrays(P, temperature=[0, np.nan, 1, 1]), RejectCode.BAD_SAMPLING),
    ("infinite temperature", with_arrays(P, temperature=[0, np.inf, 1, 1]), RejectCode.BAD_SAMPLING),
    ("denormal temperature", with_arrays(P, temperature=[0, 1e-40, 1, 1]), RejectCode.BAD_SAMPLING),
    ("temperature under the floor", with_arrays(P, temperature=[0, 5e-6, 1, 1]), RejectCode.BAD_SAMPLING),
    ("top_p 0", with_arrays(P, top_p=[1, 0, 1, 1]), RejectCode.BAD_SAMPLING),
    ("top_p 1e-46 (0 in float32)", with_arrays(P, top_p=[1, 1e-46, 1, 1]), RejectCode.BAD_SAMPLING),
    ("top_p under the floor", with_arrays(P, top_p=[1, 5e-7, 1, 1]), RejectCode.BAD_SAMPLING),
    ("top_p NaN", with_arrays(P, top_p=[1, np.nan, 1, 1]), RejectCode.BAD_SAMPLING),
    ("top_p above 1", with_arrays(P, top_p=[1, 1.5, 1, 1]), RejectCode.BAD_SAMPLING),
    ("negative top_k", with_arrays(P, top_k=[0, -1, 0, 0]), RejectCode.BAD_SAMPLING),
    ("seed below -1", with_arrays(P, seeds=[-1, -2, 0, 0]), RejectCode.BAD_SAMPLING),
    # int32 extremes: compared, never wrapped (a correctly signed frame once crashed an executor)
    ("context_lens INT32_MIN", with_arrays(P, context_lens=[3, -(2**31), 33, 50]), RejectCode.BAD_CONTEXT_LEN),
    ("context_lens INT32_MAX", with_arrays(P, context_lens=[3, 2**31 - 1, 33, 50]), RejectCode.BAD_CONTEXT_LEN),
    ("query_lens INT32_MIN", with_arrays(P, query_lens=[3, -(2**31), 1, 2]), RejectCode.BAD_QUERY_LEN),
    (
        "query_lens summing past int32",
        with_arrays(P, query_lens=[3, 2**31 - 1, 2**31 - 1, 2]),
        RejectCode.LENGTH_MISMATCH,
    ),
    ("page_table_lens INT32_MIN", with_arrays(P, page_table_lens=[-(2**31), 2, 3, 4]), RejectCode.LENGTH_MISMATCH),
    ("page_table_base INT32_MAX", with_arrays(P, page_table_base=[2**31 - 1, 0, 0, 0]), RejectCode.LENGTH_MISMATCH),
    ("position INT32_MIN", with_arrays(P, positions=np.append(-(2**31), P.positions[1:])), RejectCode.POSITION_OUT_OF_RANGE),
    # logits processing: lengths (protocol/frames.py Prepare)
    ("num_logprobs short", with_arrays(PP, num_logprobs=[0, 3, 0]), RejectCode.LENGTH_MISMATCH),
    ("history != sum(history_lens)", with_arrays(PP, history=[1, 2, 3]), RejectCode.LENGTH_MISMATCH),
    ("negative history_lens", with_arrays(PP, history_lens=[5, -1, 0, 0]), RejectCode.LENGTH_MISMATCH),
    ("prompt part longer than the history", with_arrays(PP, history_prompt_lens=[5, 0, 0, 0]), RejectCode.LENGTH_MISMATCH),
    ("logit_bias_ids != sum(logit_bias_lens)", with_arrays(PP, logit_bias_ids=[5]), RejectCode.LENGTH_MISMATCH),
    ("logit_bias != sum(logit_bias_lens)", with_arrays(PP, logit_bias=[1, 2, 3]), RejectCode.LENGTH_MISMATCH),
    ("banned_ids != sum(banned_lens)", with_arrays(PP, banned_ids=[2]), RejectCode.LENGTH_MISMATCH),
    ("banned_lens INT32_MAX", with_arrays(PP, banned_lens=[0, 2**31 - 1, 2, 0]), RejectCode.LIMIT_EXCEEDED),
    (
        "history longer than max_model_len",
        with_arrays(PP, history_lens=[G.max_model_len + 1, 0, 0, 0], history=np.ones(G.max_model_len + 1)),
        RejectCode.LIMIT_EXCEEDED,
    ),
    (
        "more than 300 biased tokens",
        with_arrays(PP, logit_bias_lens=[0, 0, 0, 301], logit_bias_ids=np.arange(301), logit_bias=np.ones(301)),
        RejectCode.LIMIT_EXCEEDED,
    ),
    # logits processing: a sequence's own values (protocol/sampling_limits.py)
    ("21 alternatives", with_arrays(PP, num_logprobs=[0, 21, 0, 0]), RejectCode.BAD_SAMPLING),
    ("presence_penalty above 2", with_arrays(PP, presence_penalty=[2.5, 0, 0, 0]), RejectCode.BAD_SAMPLING),
    ("presence_penalty NaN", with_arrays(PP, presence_penalty=[np.nan, 0, 0, 0]), RejectCode.BAD_SAMPLING),
    ("frequency_penalty below -2", with_arrays(PP, frequency_penalty=[0, 0, 0, -2.5]), RejectCode.BAD_SAMPLING),
    ("repetition_penalty 0", with_arrays(PP, repetition_penalty=[1, 0, 1, 1]), RejectCode.BAD_SAMPLING),
    ("repetition_penalty under the floor", with_arrays(PP, repetition_penalty=[1, 1e-6, 1, 1]), RejectCode.BAD_SAMPLING),
    ("repetition_penalty inf", with_arrays(PP, repetition_penalty=[1, np.inf, 1, 1]), RejectCode.BAD_SAMPLING),
    ("sampling_state 3", with_arrays(PP, sampling_state=[1, 3, 0, 1]), RejectCode.BAD_SAMPLING),
    ("a penalty without a state", with_arrays(PP, sampling_state=[1, 0, 0, 1]), RejectCode.BAD_SAMPLING),
    ("a history with a held state", with_arrays(PP, sampling_state=[2, 2, 0, 1]), RejectCode.BAD_SAMPLING),
    ("a logit bias without a state", with_arrays(PP, sampling_state=[1, 2, 0, 0]), RejectCode.BAD_SAMPLING),
    ("logit bias above 100", with_arrays(PP, logit_bias=[-100, 100.5]), RejectCode.BAD_SAMPLING),
    ("logit bias NaN", with_arrays(PP, logit_bias=[np.nan, 1]), RejectCode.BAD_SAMPLING),
    ("logit bias ids not increasing", with_arrays(PP, logit_bias_ids=[999, 5]), RejectCode.BAD_SAMPLING),
    ("logit bias id twice", with_arrays(PP, logit_bias_ids=[5, 5]), RejectCode.BAD_SAMPLING),
    ("history token = vocab", with_arrays(PP, history=[1, 2, 3, G.vocab_size]), RejectCode.TOKEN_OUT_OF_RANGE),
    ("logit bias id negative", with_arrays(PP, logit_bias_ids=[-1, 5]), RejectCode.TOKEN_OUT_OF_RANGE),
    ("banned id = vocab", with_arrays(PP, banned_ids=[2, 0, G.vocab_size]), RejectCode.TOKEN_OUT_OF_RANGE),
]


@pytest.mark.parametrize("bad, code", [(b, c) for _, b, c in RULES], ids=[name for name, _, _ in RULES])
def test_each_rule_rejects_with_its_code(bad: Prepare, code: RejectCode) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_prepare(bad, G)
    assert info.value.code == code, str(info.value)
    assert str(info.value).startswith(code.name + ": ")


def test_every_validation_code_has_a_rule_test() -> None:
    validation_codes = {
        RejectCode.LENGTH_MISMATCH,
        RejectCode.LIMIT_EXCEEDED,
        RejectCode.BAD_QUERY_LEN,
        RejectCode.BAD_CONTEXT_LEN,
        RejectCode.PAGE_TABLE_TOO_SHORT,
        RejectCode.DUPLICATE_SEQ_ID,
        RejectCode.PAGE_OUT_OF_RANGE,
        RejectCode.SLOT_OUT_OF_RANGE,
        RejectCode.CLEARED_NOT_SORTED_UNIQUE,
        RejectCode.CLEARED_RESTORE_OVERLAP,
        RejectCode.TOKEN_OUT_OF_RANGE,
        RejectCode.POSITION_OUT_OF_RANGE,
        RejectCode.POSITION_MISMATCH,
        RejectCode.BAD_SAMPLING,
        RejectCode.BAD_FEEDBACK,
    }
    assert validation_codes <= {code for _, _, code in RULES}


SEQUENCE_RULES = {RejectCode.BAD_SAMPLING, RejectCode.BAD_FEEDBACK, RejectCode.TOKEN_OUT_OF_RANGE}


@pytest.mark.parametrize("bad, code", [(b, c) for _, b, c in RULES], ids=[name for name, _, _ in RULES])
def test_only_a_sequences_own_fields_name_sequences(bad: Prepare, code: RejectCode) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_prepare(bad, G)
    if code in SEQUENCE_RULES:
        assert info.value.seq_ids and set(info.value.seq_ids) <= set(P.seq_ids.tolist())
    else:
        assert info.value.seq_ids == ()


def test_a_logit_bias_belongs_to_its_own_sequence() -> None:
    """Ids increase within a sequence only: a sequence's first id may be below the one before's last."""
    two = with_arrays(
        PP, sampling_state=[1, 2, 1, 1], logit_bias_lens=[0, 0, 2, 2], logit_bias_ids=[7, 900, 5, 999],
        logit_bias=[1, 2, 3, 4],
    )
    validate_prepare(two, G)
    with pytest.raises(ProtocolError) as info:
        validate_prepare(with_arrays(two, logit_bias_ids=[7, 900, 999, 5]), G)
    assert info.value.code == RejectCode.BAD_SAMPLING and info.value.seq_ids == (int(PP.seq_ids[3]),)
    assert "logit_bias_ids must be strictly increasing within a sequence" in info.value.message


def test_every_offending_sequence_is_named_whatever_rule_it_broke() -> None:
    bad = with_arrays(
        P,
        temperature=[0, 1e-40, 1, 1],
        top_k=[0, 0, -5, 0],
        token_ids=np.append(P.token_ids[:-1], G.vocab_size),  # the last sequence's last token
    )
    with pytest.raises(ProtocolError) as info:
        validate_prepare(bad, G)
    ids = P.seq_ids.tolist()
    assert info.value.code == RejectCode.BAD_SAMPLING and info.value.seq_ids == (ids[1], ids[2], ids[3])
    message = info.value.message
    assert "temperature must be 0 (greedy) or in [1e-05, " in message and f"sequence {ids[1]} (index 1)" in message
    assert f"token_ids must be every new token in [0, {G.vocab_size}): sequence {ids[3]} (index 3) has {G.vocab_size}" in message


def test_a_structural_fault_refuses_the_whole_frame_even_with_bad_sampling() -> None:
    bad = with_arrays(P, temperature=[0, np.nan, 1, 1], cleared_pages=[8, 7])
    with pytest.raises(ProtocolError) as info:
        validate_prepare(bad, G)
    assert info.value.code == RejectCode.CLEARED_NOT_SORTED_UNIQUE and info.value.seq_ids == ()


def test_sampling_values_at_the_floors_and_extremes_pass() -> None:
    validate_prepare(
        with_arrays(
            P,
            temperature=[0, 1e-5, 3.4028234663852886e38, 2.0],
            top_p=[1e-6, 1, 0.5, 1],
            top_k=[0, 2**31 - 1, 1, 50],
            seeds=[-1, 0, 2**63 - 1, 7],
        ),
        G,
    )


def test_messages_name_the_offending_entry() -> None:
    bad = with_arrays(P, cleared_pages=[7, 8, G.num_kv_pages])
    with pytest.raises(ProtocolError, match=rf"cleared_pages\[2\] = {G.num_kv_pages} is outside \[0, {G.num_kv_pages}\)"):
        validate_prepare(bad, G)


def test_validation_does_not_need_writable_arrays() -> None:
    p = valid_prepare()
    for f in PREPARE_FIELDS:
        getattr(p, f.name).flags.writeable = False
    validate_prepare(p, G)


# -- envelope, negotiation, geometry ---------------------------------------------------------


def frame(**changes: object) -> Frame:
    return dataclasses.replace(Frame(1, 1, "run-a", 5, 1, Go()), **changes)


def test_feedback_on_one_token_rows_is_valid() -> None:
    validate_prepare(with_arrays(P, feedback=[0, 1, 1, 0]), G)


def test_check_envelope_accepts_its_own_run() -> None:
    check_envelope(frame(), version=1, layout=1, run_id="run-a", expected_step=5)


@pytest.mark.parametrize(
    "changes, code, both",
    [
        ({"version": 2}, RejectCode.BAD_VERSION, ("version 2", "negotiated 1")),
        ({"layout": 7}, RejectCode.BAD_LAYOUT, ("layout version 7", "negotiated 1")),
        ({"run_id": "run-b"}, RejectCode.BAD_RUN_ID, ("'run-b'", "'run-a'")),
        ({"step": 4}, RejectCode.BAD_STEP, ("step 4", "expected step 5")),
    ],
)
def test_check_envelope_names_what_it_got_and_expected(
    changes: dict, code: RejectCode, both: tuple[str, str]
) -> None:
    with pytest.raises(ProtocolError) as info:
        check_envelope(frame(**changes), version=1, layout=1, run_id="run-a", expected_step=5)
    assert info.value.code == code
    assert all(text in info.value.message for text in both), info.value.message


def test_negotiate_version_picks_the_highest_common_one() -> None:
    assert negotiate_version([1, 2, 3], [2, 3, 4]) == 3
    with pytest.raises(ProtocolError, match=r"offers \[5, 6\].*supports \[1\]") as info:
        negotiate_version([5, 6], [1])
    assert info.value.code == RejectCode.BAD_VERSION


def test_check_geometry_lists_every_difference() -> None:
    check_geometry(G, G, who="rank 1")
    other = dataclasses.replace(G, num_kv_pages=10, kv_dtype="bf16")
    with pytest.raises(ProtocolError, match="rank 1 .*num_kv_pages 10 \\(expected 512\\).*kv_dtype 'bf16'") as info:
        check_geometry(G, other, who="rank 1")
    assert info.value.code == RejectCode.GEOMETRY_MISMATCH
