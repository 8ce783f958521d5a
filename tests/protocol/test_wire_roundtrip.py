"""Every frame type survives encode -> decode bit for bit (property-based)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import decode, encode
from protocol.frames import (
    ARRAY_DTYPES,
    BODY_TYPES,
    Abort,
    CacheGeometry,
    Continue,
    Cut,
    Done,
    Frame,
    Go,
    Heartbeat,
    Hello,
    Prepare,
    Ready,
    Reject,
    Result,
    Shutdown,
    Welcome,
)
from tests.protocol.wire_samples import KEY

int64s = st.integers(-(2**63), 2**63 - 1)
small_ints = st.integers(-(2**31), 2**31 - 1)
texts = st.text(max_size=200)


def array_of(dtype: np.dtype, max_len: int = 300) -> st.SearchStrategy[np.ndarray]:
    # Random bytes reinterpreted as the dtype: every bit pattern (NaN payloads, negative ids) and
    # much faster to generate than element-wise strategies.
    return (
        st.integers(0, max_len)
        .flatmap(lambda n: st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
        .map(lambda raw: np.frombuffer(raw, dtype).copy())
    )


def arrays_of(cls: type) -> dict[str, st.SearchStrategy[np.ndarray]]:
    return {name: array_of(dt) for name, dt in ARRAY_DTYPES[cls].items()}


geometries = st.builds(
    CacheGeometry,
    num_kv_pages=small_ints,
    page_size=st.integers(1, 1024),
    num_layers=small_ints,
    num_kv_heads=small_ints,
    head_dim=small_ints,
    kv_dtype=st.sampled_from(["fp32", "bf16", "fp16", "fp8-e4m3"]),
    vocab_size=small_ints,
    max_model_len=small_ints,
    max_num_seqs=small_ints,
    max_num_batched_tokens=small_ints,
    num_host_pages=small_ints,
)

BODY_STRATEGIES: dict[type, st.SearchStrategy] = {
    Hello: st.builds(
        Hello,
        rank=small_ints,
        world_size=small_ints,
        versions=st.lists(small_ints, max_size=8).map(tuple),
        layout=small_ints,
        model_fingerprint=texts,
        geometry=geometries,
        config_fingerprint=texts,
        host=texts,
    ),
    Welcome: st.builds(Welcome, version=small_ints, layout=small_ints, world_size=small_ints, geometry=geometries),
    Prepare: st.builds(Prepare, **arrays_of(Prepare), decode_steps=small_ints),
    Continue: st.builds(Continue, **arrays_of(Continue), decode_steps=small_ints),
    Ready: st.builds(Ready, rank=small_ints),
    Reject: st.builds(Reject, rank=small_ints, code=small_ints, message=texts, **arrays_of(Reject)),
    Go: st.just(Go()),
    Cut: st.just(Cut()),
    Abort: st.builds(Abort, reason=texts),
    Result: st.builds(Result, **arrays_of(Result), step_time_us=int64s, gap_us=int64s),
    Done: st.builds(Done, rank=small_ints),
    Heartbeat: st.builds(Heartbeat, rank=small_ints),
    Shutdown: st.builds(Shutdown, reason=texts),
}
bodies = st.sampled_from(list(BODY_STRATEGIES)).flatmap(BODY_STRATEGIES.__getitem__)

frames = st.builds(
    Frame,
    version=small_ints,
    layout=small_ints,
    run_id=texts,
    step=int64s,
    seq=int64s,
    body=bodies,
)


def assert_same_frame(got: Frame, sent: Frame) -> None:
    assert type(got.body) is type(sent.body)
    assert (got.version, got.layout, got.run_id, got.step, got.seq) == (
        sent.version,
        sent.layout,
        sent.run_id,
        sent.step,
        sent.seq,
    )
    dtypes = ARRAY_DTYPES.get(type(sent.body), {})
    for f in dataclasses.fields(sent.body):
        a, b = getattr(got.body, f.name), getattr(sent.body, f.name)
        if f.name in dtypes:
            assert a.dtype == dtypes[f.name]
            assert not a.flags.writeable
            # Bit-exact, so NaN payloads in float arrays count too.
            assert a.tobytes() == b.tobytes(), f.name
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        else:
            assert a == b, f.name


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames)
def test_every_frame_type_round_trips(frame: Frame) -> None:
    parts = encode(frame, KEY)
    assert_same_frame(decode(parts, KEY), frame)


def test_the_strategy_covers_every_frame_type() -> None:
    # The property above proves less than it says if a frame type is missing from it.
    assert set(BODY_STRATEGIES) == set(BODY_TYPES.values())


def test_empty_arrays_round_trip() -> None:
    empty = Prepare(**{n: np.zeros(0, dt) for n, dt in ARRAY_DTYPES[Prepare].items()})
    frame = Frame(1, 1, "r", 0, 1, empty)
    assert_same_frame(decode(encode(frame, KEY), KEY), frame)


def test_large_arrays_round_trip_without_copy() -> None:
    rng = np.random.default_rng(1)
    arrays = {n: np.zeros(0, dt) for n, dt in ARRAY_DTYPES[Prepare].items()}
    arrays["page_table"] = rng.integers(0, 2**31 - 1, 2_000_000).astype("<i4")
    arrays["seq_ids"] = rng.integers(-(2**62), 2**62, 100_000).astype("<i8")
    frame = Frame(1, 1, "r", 3, 9, Prepare(**arrays))
    parts = encode(frame, KEY)
    got = decode(parts, KEY)
    assert_same_frame(got, frame)
    # Zero copy: the decoded array is a view into the received part.
    assert np.shares_memory(got.body.page_table, np.frombuffer(parts[1], np.uint8))


def test_encode_casts_lossless_arrays_and_numpy_scalars() -> None:
    body = Result(
        seq_ids=np.array([1, 2], dtype=np.int32),
        token_ids=np.array([5, 6], dtype=np.int64),
        logprobs=np.array([-0.5, -1.0], dtype=np.float64),
        finite=np.array([True, False]),
        step_time_us=np.int64(17),
    )
    got = decode(encode(Frame(1, 1, "r", np.int64(4), 1, body), KEY), KEY)
    assert got.step == 4 and type(got.step) is int
    assert got.body.step_time_us == 17
    assert got.body.seq_ids.dtype == np.dtype("<i8") and got.body.seq_ids.tolist() == [1, 2]
    assert got.body.finite.tolist() == [1, 0]


LOGITS_PROCESSING = {
    Prepare: {
        "num_logprobs": "u1", "presence_penalty": "<f4", "frequency_penalty": "<f4", "repetition_penalty": "<f4",
        "sampling_state": "u1", "history_lens": "<i4", "history_prompt_lens": "<i4", "history": "<i4",
        "logit_bias_lens": "<i4", "logit_bias_ids": "<i4", "logit_bias": "<f4", "banned_lens": "<i4", "banned_ids": "<i4",
    },
    Result: {"top_token_ids": "<i4", "top_logprobs": "<f4"},
}


def test_the_logits_processing_fields_travel_with_their_dtypes() -> None:
    """The strategies above draw every array of ARRAY_DTYPES, these included; a valid step that uses
    them all, and a RESULT with alternatives, round-trip as well."""
    from tests.protocol.test_prepare_rules import PP

    for cls, fields in LOGITS_PROCESSING.items():
        assert {name: ARRAY_DTYPES[cls][name].str.replace("|", "") for name in fields} == fields
    result = Result(
        seq_ids=np.array([3, 4], dtype="<i8"), token_ids=np.array([9, 8], dtype="<i4"),
        logprobs=np.array([-0.5, -1.5], dtype="<f4"), finite=np.array([1, 1], dtype="u1"),
        top_token_ids=np.array([9, 1, 8], dtype="<i4"), top_logprobs=np.array([-0.5, -2.0, -1.5], dtype="<f4"),
    )
    for body in (PP, result):
        frame = Frame(3, 1, "r", 2, 5, body)
        assert_same_frame(decode(encode(frame, KEY), KEY), frame)
