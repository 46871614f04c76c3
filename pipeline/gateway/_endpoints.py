"""The gateway's plain endpoints (Starlette): models, health, readiness, metrics, and the
answers for unknown paths and methods.

* ``GET /v1/models`` and ``GET /v1/models/{id}`` (ids may contain ``/``): the model names
  ``[gateway] models`` exposes, as OpenAI lists them; an unknown id is 404
  ``model_not_found``. They need a key when the gateway has keys (the app wraps them in
  its auth layer);
* ``GET /healthz``: the process answers; ``GET /readyz``: the pipeline is built and every
  Redis the configuration names answers (503 with each check's result otherwise);
* ``GET /metrics`` (with ``prometheus_metrics``): the Prometheus text of the worker's
  meters; no key needed, like the health endpoints;
* ``GET /admin/spend`` (with ``admin_key_env`` and ``[spend]``): the spend ledger's summary,
  for the admin key only (401 otherwise). Query: ``group_by`` (comma-separated fields),
  ``since`` and ``until`` (ISO 8601, or a span before now: ``24h``, ``7d``), ``format``
  (``json``, the default, or ``csv``), and any other field of `pipeline.spend.GROUPS` as a
  filter (``team=red``; repeated: any of the values).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pipeline.errors import ConfigError
from pipeline.gateway._admin import admitted
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
        # OpenAI's model object, with the fields Anthropic's has besides (both SDKs read
        # their own and ignore the others').
        return {
            "id": name,
            "object": "model",
            "created": self.gateway.started_at,
            "owned_by": "chat-pipeline",
            "type": "model",
            "display_name": name,
            "created_at": _started_at(self.gateway.started_at),
        }

    async def models(self, request: Request) -> Response:
        """What clients may send as a model: every name, and every pattern as written."""
        names = list(self.gateway.models)
        data = [self._model(name) for name in names]
        page = {"first_id": names[0] if names else None, "last_id": names[-1] if names else None}
        return JSONResponse({"object": "list", "data": data, "has_more": False, **page})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.gateway.models and self.gateway.target(name) is None:
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

    async def spend(self, request: Request) -> Response:
        """The spend ledger's summary (see the module docstring)."""
        from pipeline.spend._report import parse_time, parse_where, render

        gateway = self.gateway
        if not admitted(gateway.admin_key, request):
            body = error_body(
                "missing or invalid admin key", "invalid_request_error", "invalid_api_key"
            )
            return Response(
                body,
                401,
                headers={"www-authenticate": "Bearer"},
                media_type="application/json",
            )
        ledger = gateway.spend
        if ledger is None:
            return await self.not_found(request, HTTPException(404))
        query = request.query_params
        form = query.get("format", "json")
        try:
            if form not in ("json", "csv"):
                raise ValueError("format: expected json or csv")
            group_by = [g.strip() for g in query.get("group_by", "").split(",") if g.strip()]
            since = parse_time(query["since"]) if query.get("since") else None
            until = parse_time(query["until"]) if query.get("until") else None
            filters = {
                key: query.getlist(key)
                for key in query
                if key not in ("group_by", "since", "until", "format")
            }
            where = parse_where(filters)
            found = await ledger.summary(group_by, since=since, until=until, where=where)
        except ValueError as exc:
            return Response(
                error_body(str(exc), "invalid_request_error", "invalid_value"),
                400,
                media_type="application/json",
            )
        text = render(found, group_by, "csv" if form == "csv" else "json")
        return Response(text, media_type="text/csv" if form == "csv" else "application/json")

    async def not_found(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        code = "method_not_allowed" if status == 405 else "not_found"
        message = "method not allowed" if status == 405 else "no such endpoint"
        if request.url.path.startswith("/v1/messages"):
            # Anthropic's clients read errors under their API's paths in its shape.
            kind = "not_found_error" if status == 404 else "invalid_request_error"
            body = {"type": "error", "error": {"type": kind, "message": message}}
            return JSONResponse(body, status)
        return Response(
            error_body(message, "invalid_request_error", code),
            status,
            media_type="application/json",
        )


def _started_at(seconds: int) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
