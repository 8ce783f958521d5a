"""Request bodies: read (already bounded in size and time by middleware.BodyLimits) and parsed
into their pydantic model, every failure a JSON 4xx."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tp_runtime.http.errors import ApiError, invalid_request, validation_error

Body = TypeVar("Body", bound=BaseModel)


def _is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON, read as email.message reads it (FastAPI's way): the media
    type before any parameters, lowercased; one that is not type/subtype counts as text/plain. Done
    by hand, as email.message.Message took ~20 calls of every request."""
    if not content_type:
        return True  # as FastAPI reads a body that names no type
    media = content_type.partition(";")[0].strip().lower()
    if media.count("/") != 1:
        return False
    maintype, _, subtype = media.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


async def read_json(
    request: Request, model: type[Body] | Callable[[bytes], type[Body]], *, any_content_type: bool = False
) -> Body:
    """The body as `model` (or as the model that `model(raw bytes)` picks, for a route that takes two
    shapes). The OpenAI routes want a JSON content type (or none): a browser can
    post text/plain or a form across origins without asking first, but not JSON. /generate takes
    any, as shortfin does (`curl -d` sends a form type)."""
    content_type = request.headers.get("content-type")
    if not any_content_type and not _is_json(content_type):
        raise ApiError(
            415,
            f"the request body must be JSON (Content-Type: application/json), not {content_type}",
            type="invalid_request_error",
            code="unsupported_media_type",
        )
    raw = await request.body()
    if not raw.strip():
        raise invalid_request("the request body is empty: send a JSON object")
    if not isinstance(model, type):
        model = model(raw)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
