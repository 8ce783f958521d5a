"""A request's output grammar as the wire carries it: what the HTTP edge made of response_format,
structured_outputs, guided_* or a tool choice, for rank 0's grammar engine (executor/grammar.py).

One byte for the kind, then the grammar's text in UTF-8: a JSON schema, a regular expression, a
JSON list of choices, or a Lark/EBNF grammar (json_object has no text). It travels in PREPARE's
`grammar` bytes with its sampling state, whole (protocol/frames.py), at most GRAMMAR_MAX_BYTES.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protocol.errors import ProtocolError, RejectCode

# The most bytes one sequence's grammar may take on the wire (a JSON schema of a few dozen tools
# fits): PREPARE's size stays bounded at max_num_seqs x this.
GRAMMAR_MAX_BYTES = 256 << 10


class GrammarKind(enum.IntEnum):
    JSON_SCHEMA = 1
    JSON_OBJECT = 2  # any JSON object
    REGEX = 3
    CHOICE = 4  # text: a JSON list of strings, one of which the output is
    LARK = 5  # Lark or GBNF/EBNF, as llguidance reads them


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str = ""

    def encode(self) -> bytes:
        return bytes((int(self.kind),)) + self.text.encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> GrammarSpec:
        if not data:
            raise ProtocolError(RejectCode.MALFORMED, "an empty grammar: it needs at least its kind byte")
        try:
            kind = GrammarKind(data[0])
            text = bytes(data[1:]).decode("utf-8")
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(RejectCode.MALFORMED, f"a malformed grammar: {exc}") from None
        return cls(kind, text)
