"""Errors as the HTTP API answers them: `{"error": {"message", "type", "code", "param"}}`.

OpenAI's shape, so that the openai client raises its typed exceptions (BadRequestError,
AuthenticationError, RateLimitError, ...) with the message. Raised in a route, an ApiError is turned
into its response by the handler `install` registers; the ASGI middlewares send it themselves.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from protocol.errors import TPRuntimeError

CONTEXT_LENGTH_CODE = "context_length_exceeded"
ADMISSION_CODE = "request_too_large"


class ApiError(TPRuntimeError):
    """An error answered as JSON with an HTTP status; the message is shown to the client."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    async def send(self, send: Send, *, close: bool = False) -> None:
        """Answers from plain ASGI code (a middleware); `close` ends the connection after it, for a
        request whose body was not read to its end."""
        body = json.dumps(self.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(name.lower().encode(), value.encode()) for name, value in self.headers.items()]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def invalid_request(message: str, *, code: str = "invalid_request", param: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", code=code, param=param)


def context_too_long(message: str, *, param: str) -> ApiError:
    return invalid_request(message, code=CONTEXT_LENGTH_CODE, param=param)


def unsupported(param: str, reason: str) -> ApiError:
    return invalid_request(f"'{param}' {reason}", code="unsupported_parameter", param=param)


def unavailable(message: str, retry_after_s: float | None = None) -> ApiError:
    """503; with Retry-After while the executor group restarts (the service will be back)."""
    headers = {"Retry-After": _retry_after(retry_after_s)} if retry_after_s is not None else None
    return ApiError(503, message, type="server_unavailable", code="engine_unavailable", headers=headers)


def overloaded(message: str, retry_after_s: float) -> ApiError:
    return ApiError(
        429, message, type="rate_limit_error", code="too_many_requests", headers={"Retry-After": _retry_after(retry_after_s)}
    )


def _retry_after(seconds: float) -> str:
    # Retry-After takes whole seconds; the openai client waits that long before its retry.
    return str(max(1, round(seconds)))


def model_not_found(name: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"the model '{name}' does not exist here; this server serves '{served}'",
        type="invalid_request_error",
        code="model_not_found",
        param="model",
    )


def _path(location: tuple, *, last_is_a_key: bool) -> str:
    # Pydantic adds the union member it tried ("str", "list[int]", "function-after[...]") to the
    # location: the client wrote none of them. An unknown field's own name is kept, whatever it is.
    parts = list(location[:-1] if last_is_a_key else location)
    kept = [str(part) for part in parts if part != "body" and not _is_union_tag(part)]
    return ".".join(kept + ([str(location[-1])] if last_is_a_key and location else []))


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """One sentence per pydantic error, with the field path as JSON would write it; `param` is the
    first field named."""
    sentences = []
    first_param = None
    for error in exc.errors():
        kind = error.get("type")
        path = _path(tuple(error.get("loc", ())), last_is_a_key=kind == "extra_forbidden")
        if kind == "json_invalid":
            ctx = error.get("ctx", {})
            sentences.append(f"the request body is not valid JSON ({ctx.get('error', 'parse error')})")
            continue
        first_param = first_param or path or None
        if kind == "extra_forbidden":
            sentences.append(f"'{path}' is not a field of this request: remove it (docs/http_api.md lists them)")
        elif kind == "model_type" and not path:
            sentences.append("the request body must be a JSON object")
        else:
            subject = f"'{path}'" if path else "the request body"
            sentences.append(f"{subject}: {error.get('msg', 'invalid value')}")
    return invalid_request("; ".join(dict.fromkeys(sentences)) or "the request is invalid", param=first_param)


def install(app: FastAPI, count_invalid: Callable[[], None]) -> None:
    """Registers the handlers that answer every error as JSON; `count_invalid` is called for each
    request refused as invalid (admission refusals are counted where the engine raises them)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        if 400 <= exc.status < 500 and exc.status != 429 and exc.code != ADMISSION_CODE:
            count_invalid()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        count_invalid()
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, str(exc.detail), type="invalid_request_error", code=code).response()
