"""Hostile or broken input never crashes the decoder: it is always a ProtocolError with a fitting code.

Frames signed with the right key matter most here: they get past the MAC, so everything behind it
(limits, msgpack, field shapes) has to hold on its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import DEFAULT_LIMITS, decode, encode, frame_mac, from_message, open_message, to_message, verify
from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import ARRAY_DTYPES, Frame, FrameType, Go, Ready, Result, Welcome
from tests.protocol.wire_samples import GEOMETRY, KEY, valid_prepare

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def prepare_parts() -> list[bytes]:
    return encode(Frame(1, 1, "r", 1, 1, valid_prepare()), KEY)


def signed(envelope: object, payload: bytes = b"", *, raw_envelope: bytes | None = None) -> list[bytes]:
    """Parts with a correct MAC around an arbitrary envelope and payload: what a buggy peer holding
    the key sends."""
    parts = [raw_envelope if raw_envelope is not None else msgpack.packb(envelope), payload]
    return [*parts, frame_mac(KEY, parts)]


def envelope_of(frame: Frame) -> tuple[dict, bytes]:
    envelope, payload, _ = encode(frame, KEY)
    return msgpack.unpackb(envelope), payload


def reject_code(parts: object, **kw: object) -> RejectCode:
    with pytest.raises(ProtocolError) as info:
        decode(parts, KEY, **kw)
    return info.value.code


# -- without the key -------------------------------------------------------------------------


@FUZZ
@given(st.data())
def test_truncated_parts_fail_the_mac(data: st.DataObject) -> None:
    parts = prepare_parts()
    # An empty part (an unused logits-processing array) cannot be cut.
    i = data.draw(st.integers(0, len(parts) - 1).filter(lambda k: len(parts[k]) > 0))
    cut = data.draw(st.integers(0, len(parts[i]) - 1))
    parts[i] = parts[i][:cut]
    assert reject_code(parts) == RejectCode.BAD_MAC


@FUZZ
@given(st.data())
def test_flipped_bytes_fail_the_mac(data: st.DataObject) -> None:
    parts = prepare_parts()
    i = data.draw(st.integers(0, len(parts) - 1).filter(lambda k: len(parts[k]) > 0))
    at = data.draw(st.integers(0, len(parts[i]) - 1))
    bit = data.draw(st.integers(0, 7))
    damaged = bytearray(parts[i])
    damaged[at] ^= 1 << bit
    parts[i] = bytes(damaged)
    assert reject_code(parts) == RejectCode.BAD_MAC


@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=30))
def test_random_bytes_are_refused(parts: list[bytes]) -> None:
    reject_code(parts)


@FUZZ
@given(st.data())
def test_wrong_part_counts_are_refused(data: st.DataObject) -> None:
    parts = prepare_parts()
    if data.draw(st.booleans()):
        del parts[data.draw(st.integers(0, len(parts) - 1))]
    else:
        parts.insert(data.draw(st.integers(0, len(parts))), data.draw(st.binary(max_size=64)))
    reject_code(parts)


def test_re_split_parts_fail_the_mac() -> None:
    # Same bytes, different boundaries between two sections: the lengths under the MAC catch it.
    parts = prepare_parts()
    joined = parts[0] + parts[1]
    parts[0], parts[1] = joined[:-4], joined[-4:]
    assert reject_code(parts) == RejectCode.BAD_MAC


def test_wrong_key_is_refused() -> None:
    parts = encode(Frame(1, 1, "r", 1, 1, Go()), bytes(32))
    assert reject_code(parts) == RejectCode.BAD_MAC


def test_too_few_parts_too_many_parts_and_too_many_bytes() -> None:
    assert reject_code([]) == RejectCode.MALFORMED
    assert reject_code([b"x"]) == RejectCode.MALFORMED
    assert reject_code([b""] * (DEFAULT_LIMITS.max_parts + 1)) == RejectCode.TOO_LARGE
    small = dataclasses.replace(DEFAULT_LIMITS, max_frame_bytes=200)
    assert reject_code(prepare_parts(), limits=small) == RejectCode.TOO_LARGE


# -- the one ZeroMQ message that carries the sections ----------------------------------------


def message_code(parts: object) -> RejectCode:
    with pytest.raises(ProtocolError) as info:
        from_message(parts)
    return info.value.code


def test_a_message_holds_the_sections_aligned_and_decodes_in_place() -> None:
    sections = encode(result_frame(), KEY)
    message = to_message(sections)
    # The MAC's own header (count, then each length), then each section from a multiple of 8.
    assert message[:32] == b"".join(n.to_bytes(8, "little") for n in [3, *map(len, sections)])
    views = from_message([message])
    assert [bytes(v) for v in views] == sections
    got = decode(views, KEY).body
    for name in ("seq_ids", "token_ids", "logprobs", "finite"):
        array = getattr(got, name)
        assert np.shares_memory(array, np.frombuffer(message, np.uint8)) or array.size == 0
        assert (array.ctypes.data - np.frombuffer(message, np.uint8).ctypes.data) % 8 == 0


def test_a_frame_in_several_zeromq_parts_or_none_is_refused() -> None:
    sections = prepare_parts()
    assert message_code(sections) == RejectCode.MALFORMED  # the version-4 layout: one part per section
    assert message_code([to_message(sections), b""]) == RejectCode.MALFORMED
    assert message_code([]) == RejectCode.MALFORMED
    assert message_code(None) == RejectCode.MALFORMED


def test_a_header_that_does_not_fit_its_message_is_refused() -> None:
    message = to_message(prepare_parts())
    assert message_code([message[:5]]) == RejectCode.MALFORMED  # no header
    assert message_code([message[:16]]) == RejectCode.MALFORMED  # a header cut short
    assert message_code([message[:-8]]) == RejectCode.MALFORMED  # the last section cut short
    assert message_code([message + bytes(8)]) == RejectCode.MALFORMED  # bytes past the last section
    lying = bytearray(message)
    lying[8:16] = (len(message)).to_bytes(8, "little")  # the envelope said to be the whole message
    assert message_code([bytes(lying)]) == RejectCode.MALFORMED
    many = (DEFAULT_LIMITS.max_parts + 1).to_bytes(8, "little") + message[8:]
    assert message_code([many]) == RejectCode.TOO_LARGE
    huge = (1 << 62).to_bytes(8, "little") + message[8:]
    assert message_code([huge]) == RejectCode.TOO_LARGE


def open_code(message: bytes, key: bytes = KEY, limits=DEFAULT_LIMITS) -> RejectCode:
    with pytest.raises(ProtocolError) as info:
        open_message([message], key, limits)
    return info.value.code


def test_open_message_is_verify_of_from_message() -> None:
    message = to_message(prepare_parts())
    assert [bytes(v) for v in open_message([message], KEY)] == [bytes(v) for v in verify(from_message([message]), KEY)]
    assert open_code(message, bytes(32)) == RejectCode.BAD_MAC
    tampered = bytearray(message)
    tampered[40] ^= 1  # inside the envelope
    assert open_code(bytes(tampered)) == RejectCode.BAD_MAC
    two = to_message(prepare_parts()[:2])  # a MAC-less frame: two sections
    assert open_code(two) == RejectCode.MALFORMED
    assert open_code(message, limits=dataclasses.replace(DEFAULT_LIMITS, max_frame_bytes=200)) == RejectCode.TOO_LARGE
    assert open_code(message[:-8]) == RejectCode.MALFORMED  # from_message's own checks come first


@FUZZ
@given(st.binary(max_size=400))
def test_random_messages_are_refused_or_cut_into_sections_inside_them(raw: bytes) -> None:
    try:
        views = from_message([raw])
    except ProtocolError:
        return
    assert sum(v.nbytes for v in views) <= len(raw)
    assert all(v.obj is not None and v.readonly for v in views)


@FUZZ
@given(st.data())
def test_mutated_messages_never_decode_into_another_frame(data: st.DataObject) -> None:
    message = bytearray(to_message(prepare_parts()))
    at = data.draw(st.integers(0, len(message) - 1))
    message[at] ^= 1 << data.draw(st.integers(0, 7))
    try:
        views = from_message([bytes(message)])
    except ProtocolError:
        return
    try:
        decode(views, KEY)
    except ProtocolError:
        return
    # Only a flipped padding byte (outside every section) leaves the frame as it was.
    assert [bytes(v) for v in views] == prepare_parts()


def test_parts_that_are_not_buffers_are_refused() -> None:
    assert reject_code([1, 2, 3]) == RejectCode.MALFORMED
    assert reject_code(None) == RejectCode.MALFORMED


# -- signed with the key: everything behind the MAC -----------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


@FUZZ
@given(msgpack_values, st.binary(max_size=64))
def test_signed_random_envelopes_are_refused(envelope: object, payload: bytes) -> None:
    reject_code(signed(envelope, payload))


@FUZZ
@given(st.binary(max_size=300))
def test_signed_random_envelope_bytes_are_refused(raw: bytes) -> None:
    reject_code(signed(None, raw_envelope=raw))


@FUZZ
@given(st.data())
def test_signed_mutations_of_a_valid_envelope_decode_or_refuse(data: st.DataObject) -> None:
    # Replace one value anywhere in a real PREPARE or WELCOME envelope: the result is a Frame or a
    # ProtocolError, never any other exception.
    body = data.draw(st.sampled_from([valid_prepare(), Welcome(1, 1, 2, GEOMETRY)]))
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, body))
    node = env
    while True:
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        child = node[key]
        if isinstance(child, (dict, list)) and child and data.draw(st.booleans()):
            node = child
            continue
        node[key] = data.draw(msgpack_values)
        break
    try:
        frame = decode(signed(env, arrays), KEY)
    except ProtocolError:
        return
    assert isinstance(frame, Frame)


def test_extension_types_are_refused() -> None:
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, Ready(0)))
    env["run_id"] = msgpack.ExtType(5, b"abc")
    assert reject_code(signed(env, arrays)) == RejectCode.MALFORMED
    env["run_id"] = msgpack.Timestamp(1, 0)
    assert reject_code(signed(None, raw_envelope=msgpack.packb(env, datetime=False))) == RejectCode.MALFORMED
    # A zero-length extension passes any length limit: the ext hook refuses it.
    with pytest.raises(ProtocolError, match="extension type 5"):
        decode(signed(None, raw_envelope=b"\xc7\x00\x05"), KEY)


def test_huge_declared_sizes_are_refused_before_allocation() -> None:
    # Headers that claim 2**32 - 1 entries (map32, array32) or bytes (str32, bin32), nothing behind.
    for header in (b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff"):
        assert reject_code(signed(None, raw_envelope=header)) == RejectCode.TOO_LARGE
    for header in (b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"):
        assert reject_code(signed(None, raw_envelope=header)) in (RejectCode.TOO_LARGE, RejectCode.MALFORMED)


def test_big_maps_arrays_and_strings_are_refused() -> None:
    assert reject_code(signed({str(i): i for i in range(DEFAULT_LIMITS.max_map_len + 1)})) == RejectCode.TOO_LARGE
    assert reject_code(signed(list(range(DEFAULT_LIMITS.max_array_len + 1)))) == RejectCode.TOO_LARGE
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, Ready(0)))
    env["run_id"] = "x" * (DEFAULT_LIMITS.max_str_len + 1)
    assert reject_code(signed(env, arrays)) == RejectCode.TOO_LARGE


def test_deep_nesting_is_refused() -> None:
    assert reject_code(signed(None, raw_envelope=b"\x91" * 100_000 + b"\xc0")) == RejectCode.MALFORMED


def test_trailing_bytes_after_the_envelope_are_refused() -> None:
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, Ready(0)))
    assert reject_code(signed(None, arrays, raw_envelope=msgpack.packb(env) + b"\x00")) == RejectCode.MALFORMED


def test_unknown_frame_type_is_refused() -> None:
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, Go()))
    env["type"] = max(FrameType) + 1
    with pytest.raises(ProtocolError, match="unknown frame type"):
        decode(signed(env, arrays), KEY)


@pytest.mark.parametrize(
    "path, value",
    [
        (("version",), True),  # bool is not an integer on the wire
        (("step",), 1.0),
        (("seq",), "1"),
        (("run_id",), b"r"),
        (("body", "rank"), None),
        (("body", "rank"), 2**64 - 1 + 0.5),
    ],
)
def test_mistyped_fields_are_refused(path: tuple[str, ...], value: object) -> None:
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, Ready(0)))
    node = env
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    assert reject_code(signed(env, arrays)) == RejectCode.MALFORMED


def test_missing_and_extra_fields_are_refused() -> None:
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, Welcome(1, 1, 2, GEOMETRY)))
    del env["body"]["geometry"]["num_host_pages"]
    with pytest.raises(ProtocolError, match="missing \\['num_host_pages'\\]"):
        decode(signed(env, arrays), KEY)
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, Ready(0)))
    env["body"]["extra"] = 1
    assert reject_code(signed(env, arrays)) == RejectCode.MALFORMED
    env, arrays = envelope_of(Frame(1, 1, "r", 1, 1, Ready(0)))
    env["extra"] = 1
    assert reject_code(signed(env, arrays)) == RejectCode.MALFORMED


def result_frame() -> Frame:
    return Frame(1, 1, "r", 1, 1, Result(np.arange(3), np.arange(3), np.zeros(3), np.ones(3), 5))


def test_array_length_that_disagrees_with_its_bytes_is_refused() -> None:
    env, payload = envelope_of(result_frame())
    env["arrays"][0] = 2**40  # oversized declared length
    assert reject_code(signed(env, payload)) == RejectCode.LENGTH_MISMATCH
    env, payload = envelope_of(result_frame())
    env["arrays"][0] = -1
    assert reject_code(signed(env, payload)) == RejectCode.MALFORMED
    env, payload = envelope_of(result_frame())
    assert reject_code(signed(env, payload[:-1])) == RejectCode.LENGTH_MISMATCH
    assert reject_code(signed(env, payload + bytes(8))) == RejectCode.LENGTH_MISMATCH


def test_array_listing_must_give_each_array_one_integer_length() -> None:
    env, payload = envelope_of(result_frame())
    env["arrays"].pop()
    assert reject_code(signed(env, payload)) == RejectCode.MALFORMED
    env, payload = envelope_of(result_frame())
    env["arrays"][1] = [env["arrays"][1]]  # the version-3 [name, length] pairs are not lengths
    assert reject_code(signed(env, payload)) == RejectCode.MALFORMED
    env, payload = envelope_of(result_frame())
    env["arrays"][1] = 3.0
    assert reject_code(signed(env, payload)) == RejectCode.MALFORMED
    env, payload = envelope_of(result_frame())
    env["arrays"][1] = True  # msgpack's true is no length, though Python's bool is an int
    assert reject_code(signed(env, payload)) == RejectCode.MALFORMED
    env, payload = envelope_of(result_frame())
    env["arrays"][0], env["arrays"][1] = 2**40, -1  # a bad length is refused as such after an oversized one
    assert reject_code(signed(env, payload)) == RejectCode.MALFORMED


def test_arrays_are_aligned_views_of_the_one_payload() -> None:
    parts = encode(result_frame(), KEY)
    assert len(parts) == 3
    got = decode(parts, KEY).body
    for name in ("seq_ids", "token_ids", "logprobs", "finite"):
        array = getattr(got, name)
        assert np.shares_memory(array, np.frombuffer(parts[1], np.uint8)) or array.size == 0
        assert array.ctypes.data % 8 == 0 and not array.flags.writeable


def test_a_body_without_arrays_has_an_empty_payload() -> None:
    env, payload = envelope_of(Frame(1, 1, "r", 1, 1, Go()))
    assert payload == b"" and env["arrays"] == []
    assert reject_code(signed(env, b"\0" * 8)) == RejectCode.LENGTH_MISMATCH


def test_strided_views_and_lists_encode_as_their_contiguous_arrays() -> None:
    # The payload joins the arrays' own buffers: a strided view has no flat one, and a list is
    # converted first; each must give the bytes its contiguous array gives.
    body = result_frame().body
    wide = np.arange(2 * body.token_ids.shape[0], dtype=ARRAY_DTYPES[type(body)]["token_ids"])
    strided = dataclasses.replace(body, token_ids=wide[::2], seq_ids=body.seq_ids.tolist())
    assert not strided.token_ids.flags.c_contiguous
    plain = dataclasses.replace(body, token_ids=np.ascontiguousarray(wide[::2]))
    assert encode(Frame(1, 1, "r", 1, 1, strided), KEY) == encode(Frame(1, 1, "r", 1, 1, plain), KEY)
    got = decode(encode(Frame(1, 1, "r", 1, 1, strided), KEY), KEY).body
    assert got.token_ids.tolist() == wide[::2].tolist() and got.seq_ids.tolist() == body.seq_ids.tolist()


def test_encode_refuses_what_it_cannot_carry_as_the_callers_bug() -> None:
    # Nothing a peer sent: a UsageError, never a ProtocolError that could become a REJECT.
    with pytest.raises(UsageError, match="one-dimensional"):
        encode(Frame(1, 1, "r", 1, 1, dataclasses.replace(result_frame().body, seq_ids=np.zeros((2, 2)))), KEY)
    with pytest.raises(UsageError, match="without loss"):
        encode(Frame(1, 1, "r", 1, 1, dataclasses.replace(result_frame().body, token_ids=np.array([2**40]))), KEY)
    with pytest.raises(UsageError, match="not a frame body"):
        encode(Frame(1, 1, "r", 1, 1, GEOMETRY), KEY)
    with pytest.raises(UsageError, match="cannot encode"):
        encode(Frame(1, 1, object(), 1, 1, Go()), KEY)


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=6), st.binary(min_size=16, max_size=100))
@settings(max_examples=50, deadline=None)
def test_frame_mac_is_standard_hmac_sha256_over_lengths_then_parts(parts: list[bytes], key: bytes) -> None:
    # docs/protocol.md's definition, computed with the standard library's HMAC: a peer in another
    # language implements exactly this.
    header = b"".join(n.to_bytes(8, "little") for n in [len(parts), *map(len, parts)])
    assert frame_mac(key, parts) == hmac.new(key, header + b"".join(parts), hashlib.sha256).digest()


def test_short_keys_are_refused() -> None:
    for key in (b"short", "a str of 32 characters, not bytes"):
        with pytest.raises(UsageError, match="at least 16"):
            encode(Frame(1, 1, "r", 1, 1, Go()), key)
        with pytest.raises(UsageError, match="at least 16"):
            decode(encode(Frame(1, 1, "r", 1, 1, Go()), KEY), key)
