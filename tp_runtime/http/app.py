"""The HTTP app: routes, error handlers and middleware wired together, nothing else.

Everything runs on one asyncio loop in the frontend process (tokenizing in a small thread pool). The
engine is reached only through `submit`, `cancel` and `finish`, its state only through `health` and
its published `stats` snapshot; tokens come back as `RequestOutput`s on a `RequestStream`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tp_runtime.http import errors
from tp_runtime.http.direct import RuntimeApp
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
    tokenizer.build_byte_table()  # logprobs and a byte-level tokenizer's detokenizer read it
    text = TextWorker(tokenizer, settings.tokenizer_threads)
    app.router.on_shutdown.append(text.close)
    service = GenerationService(engine, tokenizer, metrics, limits, text)
    errors.install(app, metrics.request_rejects.labels("invalid").inc)

    status.register(app, engine, metrics, settings.served_model_names, settings.model_path or settings.model_name)
    # The routes that make the model generate read and answer their bodies themselves: their POSTs
    # take the direct lane (direct.py), past FastAPI's layers and the router.
    generating = dict((*generate.endpoints(service), *openai.endpoints(service, settings.served_model_names)))
    app.add_direct_routes(generating)
    tokenize.register(app, service, settings.served_model_names)

    # add_middleware wraps what is there already: the last added runs first.
    app.add_middleware(
        BodyLimits, max_bytes=settings.body_size_limit(prompt_chars), timeout_s=settings.request_body_timeout_s
    )
    app.add_middleware(OriginCheck, paths=frozenset(generating))  # a foreign web page may not make the model generate
    if settings.api_key:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key, protect_metrics=settings.require_api_key_for_metrics)
    if settings.bind_host is not None and is_loopback(settings.bind_host):
        app.add_middleware(HostCheck)
    routes = frozenset(route.path for route in app.routes if hasattr(route, "path"))
    app.add_middleware(RequestCounter, count=metrics.count_http_answer, routes=routes)
    return app
