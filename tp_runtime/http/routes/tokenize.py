"""vLLM's /tokenize and /detokenize (its request and answer shapes), /version and /ping.

/tokenize takes a prompt, or chat messages (and tools) that go through the chat template as a chat
completion's would; it answers the ids, their count and the context length. /detokenize answers the
text of ids in the vocabulary. Neither generates. /ping is vLLM's liveness probe (the same answer as
/health); /version names this runtime's version.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tp_runtime.http import validation
from tp_runtime.http.api_models import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from tp_runtime.http.body import read_json
from tp_runtime.http.routes.status import health
from tp_runtime.http.service import GenerationService


def version() -> str:
    try:
        return metadata.version("tp-runtime")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "0.1.0"


def _shape(raw: bytes) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """vLLM's two /tokenize bodies: one with messages, one with a prompt."""
    try:
        data = json.loads(raw)
    except ValueError:
        return TokenizeCompletionRequest  # its own parse names the error
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest


async def tokenize(service: GenerationService, served: Sequence[str], request: Request) -> TokenizeResponse:
    body = await read_json(request, _shape)
    validation.check_model(body.model, served)
    if isinstance(body, TokenizeChatRequest):
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        ids = await service.encode_chat(
            [m.model_dump() for m in body.messages], tools, body.add_generation_prompt, body.add_special_tokens
        )
    else:
        ids = await service.encode_prompt(body.prompt, "prompt", body.add_special_tokens)
    return TokenizeResponse(
        count=len(ids),
        max_model_len=service.limits.max_model_len,
        tokens=ids,
        token_strs=service.tokenizer.spellings(ids) if body.return_token_strs else None,
    )


async def detokenize(service: GenerationService, served: Sequence[str], request: Request) -> DetokenizeResponse:
    body = await read_json(request, DetokenizeRequest)
    validation.check_model(body.model, served)
    validation.check_token_ids(body.tokens, service.limits.vocab_size, "tokens")
    return DetokenizeResponse(prompt=service.tokenizer.decode(body.tokens))


def register(app: FastAPI, service: GenerationService, served_model_names: Sequence[str]) -> None:
    served = tuple(served_model_names)

    async def _tokenize(request: Request) -> TokenizeResponse:
        return await tokenize(service, served, request)

    async def _detokenize(request: Request) -> DetokenizeResponse:
        return await detokenize(service, served, request)

    async def _ping() -> JSONResponse:
        return health(service.engine)

    async def _version() -> dict[str, str]:
        return {"version": version()}

    app.add_api_route("/tokenize", _tokenize, methods=["POST"], response_model=None)
    app.add_api_route("/detokenize", _detokenize, methods=["POST"], response_model=None)
    app.add_api_route("/ping", _ping, methods=["GET", "POST"], response_model=None)
    app.add_api_route("/version", _version, methods=["GET"], response_model=None)
