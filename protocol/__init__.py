"""Wire protocol between the scheduler and the executors: frames, codec, validation, auth, transport.

Imports no torch (tests/test_boundaries.py enforces it).
"""

from protocol.auth import ReplayGuard, key_from_environment, new_key, read_key_file, write_key_file
from protocol.codec import DEFAULT_LIMITS, Limits, decode, encode
from protocol.errors import ProtocolError, RejectCode, TransportError
from protocol.frames import (
    ARRAY_DTYPES,
    BODY_TYPES,
    LAYOUT_VERSION,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Abort,
    Body,
    CacheGeometry,
    Done,
    Frame,
    FrameType,
    Go,
    Heartbeat,
    Hello,
    KVDtype,
    Prepare,
    Ready,
    Reject,
    Result,
    Shutdown,
    Welcome,
)
from protocol.transport import ExecutorEndpoint, Received, SchedulerEndpoint, ipc_address
from protocol.validate import check_envelope, check_geometry, negotiate_version, validate_prepare

__all__ = [
    "ARRAY_DTYPES",
    "BODY_TYPES",
    "DEFAULT_LIMITS",
    "LAYOUT_VERSION",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Abort",
    "Body",
    "CacheGeometry",
    "Done",
    "ExecutorEndpoint",
    "Frame",
    "FrameType",
    "Go",
    "Heartbeat",
    "Hello",
    "KVDtype",
    "Limits",
    "Prepare",
    "ProtocolError",
    "Ready",
    "Received",
    "Reject",
    "RejectCode",
    "ReplayGuard",
    "Result",
    "SchedulerEndpoint",
    "Shutdown",
    "TransportError",
    "Welcome",
    "check_envelope",
    "check_geometry",
    "decode",
    "encode",
    "ipc_address",
    "key_from_environment",
    "negotiate_version",
    "new_key",
    "read_key_file",
    "validate_prepare",
    "write_key_file",
]
