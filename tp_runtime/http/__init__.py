"""The HTTP frontend: shortfin-style /generate, the OpenAI API, health and metrics
(docs/http_api.md). `create_app` builds it; tp_runtime.frontend serves it with uvicorn."""

from tp_runtime.http.app import create_app
from tp_runtime.http.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
