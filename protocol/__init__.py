"""Wire protocol between the scheduler and the executors: frames, codec, validation, the
conversation, authentication, key files, transport.

Imports no torch (tests/test_boundaries.py enforces it).
"""

from protocol.auth import ReplayGuard, new_key
from protocol.codec import DEFAULT_LIMITS, Limits, decode, decode_verified, encode, verify
from protocol.continuation import expand
from protocol.conversation import ExecutorConversation, Outgoing, Phase, SchedulerConversation
from protocol.curve import ClientCurve, LaunchKeys, ServerCurve, load_keys, write_key_directories
from protocol.errors import KeyFileError, ProtocolError, RejectCode, TPRuntimeError, TransportError, UsageError
from protocol.frames import (
    ARRAY_DTYPES,
    BODY_TYPES,
    LAYOUT_VERSION,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Abort,
    Body,
    CacheGeometry,
    Continue,
    Cut,
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
from protocol.transport import ExecutorEndpoint, PeerStats, Received, SchedulerEndpoint, ipc_address
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
    "ClientCurve",
    "Continue",
    "Cut",
    "Done",
    "ExecutorConversation",
    "ExecutorEndpoint",
    "Frame",
    "FrameType",
    "Go",
    "Heartbeat",
    "Hello",
    "KVDtype",
    "KeyFileError",
    "LaunchKeys",
    "Limits",
    "Outgoing",
    "PeerStats",
    "Phase",
    "Prepare",
    "ProtocolError",
    "Ready",
    "Received",
    "Reject",
    "RejectCode",
    "ReplayGuard",
    "Result",
    "SchedulerConversation",
    "SchedulerEndpoint",
    "ServerCurve",
    "Shutdown",
    "TPRuntimeError",
    "TransportError",
    "UsageError",
    "Welcome",
    "check_envelope",
    "check_geometry",
    "decode",
    "decode_verified",
    "encode",
    "expand",
    "ipc_address",
    "load_keys",
    "negotiate_version",
    "new_key",
    "validate_prepare",
    "verify",
    "write_key_directories",
]
