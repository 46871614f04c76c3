"""The gateway's plain endpoints (Starlette): models, health, readiness, metrics, and the
answers for unknown paths and methods.

* ``GET /v1/models`` and ``GET /v1/models/{id}`` (ids may contain ``/``): the model names
  ``[gateway] models`` exposes, as OpenAI lists them; an unknown id is 404
  ``model_not_found``. They need a key when the gateway has keys (the app wraps them in
  its auth layer);
* ``GET /healthz``: the process answers; ``GET /readyz``: the pipeline is built and every
  Redis the configuration names answers (503 with each check's result otherwise);
* ``GET /metrics`` (with ``prometheus_metrics``): the Prometheus text of the worker's
  meters; no key needed, like the health endpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pipeline.errors import ConfigError
from pipeline.gateway.wire import WireError, error_body

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader
    from prometheus_client import CollectorRegistry

    from pipeline.gateway._shared import GatewayState as Gateway

__all__ = ["Endpoints", "prometheus_reader"]

_MODEL_NOT_FOUND = WireError(
    404,
    "the model does not exist here; GET /v1/models lists the models",
    param="model",
    code="model_not_found",
)


class Endpoints:
    """The plain endpoints of one worker's gateway (see the module docstring)."""

    def __init__(
        self, gateway: Gateway, *, registry: CollectorRegistry | None = None, close: bool = False
    ) -> None:
        self.gateway = gateway
        self._registry = registry
        self._close_after_metrics = close

    def _model(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.gateway.started_at,
            "owned_by": "chat-pipeline",
        }

    async def models(self, request: Request) -> Response:
        data = [self._model(name) for name in self.gateway.models]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.gateway.models:
            error = _MODEL_NOT_FOUND
            return Response(error.body(), error.status, media_type="application/json")
        return JSONResponse(self._model(name))

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        ready, checks = await self.gateway.readiness()
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "checks": checks},
            200 if ready else 503,
        )

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = self._registry
        if registry is None:  # the route is there only with a registry
            return await self.not_found(request, HTTPException(404))
        # Collected on the event loop: the SDK's collection is in memory, without I/O.
        body = generate_latest(registry)
        headers = {"connection": "close"} if self._close_after_metrics else None
        return Response(body, headers=headers, media_type=CONTENT_TYPE_LATEST)

    async def not_found(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        code = "method_not_allowed" if status == 405 else "not_found"
        message = "method not allowed" if status == 405 else "no such endpoint"
        return Response(
            error_body(message, "invalid_request_error", code),
            status,
            media_type="application/json",
        )


def prometheus_reader(*, per_instance: bool = False) -> tuple[MetricReader, CollectorRegistry]:
    """A metric reader for a meter provider and the registry `GET /metrics` serves it
    from. With `per_instance` every series carries the resource's ``service.instance.id``
    as a label (``service_instance_id``), so the series of several workers stay apart."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry
    except ImportError as exc:
        raise ConfigError(
            "gateway.prometheus_metrics",
            f"needs opentelemetry-exporter-prometheus ({exc.name} is missing): "
            "pip install 'chat-pipeline[gateway]'",
        ) from exc
    from opentelemetry.semconv.attributes.service_attributes import SERVICE_INSTANCE_ID

    registry = CollectorRegistry()

    def instance_only(key: str) -> bool:
        return key == SERVICE_INSTANCE_ID

    reader = PrometheusMetricReader(
        registry=registry, resource_attribute_filter=instance_only if per_instance else None
    )
    return reader, registry
