"""Typed errors of the wire protocol.

A RejectCode travels on the wire inside REJECT frames, so the numbers are part of the protocol:
never renumber one, only append.
"""

from __future__ import annotations

import enum


class RejectCode(enum.IntEnum):
    BAD_VERSION = 1  # protocol version not the negotiated one, or no common version
    BAD_LAYOUT = 2  # cache layout version not the negotiated one
    BAD_RUN_ID = 3  # frame belongs to another launch
    BAD_STEP = 4  # step number out of sequence
    BAD_MAC = 5  # HMAC missing or wrong: not from a holder of this launch's key
    REPLAY = 6  # seq not above the last one accepted from that sender
    MALFORMED = 7  # not a well-formed frame: parts, msgpack, fields, types
    TOO_LARGE = 8  # a decode limit (frame bytes, parts, map/array/string sizes) exceeded
    LENGTH_MISMATCH = 9  # array lengths disagree with each other or with their byte size
    PAGE_OUT_OF_RANGE = 10  # a page id outside [0, num_kv_pages)
    CLEARED_NOT_SORTED_UNIQUE = 11  # cleared_pages not strictly increasing
    CLEARED_RESTORE_OVERLAP = 12  # a page both cleared and a restore target
    TOKEN_OUT_OF_RANGE = 13  # a token id outside [0, vocab_size)
    POSITION_OUT_OF_RANGE = 14  # a position outside [0, max_model_len)
    SLOT_OUT_OF_RANGE = 15  # a host slot outside [0, num_host_pages)
    LIMIT_EXCEEDED = 16  # more sequences, tokens or pages than the geometry allows
    UNEXPECTED_FRAME = 17  # a frame type that is not valid in the receiver's current state
    GEOMETRY_MISMATCH = 18  # ranks disagree on the cache geometry or world size
    INTERNAL = 19  # the receiver failed for a reason of its own
    BAD_QUERY_LEN = 20  # a sequence with query_lens < 1
    BAD_CONTEXT_LEN = 21  # context_lens < query_lens or > max_model_len
    PAGE_TABLE_TOO_SHORT = 22  # page_table_lens * page_size < context_lens
    DUPLICATE_SEQ_ID = 23  # a sequence id twice in one step
    POSITION_MISMATCH = 24  # positions are not the last query_lens positions of the context
    BAD_SAMPLING = 25  # a sampling or logits-processing parameter out of its range
    PAGE_TABLE_BASE_MISMATCH = 26  # page_table_base is not what the receiver holds: state diverged
    BAD_FEEDBACK = 27  # feedback on a row with query_lens != 1, or a value other than 0 and 1
    FEEDBACK_WITHOUT_SAMPLE = 28  # feedback for a sequence the previous step run did not sample
    SAMPLING_STATE_NOT_HELD = 29  # sampling_state 2 for a sequence whose state the receiver does not hold
    STEP_NOT_HELD = 30  # CONTINUE, but the receiver did not accept the step before's PREPARE
    BAD_DECODE_STEPS = 31  # decode_steps out of [1, min(page_size, MAX_DECODE_STEPS)], or not a plain decode step


class TPRuntimeError(Exception):
    """The base of every error this runtime raises on purpose; anything else is a bug.

    It lives here because protocol/ is the package every other one imports."""


class ProtocolError(TPRuntimeError):
    """A frame was refused; `code` says why in a form a peer can act on, `message` in words.

    `seq_ids` names the sequences whose own fields broke the rule (sampling parameters, feedback,
    token ids) when the rest of the frame is sound: the REJECT carries them, and only their
    requests fail. Empty: the whole frame is refused."""

    def __init__(self, code: RejectCode, message: str, seq_ids: tuple[int, ...] = ()) -> None:
        super().__init__(code, message)
        self.code = RejectCode(code)
        self.message = message
        self.seq_ids = tuple(seq_ids)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class TransportError(TPRuntimeError):
    """A frame could not be handed to a peer (not connected, socket closed)."""


class UsageError(TPRuntimeError):
    """A caller broke a contract of this package: a bug on this side, never the peer's doing, so it
    never becomes a REJECT (an illegal step in the conversation, a frame body the codec cannot
    carry, a key that is not a key)."""


class KeyFileError(TPRuntimeError):
    """Key material provisioned by the operator is missing, malformed or readable by others."""
