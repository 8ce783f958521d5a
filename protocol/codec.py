"""Frame <-> one ZeroMQ message, with no socket in sight (sans-IO).

Sections: [envelope, payload, mac], sent as one message (`to_message`): the MAC's header (the
section count and each section's byte length) and then the sections, each from a multiple of 8
bytes. One message, not one ZeroMQ part per section: pyzmq gives up the GIL around every part it
sends or receives, and taking it back from a busy thread (an HTTP loop, a model's forward) costs up
to the interpreter's switch interval, so every part is a chance to wait (docs/control_plane.md).
- envelope: a msgpack map {version, layout, type, run_id, step, seq, body, arrays}; `body` maps the
  body's scalar fields (nested dataclasses as maps) and `arrays` lists every array field's length in
  elements, in the order frames.ARRAY_DTYPES declares the body's arrays.
- payload: the arrays' raw little-endian buffers one after the other, each starting at a multiple
  of 8 bytes (zero padding between them), dtypes from frames.ARRAY_DTYPES. One part, not one per
  array: every ZeroMQ part costs a message of its own on both sides (a 33-array PREPARE took 30x
  the time of the same bytes in one part to send and receive, docs/control_plane.md).
- mac: HMAC-SHA256 over a header of the section count and every section's byte length, then every
  earlier section: with the lengths under the MAC, bytes cannot be moved between sections.

Decoding is two stages, after `from_message` has cut a message into its sections. `verify` checks
the section count and total size (both cheap, and they bound the hashing work), then the MAC: a
frame that fails here cannot be attributed to a holder of the key. `open_message` is both for a
received message.
`decode_verified` checks everything else on a verified frame. `decode` runs both; every failure is a
ProtocolError. Encoding a body the codec cannot carry, or with a key that is not one, is the
caller's bug: a UsageError.
"""

from __future__ import annotations

import dataclasses
import hmac
import struct
import typing
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from protocol import frames
from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import ARRAY_DTYPES, BODY_TYPES, FRAME_TYPE_OF, Frame, FrameType

MAC_BYTES = 32
MIN_KEY_BYTES = 16

_ENVELOPE_KEYS = frozenset(("version", "layout", "type", "run_id", "step", "seq", "body", "arrays"))


@dataclass(frozen=True)
class Limits:
    """Upper bounds a decoder enforces before trusting a frame's contents."""

    max_frame_bytes: int = 64 << 20  # all sections together
    max_envelope_bytes: int = 1 << 20
    max_parts: int = 3  # sections: envelope, payload, mac
    max_array_len: int = 1024  # msgpack arrays inside the envelope
    max_map_len: int = 64
    max_str_len: int = 64 << 10


DEFAULT_LIMITS = Limits()


# Field specs, computed once per class so that encode/decode do no per-call introspection.
_INT, _FLOAT, _STR, _BOOL, _INT_TUPLE = "int", "float", "str", "bool", "int_tuple"


@dataclass(frozen=True)
class _Spec:
    cls: type
    scalars: tuple[tuple[str, object], ...]  # (name, kind); kind is one of the above or a _Spec
    arrays: tuple[tuple[str, np.dtype], ...]
    scalar_names: frozenset[str]


def _kind_of(hint: object) -> object:
    if hint is int:
        return _INT
    if hint is float:
        return _FLOAT
    if hint is str:
        return _STR
    if hint is bool:
        return _BOOL
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (int, Ellipsis):
        return _INT_TUPLE
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _spec_of(hint)
    raise TypeError(f"the codec cannot carry a field of type {hint!r}")


def _spec_of(cls: type) -> _Spec:
    hints = typing.get_type_hints(cls, vars(frames))
    dtypes = ARRAY_DTYPES.get(cls, {})
    arrays = list(dtypes.items())
    scalars = [(f.name, _kind_of(hints[f.name])) for f in dataclasses.fields(cls) if f.name not in dtypes]
    return _Spec(
        cls=cls,
        scalars=tuple(scalars),
        arrays=tuple(arrays),
        scalar_names=frozenset(n for n, _ in scalars),
    )


_SPECS: dict[type, _Spec] = {cls: _spec_of(cls) for cls in BODY_TYPES.values()}
_FRAME_TYPES_BY_VALUE: dict[int, FrameType] = {int(t): t for t in FrameType}
_ALIGN = 8
_PADDING = tuple(bytes(n) for n in range(_ALIGN))


def _header(parts: Sequence[bytes | memoryview]) -> bytes:
    """The section count and every section's byte length, 8-byte little-endian unsigned integers."""
    return struct.pack(f"<{len(parts) + 1}Q", len(parts), *map(len, parts))


def frame_mac(key: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    """HMAC-SHA256 over the sections' header, then the sections themselves (bytes or byte-format
    views)."""
    if type(key) is not bytes or len(key) < MIN_KEY_BYTES:
        raise UsageError(f"the frame key must be bytes, at least {MIN_KEY_BYTES} of them")
    mac = hmac.new(key, _header(parts), "sha256")
    for p in parts:
        mac.update(p)
    return mac.digest()


def to_message(sections: Sequence[bytes]) -> bytes:
    """The one ZeroMQ message that carries `sections`: their header, then each section from a
    multiple of 8 bytes (zero padding between them), so that the payload's arrays stay aligned."""
    chunks = [_header(sections)]
    for section in sections:
        chunks.append(section)
        chunks.append(_PADDING[-len(section) % _ALIGN])
    return b"".join(chunks)


def from_message(parts: Sequence[object], limits: Limits = DEFAULT_LIMITS) -> list[memoryview]:
    """The sections of a frame received as ZeroMQ parts (exactly one: `to_message`'s), as views
    into it. The header is checked against the message's own length before anything is sliced."""
    try:
        count = len(parts)
    except TypeError as exc:
        raise ProtocolError(RejectCode.MALFORMED, "a frame must be a sequence of ZeroMQ parts") from exc
    if count != 1:
        raise ProtocolError(RejectCode.MALFORMED, f"a frame is one ZeroMQ message, got {count} parts")
    (message,) = _byte_views(parts)
    size = message.nbytes  # the sections' total is held to max_frame_bytes by `verify`
    if size < _ALIGN:
        raise ProtocolError(RejectCode.MALFORMED, f"a {size}-byte message has no section header")
    (sections,) = struct.unpack_from("<Q", message)
    if sections > limits.max_parts:
        raise ProtocolError(RejectCode.TOO_LARGE, f"{sections} sections exceed the limit of {limits.max_parts}")
    at = _ALIGN * (sections + 1)
    if size < at:
        raise ProtocolError(RejectCode.MALFORMED, f"a {size}-byte message cannot hold the header of {sections} sections")
    views = []
    for length in struct.unpack_from(f"<{sections}Q", message, _ALIGN):
        if length > size - at:
            raise ProtocolError(RejectCode.MALFORMED, "a section runs past the end of its message")
        views.append(message[at : at + length])
        at += length + (-length % _ALIGN)
    if at != size:
        raise ProtocolError(RejectCode.MALFORMED, f"the sections end at byte {at} of a {size}-byte message")
    return views


def _pack_default(obj: object) -> object:
    # numpy scalars sneak into scalar fields (e.g. a step counter taken from an array).
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"cannot encode a {type(obj).__name__} in a frame field")


def _scalars_to_map(spec: _Spec, obj: object) -> dict[str, object]:
    out = {}
    for name, kind in spec.scalars:
        value = getattr(obj, name)
        out[name] = _scalars_to_map(kind, value) if isinstance(kind, _Spec) else value
    return out


def _array(cls_name: str, name: str, value: object, dtype: np.dtype) -> np.ndarray:
    """A field that is not already a one-dimensional array of its dtype, as one, where that loses
    nothing."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise UsageError(f"{cls_name}.{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype != dtype:
        if arr.size == 0:
            return arr.astype(dtype)
        cast = arr.astype(dtype)
        if not np.array_equal(cast, arr):
            raise UsageError(f"{cls_name}.{name} does not fit {dtype.name} without loss (got {arr.dtype.name})")
        return cast
    return arr


def encode(frame: Frame, key: bytes) -> list[bytes]:
    """Encode a frame into its sections, the last one its MAC (`to_message` makes them one
    ZeroMQ message)."""
    body = frame.body
    spec = _SPECS.get(type(body))
    if spec is None:
        raise UsageError(f"{type(body).__name__} is not a frame body")
    cls_name = spec.cls.__name__
    # The arrays go into the payload's join as they are (bytes.join reads any contiguous buffer):
    # a tobytes() copy and a helper's call per array were a tenth of a 36-array PREPARE's
    # encoding, on the engine thread's path once a step (docs/control_plane.md, change 105).
    chunks: list[object] = []
    lengths: list[int] = []
    for name, dtype in spec.arrays:
        value = getattr(body, name)
        if type(value) is not np.ndarray or value.dtype != dtype or value.ndim != 1:
            value = _array(cls_name, name, value, dtype)
        n = len(value)
        lengths.append(n)
        chunks.append(value)
        chunks.append(_PADDING[-n * dtype.itemsize % _ALIGN])
    try:
        payload = b"".join(chunks)
    except TypeError:  # a strided view (not contiguous) has no flat buffer
        payload = b"".join([np.ascontiguousarray(c) if type(c) is np.ndarray else c for c in chunks])
    envelope = {
        "version": frame.version,
        "layout": frame.layout,
        "type": int(FRAME_TYPE_OF[spec.cls]),
        "run_id": frame.run_id,
        "step": frame.step,
        "seq": frame.seq,
        "body": _scalars_to_map(spec, body),
        "arrays": lengths,
    }
    try:
        packed = msgpack.packb(envelope, default=_pack_default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"cannot encode {cls_name}: {exc}") from exc
    parts = [packed, payload]
    parts.append(frame_mac(key, parts))
    return parts


def _reject_ext(code: int, data: bytes) -> object:
    raise ProtocolError(RejectCode.MALFORMED, f"msgpack extension type {code} is not allowed")


def _byte_views(parts: Sequence[object]) -> list[memoryview]:
    """One read-only, flat byte view per part. Read-only views make numpy.frombuffer return
    read-only arrays without a flags update (which costs more than the view); zmq.Frame buffers
    are writable. Bytes and zmq frames are flat already: the cast is the rare path."""
    try:
        views = [memoryview(p) for p in parts]
    except TypeError as exc:
        raise ProtocolError(RejectCode.MALFORMED, "every part must be a byte buffer") from exc
    for i, view in enumerate(views):
        if view.format != "B" or view.ndim != 1:
            try:
                views[i] = view.cast("B")
            except (TypeError, ValueError) as exc:
                raise ProtocolError(
                    RejectCode.MALFORMED, f"part {i} is not a contiguous byte buffer"
                ) from exc
    return [v if v.readonly else v.toreadonly() for v in views]


def _unpack_envelope(data: memoryview, limits: Limits) -> object:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=limits.max_str_len,
            max_bin_len=0,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except ValueError as exc:
        # max_ext_len=0 stops every extension type, the timestamp too (which bypasses ext_hook);
        # max_bin_len=0 every binary value: no field is binary, raw data travels in array parts.
        for kind in ("ext", "bin"):
            if f"max_{kind}_len" in str(exc):
                raise ProtocolError(RejectCode.MALFORMED, f"msgpack {kind} values are not allowed") from exc
        code = RejectCode.TOO_LARGE if "exceeds max_" in str(exc) else RejectCode.MALFORMED
        raise ProtocolError(code, f"the envelope is not valid msgpack: {exc}") from exc
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise ProtocolError(
            RejectCode.MALFORMED, f"the envelope is not valid msgpack: {type(exc).__name__} {exc}"
        ) from exc


def _mistyped(where: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(RejectCode.MALFORMED, f"{where} must be {expected}, got {type(value).__name__}")


def _check_int(where: str, value: object) -> int:
    if type(value) is not int:
        raise _mistyped(where, "an integer", value)
    return value


def _scalars_from_map(spec: _Spec, data: object, where: str) -> dict[str, object]:
    if type(data) is not dict:
        raise ProtocolError(RejectCode.MALFORMED, f"{where} must be a map, got {type(data).__name__}")
    if data.keys() != spec.scalar_names:
        missing = sorted(spec.scalar_names - data.keys())
        extra = sorted(str(k) for k in data.keys() - spec.scalar_names)
        raise ProtocolError(
            RejectCode.MALFORMED, f"{where} fields wrong: missing {missing}, unexpected {extra}"
        )
    out = {}
    for name, kind in spec.scalars:
        value = data[name]
        here = f"{where}.{name}"
        if kind is _INT:
            out[name] = _check_int(here, value)
        elif kind is _STR:
            if type(value) is not str:
                raise _mistyped(here, "a string", value)
            out[name] = value
        elif kind is _BOOL:
            if type(value) is not bool:
                raise _mistyped(here, "true or false", value)
            out[name] = value
        elif kind is _FLOAT:
            if type(value) is not float and type(value) is not int:
                raise _mistyped(here, "a number", value)
            out[name] = float(value)
        elif kind is _INT_TUPLE:
            if type(value) is not list:
                raise _mistyped(here, "an array", value)
            out[name] = tuple(_check_int(here, v) for v in value)
        else:
            out[name] = kind.cls(**_scalars_from_map(kind, value, here))
    return out


def _arrays_from_payload(spec: _Spec, lengths: object, payload: memoryview) -> dict[str, np.ndarray]:
    """Read-only views into the payload, one per array the body declares, at the offsets the
    lengths imply; the payload must hold exactly them (and their padding). The offsets are Python
    integers, exact at any length: numpy's arithmetic on them cost ~100 us of a frame's decoding
    when it ran cold, right after a forward (docs/control_plane.md, change 115)."""
    cls_name = spec.cls.__name__
    if type(lengths) is not list or len(lengths) != len(spec.arrays):
        raise ProtocolError(
            RejectCode.MALFORMED,
            f"{cls_name} carries {len(spec.arrays)} arrays; the envelope must list each one's length",
        )
    size = payload.nbytes
    offsets = []
    at = 0
    for (_, dtype), n in zip(spec.arrays, lengths):
        if type(n) is not int:
            raise ProtocolError(RejectCode.MALFORMED, f"{cls_name}: every array length must be an integer")
        if n < 0:
            raise ProtocolError(RejectCode.MALFORMED, f"{cls_name}: an array length is negative")
        offsets.append(at)
        nbytes = n * dtype.itemsize
        at += nbytes + (-nbytes % _ALIGN)
    if at != size:
        raise ProtocolError(
            RejectCode.LENGTH_MISMATCH, f"{cls_name}: the array lengths need a {at}-byte payload, the frame has {size}"
        )
    return {
        name: np.frombuffer(payload, dtype, length, offset)
        for (name, dtype), length, offset in zip(spec.arrays, lengths, offsets)
    }


def verify(parts: Sequence[bytes | memoryview], key: bytes, limits: Limits = DEFAULT_LIMITS) -> list[memoryview]:
    """The sections (bytes, memoryviews or zmq.Frame objects) as read-only byte views, once their
    count, total size and MAC have passed: from here on the frame is known to come from a key
    holder."""
    try:
        count = len(parts)
    except TypeError as exc:
        raise ProtocolError(RejectCode.MALFORMED, "a frame must be a sequence of sections") from exc
    if count > limits.max_parts:
        raise ProtocolError(RejectCode.TOO_LARGE, f"{count} sections exceed the limit of {limits.max_parts}")
    return _verified(_byte_views(parts), key, limits)


def open_message(parts: Sequence[object], key: bytes, limits: Limits = DEFAULT_LIMITS) -> list[memoryview]:
    """verify(from_message(parts)): a received message's sections, authenticated. from_message's
    views are read-only byte views already, so they are not viewed again (a dozen calls a frame on
    every rank's and the scheduler's receive path)."""
    return _verified(from_message(parts, limits), key, limits)


def _verified(views: list[memoryview], key: bytes, limits: Limits) -> list[memoryview]:
    if len(views) < 3:
        raise ProtocolError(RejectCode.MALFORMED, f"a frame has 3 sections (envelope, payload, MAC), got {len(views)}")
    total = sum([v.nbytes for v in views])
    if total > limits.max_frame_bytes:
        raise ProtocolError(
            RejectCode.TOO_LARGE, f"{total} bytes exceed the frame limit of {limits.max_frame_bytes}"
        )
    if views[-1].nbytes != MAC_BYTES or not hmac.compare_digest(frame_mac(key, views[:-1]), views[-1]):
        raise ProtocolError(RejectCode.BAD_MAC, "the frame's HMAC does not match this launch's key")
    return views


def decode_verified(views: list[memoryview], limits: Limits = DEFAULT_LIMITS) -> Frame:
    """The Frame in sections that `verify` passed. Arrays are read-only views into the sections,
    which they keep alive."""
    if views[0].nbytes > limits.max_envelope_bytes:
        raise ProtocolError(
            RejectCode.TOO_LARGE,
            f"a {views[0].nbytes}-byte envelope exceeds the limit of {limits.max_envelope_bytes}",
        )
    env = _unpack_envelope(views[0], limits)
    if type(env) is not dict or env.keys() != _ENVELOPE_KEYS:
        keys = sorted(str(k) for k in env) if type(env) is dict else type(env).__name__
        raise ProtocolError(
            RejectCode.MALFORMED, f"the envelope must be a map of {sorted(_ENVELOPE_KEYS)}, got {keys}"
        )
    frame_type = _FRAME_TYPES_BY_VALUE.get(env["type"]) if type(env["type"]) is int else None
    if frame_type is None:
        raise ProtocolError(RejectCode.MALFORMED, f"unknown frame type {env['type']!r}")
    run_id = env["run_id"]
    if type(run_id) is not str:
        raise ProtocolError(RejectCode.MALFORMED, "envelope.run_id must be a string")
    spec = _SPECS[BODY_TYPES[frame_type]]
    fields = _scalars_from_map(spec, env["body"], spec.cls.__name__)
    fields.update(_arrays_from_payload(spec, env["arrays"], views[1]))
    return Frame(
        version=_check_int("envelope.version", env["version"]),
        layout=_check_int("envelope.layout", env["layout"]),
        run_id=run_id,
        step=_check_int("envelope.step", env["step"]),
        seq=_check_int("envelope.seq", env["seq"]),
        body=spec.cls(**fields),
    )


def decode(parts: Sequence[bytes | memoryview], key: bytes, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Authenticate and decode a frame's sections into a Frame (`verify`, then `decode_verified`)."""
    return decode_verified(verify(parts, key, limits), limits)
