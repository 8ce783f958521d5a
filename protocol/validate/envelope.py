"""What every frame's envelope must carry, and what the handshake must agree on (version, geometry)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import SUPPORTED_VERSIONS, CacheGeometry, Frame


def check_envelope(
    frame: Frame, *, version: int, layout: int, run_id: str, expected_step: int | None = None
) -> None:
    """The frame belongs to this launch, speaks the negotiated version and layout, and (when
    `expected_step` is given) carries that step number."""
    if frame.version != version:
        raise ProtocolError(
            RejectCode.BAD_VERSION,
            f"{frame.type.name} has protocol version {frame.version}; this peer negotiated {version}",
        )
    if frame.layout != layout:
        raise ProtocolError(
            RejectCode.BAD_LAYOUT,
            f"{frame.type.name} has cache layout version {frame.layout}; this peer negotiated {layout}",
        )
    if frame.run_id != run_id:
        raise ProtocolError(
            RejectCode.BAD_RUN_ID,
            f"{frame.type.name} belongs to run {frame.run_id!r}; this peer is in run {run_id!r}",
        )
    if expected_step is not None and frame.step != expected_step:
        raise ProtocolError(
            RejectCode.BAD_STEP,
            f"{frame.type.name} is for step {frame.step}; this peer expected step {expected_step}",
        )


def negotiate_version(offered: Iterable[int], supported: Iterable[int] = SUPPORTED_VERSIONS) -> int:
    """The highest protocol version both sides support."""
    offered_set = set(offered)
    supported_set = set(supported)
    common = offered_set & supported_set
    if not common:
        raise ProtocolError(
            RejectCode.BAD_VERSION,
            f"no common protocol version: the peer offers {sorted(offered_set)}, "
            f"this side supports {sorted(supported_set)}",
        )
    return max(common)


def check_geometry(expected: CacheGeometry, received: CacheGeometry, *, who: str) -> None:
    """Every rank must run the same cache geometry; name every field that differs."""
    if received == expected:
        return
    diffs = [
        f"{name} {getattr(received, name)!r} (expected {getattr(expected, name)!r})"
        for name in (f.name for f in dataclasses.fields(expected))
        if getattr(received, name) != getattr(expected, name)
    ]
    raise ProtocolError(
        RejectCode.GEOMETRY_MISMATCH, f"{who} has a different cache geometry: " + ", ".join(diffs)
    )

