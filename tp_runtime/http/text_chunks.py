"""A stream's plain text chunk, rendered by concatenation.

Nearly every chunk a stream sends differs from the one before only in its text. The endpoint's
pydantic model renders such a chunk once per choice, with a placeholder for the text; each chunk
after is the pieces around the text's JSON string. The model stays the one declaration of the
chunk's shape, and the text is escaped by pydantic's own serializer (pydantic_core.to_json), so a
rendered chunk is byte for byte what the model would dump (tests/server/test_text_chunks.py). The
model's validation and dump were ~15 Python calls of every streamed token. A chunk may carry the
piece's token ids too (vLLM's return_token_ids, which benchmark clients send), and the piece's
logprobs (their fields, logprobs.completion_fields or chat_fields, rendered by the same serializer;
through the models, five alternatives a token cost the HTTP thread 0.019 ms of CPU a token, now
0.011: docs/control_plane.md, change 90): each a slot of its own, wherever the model puts it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import to_json

# A chunk's slots, as indexes into render()'s values; their names, for errors.
TEXT, LOGPROBS, IDS = 0, 1, 2
_NAMES = ("text", "logprobs", "token ids")


@dataclass(frozen=True)
class TextChunk:
    head: str  # the chunk's JSON before its first slot
    slots: tuple[tuple[int, str], ...]  # each slot (TEXT, LOGPROBS, IDS) in the chunk's order, with the JSON after it

    @classmethod
    def of(
        cls, dump: Callable[[str, list[int] | None, BaseModel | None], str], with_ids: bool = False,
        logprobs: Callable[[str], BaseModel] | None = None,
    ) -> TextChunk:  # fmt: skip
        """From `dump(text, token_ids, logprobs)`: the chunk's JSON for a text (and its token ids,
        when with_ids, and its logprobs, when `logprobs` makes the endpoint's logprobs model holding
        a marker string), as the model renders it."""
        placeholder = f"text-{os.urandom(16).hex()}"
        marker = [-1 - int.from_bytes(os.urandom(7), "big")]  # no token has a negative id
        held_logprobs = None if logprobs is None else logprobs(f"logprobs-{os.urandom(16).hex()}")
        rendered = dump(placeholder, marker if with_ids else None, held_logprobs)
        held = {TEXT: to_json(placeholder).decode()}
        if with_ids:
            held[IDS] = to_json(marker).decode()
        if held_logprobs is not None:
            held[LOGPROBS] = held_logprobs.model_dump_json()
        for slot, quoted in held.items():
            if rendered.count(quoted) != 1:
                raise ValueError(f"the chunk does not hold its {_NAMES[slot]} exactly once: {rendered!r}")
        order = sorted(held, key=lambda slot: rendered.index(held[slot]))
        pieces, rest = [], rendered
        for slot in order:
            before, rest = rest.split(held[slot])
            pieces.append(before)
        pieces.append(rest)
        return cls(pieces[0], tuple(zip(order, pieces[1:])))

    def render(self, text: str, token_ids: Sequence[int] = (), logprobs: dict[str, list] | None = None) -> str:
        """The chunk of `text`, with `token_ids` and `logprobs` (the fields of the endpoint's
        logprobs model) where it has their slots (others are not read); inf and NaN as null, as the
        models write them. Once per streamed piece: a tuple and one string a slot."""
        values = (text, logprobs, token_ids)
        out = self.head
        for slot, after in self.slots:
            out += to_json(values[slot], inf_nan_mode="null").decode() + after
        return out
