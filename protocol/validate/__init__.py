"""Checks a receiver runs on a decoded frame before acting on it.

Every failure is a ProtocolError whose code says which rule was broken and whose message names the
offending field, index and value, so a REJECT is actionable on its own; nothing else escapes, whatever
a correctly signed frame holds. Arithmetic on wire values is done in int64 after the operands are
range-checked (or compares instead of subtracting), so no int32 wraps. Checks are vectorized: a
256-sequence PREPARE validates in tens of microseconds.

Rules broken by a sequence's own fields (sampling parameters, feedback, token ids) are checked last,
on an otherwise sound frame, and name every offending sequence in ProtocolError.seq_ids, so that only
their requests fail. Everything else (lengths, limits, page ids, ordering) refuses the whole frame.

One module a concept: `envelope` (the envelope and the handshake's agreements), `prepare` (PREPARE's
lengths, limits, page ids and positions, and the part of them a CONTINUE's expansion can break), `own_fields` (the rules a sequence's own fields can break)
and `array_checks` (the vectorized checks those two are built from).
"""

from protocol.validate.envelope import check_envelope, check_geometry, negotiate_version
from protocol.validate.prepare import validate_continued, validate_prepare

__all__ = ["check_envelope", "check_geometry", "negotiate_version", "validate_continued", "validate_prepare"]
