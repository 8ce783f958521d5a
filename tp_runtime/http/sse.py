"""Server-sent events: the framing of every streamed answer."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

SSE_MEDIA_TYPE = "text/event-stream"
DONE = "[DONE]"

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def sse(data: str, event: str | None = None) -> str:
    """One server-sent event; a multi-line payload becomes several data lines, as SSE requires
    (a reader joins them with "\\n", so a bare "\\r" in the text arrives as "\\n")."""
    head = f"event: {event}\n" if event else ""
    if "\n" not in data and "\r" not in data:  # every JSON payload: a JSON text escapes its line breaks
        return f"{head}data: {data}\n\n"
    return head + "".join(f"data: {line}\n" for line in _LINE_BREAK.split(data)) + "\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type=SSE_MEDIA_TYPE, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
