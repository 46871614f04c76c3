"""`chat-pipeline serve`: a configured pipeline as an OpenAI-compatible HTTP endpoint.

* `pipeline.gateway.settings`: the ``[gateway]`` table (`GatewaySettings`); importable
  without the ``gateway`` extra;
* `pipeline.gateway.wire`: the Chat Completions wire, requests in and responses out;
* `pipeline.gateway.app`: the ASGI app (`create_app`), Starlette;
* `pipeline.gateway.server`: running it on uvicorn, one or more worker processes (`serve`).

Install the extra: ``pip install 'chat-pipeline[gateway]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.gateway.settings import PIPELINE_MODEL, GatewaySettings

if TYPE_CHECKING:
    from pipeline.gateway.app import create_app
    from pipeline.gateway.server import serve

__all__ = ["PIPELINE_MODEL", "GatewaySettings", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    # Starlette and uvicorn are imported on first use: the settings need neither.
    if name == "create_app":
        from pipeline.gateway.app import create_app

        return create_app
    if name == "serve":
        from pipeline.gateway.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
