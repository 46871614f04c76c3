"""`chat-pipeline serve`: a configured pipeline as an OpenAI-compatible HTTP endpoint.

* `pipeline.gateway.settings`: the ``[gateway]`` table (`GatewaySettings`); importable
  without the ``gateway`` extra;
* `pipeline.gateway.wire`: the Chat Completions wire, requests in and responses out, and
  the HTTP status and error every failure becomes;
* `pipeline.gateway.app`: the ASGI app (`create_app`): for each inbound format a stack of
  layers, one private module each (request ids, telemetry, auth, body, limits, the
  format's handler), and the plain endpoints (models, health, readiness, metrics);
* `pipeline.gateway.server`: running it on uvicorn, one or more worker processes (`serve`),
  with deadlines and a bound on connections (`pipeline.gateway._protocol`);
* `pipeline.gateway.response_store`: where the Responses API's stored responses are kept
  (`ResponseStore`, `MemoryResponseStore`, `RedisResponseStore`).

Install the extra: ``pip install 'chat-pipeline[gateway]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.gateway.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
)
from pipeline.gateway.settings import PIPELINE_MODEL, GatewaySettings

if TYPE_CHECKING:
    from pipeline.gateway.app import create_app
    from pipeline.gateway.server import serve

__all__ = [
    "PIPELINE_MODEL",
    "GatewaySettings",
    "MemoryResponseStore",
    "RedisResponseStore",
    "ResponseStore",
    "create_app",
    "serve",
]


def __getattr__(name: str) -> Any:
    # Starlette and uvicorn are imported on first use: the settings need neither.
    if name == "create_app":
        from pipeline.gateway.app import create_app

        return create_app
    if name == "serve":
        from pipeline.gateway.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
