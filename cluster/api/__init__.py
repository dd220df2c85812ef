"""OpenAI-compatible ingress over any `EngineClient` (a colocated AsyncEngine, a P/D router, ...).

    build_app(client, metrics=None) -> FastAPI    routes, SSE streaming, OpenAI error JSON
    EngineClient                                  what a backend implements (engine_client.py)
    EngineOverloadedError                         raise it in a backend to answer 503
"""

from k3serve.cluster.errors import EngineOverloadedError

from .app import build_app
from .engine_client import EngineClient

__all__ = ["build_app", "EngineClient", "EngineOverloadedError"]
