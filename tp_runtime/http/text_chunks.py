"""A stream's plain text chunk, rendered by concatenation.

Nearly every chunk a stream sends differs from the one before only in its text. The endpoint's
pydantic model renders such a chunk once per choice, with a placeholder for the text; each chunk
after is the two halves around the text's JSON string. The model stays the one declaration of the
chunk's shape, and the text is escaped by pydantic's own serializer (pydantic_core.to_json), so a
rendered chunk is byte for byte what the model would dump (tests/server/test_text_chunks.py). The
model's validation and dump were ~15 Python calls of every streamed token.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from pydantic_core import to_json


@dataclass(frozen=True)
class TextChunk:
    head: str
    tail: str

    @classmethod
    def of(cls, dump: Callable[[str], str]) -> TextChunk:
        """From `dump(text)`: the chunk's JSON for a text, as the model renders it."""
        placeholder = f"text-{os.urandom(16).hex()}"
        rendered, quoted = dump(placeholder), to_json(placeholder).decode()
        if rendered.count(quoted) != 1:
            raise ValueError(f"the chunk does not hold its text exactly once: {rendered!r}")
        head, tail = rendered.split(quoted)
        return cls(head, tail)

    def render(self, text: str) -> str:
        return self.head + to_json(text).decode() + self.tail
