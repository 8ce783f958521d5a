"""The HTTP app: routes, error handlers and middleware wired together, nothing else.

Everything runs on one asyncio loop in the frontend process (tokenizing in a small thread pool). The
engine is reached only through `submit`, `cancel` and `finish`, its state only through `health` and
its published `stats` snapshot; tokens come back as `RequestOutput`s on a `RequestStream`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import ASGIApp

from tp_runtime.http import errors
from tp_runtime.http.direct import Endpoints, RuntimeApp
from tp_runtime.http.metrics import Metrics
from tp_runtime.http.middleware import ApiKeyAuth, BodyLimits, HostCheck, OriginCheck, RequestCounter, is_loopback
from tp_runtime.http.routes import generate, openai, status, tokenize
from tp_runtime.http.service import GenerationService
from tp_runtime.http.settings import ServerSettings
from tp_runtime.http.text import TextWorker
from tp_runtime.http.validation import Limits
from tp_runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tp_runtime.engine import Engine


def create_app(engine: Engine, tokenizer: Tokenizer, settings: ServerSettings) -> RuntimeApp:
    app = RuntimeApp(title="tp-runtime", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(engine, settings.model_name)
    prompt_chars = settings.prompt_chars_limit(engine.max_model_len, tokenizer)
    limits = Limits(
        tokenizer.vocab_size, engine.max_model_len, prompt_chars, tuple(tokenizer.eos_token_ids), settings.max_logprobs
    )
    tokenizer.build_byte_table()  # logprobs read it, and the detokenizer at an unfinished character
    text = TextWorker(tokenizer, settings.tokenizer_threads)
    app.router.on_shutdown.append(text.close)
    service = GenerationService(engine, tokenizer, metrics, limits, text)
    count_invalid = metrics.request_rejects.labels("invalid").inc
    errors.install(app, count_invalid)

    status.register(app, engine, metrics, settings.served_model_names, settings.model_path or settings.model_name)
    # The routes that make the model generate read and answer their bodies themselves. Their POSTs
    # take the direct lane (direct.py); registered as plain Starlette routes too, they are listed,
    # and another method or a trailing slash is answered as for any route.
    generating = dict((*generate.endpoints(service), *openai.endpoints(service, settings.served_model_names)))
    generating_paths = frozenset(generating)
    for path, endpoint in generating.items():
        app.router.add_route(path, endpoint, methods=["POST"])
    tokenize.register(app, service, settings.served_model_names)

    # The app's middleware, innermost first; each wraps what is there already, so the last runs
    # first. The generating routes' direct lane (direct.py) runs the same list around its endpoints.
    layers: list[tuple[type, dict[str, object]]] = [
        (BodyLimits, {"max_bytes": settings.body_size_limit(prompt_chars), "timeout_s": settings.request_body_timeout_s}),
        (OriginCheck, {"paths": generating_paths}),  # a foreign web page may not make the model generate
    ]
    if settings.api_key:
        layers.append((ApiKeyAuth, {"api_key": settings.api_key, "protect_metrics": settings.require_api_key_for_metrics}))
    if settings.bind_host is not None and is_loopback(settings.bind_host):
        layers.append((HostCheck, {}))
    routes = frozenset(route.path for route in app.routes if hasattr(route, "path"))
    layers.append((RequestCounter, {"count": metrics.count_http_answer, "routes": routes}))
    direct: ASGIApp = Endpoints(generating, lambda exc: errors.answer_error(exc, count_invalid))
    for layer, options in layers:
        app.add_middleware(layer, **options)
        direct = layer(direct, **options)
    app.direct, app.direct_paths = direct, generating_paths
    return app
