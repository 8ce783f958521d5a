"""A stream's plain text chunk, rendered by concatenation.

Nearly every chunk a stream sends differs from the one before only in its text. The endpoint's
pydantic model renders such a chunk once per choice, with a placeholder for the text; each chunk
after is the two halves around the text's JSON string. The model stays the one declaration of the
chunk's shape, and the text is escaped by pydantic's own serializer (pydantic_core.to_json), so a
rendered chunk is byte for byte what the model would dump (tests/server/test_text_chunks.py). The
model's validation and dump were ~15 Python calls of every streamed token. A chunk may carry the
piece's token ids too (vLLM's return_token_ids, which benchmark clients send): a second slot, for
a list, after the text.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic_core import to_json


@dataclass(frozen=True)
class TextChunk:
    head: str
    middle: str  # between the text and the token ids; "" where the chunk carries none
    tail: str
    with_ids: bool  # the chunk lists the piece's token ids after its text (vLLM's return_token_ids)

    @classmethod
    def of(cls, dump: Callable[[str, list[int] | None], str], with_ids: bool = False) -> TextChunk:
        """From `dump(text, token_ids)`: the chunk's JSON for a text (and its token ids, when
        with_ids), as the model renders it."""
        placeholder = f"text-{os.urandom(16).hex()}"
        marker = [-1 - int.from_bytes(os.urandom(7), "big")]  # no token has a negative id
        rendered, quoted = dump(placeholder, marker if with_ids else None), to_json(placeholder).decode()
        if rendered.count(quoted) != 1:
            raise ValueError(f"the chunk does not hold its text exactly once: {rendered!r}")
        head, rest = rendered.split(quoted)
        if not with_ids:
            return cls(head, "", rest, False)
        listed = to_json(marker).decode()
        if rest.count(listed) != 1:
            raise ValueError(f"the chunk does not hold its token ids exactly once after its text: {rendered!r}")
        middle, tail = rest.split(listed)
        return cls(head, middle, tail, True)

    def render(self, text: str, token_ids: Sequence[int] = ()) -> str:
        if not self.with_ids:
            return self.head + to_json(text).decode() + self.tail
        return self.head + to_json(text).decode() + self.middle + to_json(token_ids).decode() + self.tail
