"""What both sides of the conversation share: the frame to send, the phases, the envelope checks."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from protocol.errors import ProtocolError, RejectCode
from protocol.frames import Body, Frame
from protocol.validate import check_envelope


class Outgoing(NamedTuple):
    """A frame to send: the body and the step its envelope carries, in the order the endpoints'
    send(body, step) and send_all(ranks, body, step) take them."""

    body: Body
    step: int


class Phase(enum.Enum):
    HANDSHAKE = "handshake"  # scheduler: collecting HELLOs; executor: HELLO sent, waiting for WELCOME
    AGREED = "agreed"  # scheduler: every HELLO in and consistent; WELCOME not sent yet
    RUNNING = "running"
    REFUSED = "refused"  # the handshake failed; only SHUTDOWN is left to send
    CLOSED = "closed"  # SHUTDOWN sent (scheduler) or received (executor)


def check_handshake_envelope(frame: Frame, supported: Sequence[int], layout: int, run_id: str) -> None:
    # HELLO and WELCOME are accepted at any version this side supports: agreeing on one is their
    # purpose. Every other frame must carry exactly the negotiated version.
    if frame.version not in supported:
        raise ProtocolError(
            RejectCode.BAD_VERSION,
            f"{frame.type.name} has protocol version {frame.version}; this peer supports {list(supported)}",
        )
    check_envelope(frame, version=frame.version, layout=layout, run_id=run_id)


def not_valid_now(frame: Frame, when: str) -> ProtocolError:
    return ProtocolError(RejectCode.UNEXPECTED_FRAME, f"{frame.type.name} for step {frame.step} {when}")
