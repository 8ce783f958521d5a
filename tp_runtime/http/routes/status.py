"""GET /health, /metrics and /v1/models: what the runtime reports about itself. They read only the
engine's flags and its published stats snapshot, never live scheduler state."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tp_runtime.http.api_models import ModelCard, ModelList
from tp_runtime.http.metrics import Metrics

if TYPE_CHECKING:
    from tp_runtime.engine import Engine


def health(engine: Engine) -> JSONResponse:
    state = engine.health()
    if state.ok:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "reason": state.reason}, status_code=503)


def models(engine: Engine, served_model_names: Sequence[str], model_path: str, created: int) -> ModelList:
    return ModelList(
        data=[
            ModelCard(id=name, created=created, root=model_path, max_model_len=engine.max_model_len)
            for name in served_model_names
        ]
    )


def register(
    app: FastAPI, engine: Engine, metrics: Metrics, served_model_names: Sequence[str], model_path: str
) -> None:
    created = int(time.time())

    @app.get("/health")
    async def _health() -> JSONResponse:
        return health(engine)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def _models() -> ModelList:
        return models(engine, served_model_names, model_path, created)
