"""POST /generate: shortfin's generation endpoint (the one in the KV-cache NaN report this runtime is
built around). The whole text comes back as one `data:` line, or streamed as one event per delta."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from tp_runtime.http.api_models import GenerateRequest
from tp_runtime.http.body import read_json
from tp_runtime.http.errors import ApiError
from tp_runtime.http.service import GenerationService, arrival_time
from tp_runtime.http.sse import SSE_MEDIA_TYPE, LastEvents, sse

PATH = "/generate"
CLIENT_CLOSED = 499  # nginx's status for a client that went away: nothing is sent to it anyway


async def generate(service: GenerationService, request: Request) -> Response:
    arrival = arrival_time()
    body = await read_json(request, GenerateRequest, any_content_type=True)
    sampling = body.sampling()
    service.check_sampling(sampling)
    prompt = await service.encode_prompt(body.text, "text")
    (generation,) = service.start(service.prepare(prompt, sampling, "text"), arrival)
    if not body.stream:
        results = await service.collect(request, [generation])
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        # shortfin answers a whole generation as one `data: ` line, newlines and all.
        return Response(f"data: {results[0].text}\n\n", media_type=SSE_MEDIA_TYPE)

    async def events() -> AsyncGenerator[str, None]:
        async for _, piece in generation.pieces():
            if piece.finish_reason is not None:
                yield LastEvents(sse(piece.text) if piece.text else "")
            elif piece.text:
                yield sse(piece.text)

    def error_events(error: ApiError) -> list[str]:
        return [sse(json.dumps(error.body()), event="error")]

    return service.stream(events(), error_events)


def endpoints(service: GenerationService) -> list[tuple[str, Callable[[Request], Awaitable[Response]]]]:
    async def _generate(request: Request) -> Response:
        return await generate(service, request)

    return [(PATH, _generate)]
