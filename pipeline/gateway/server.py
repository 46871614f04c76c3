"""Running the gateway on uvicorn: `serve` (what ``chat-pipeline serve`` calls).

The configuration is loaded and checked once in the starting process (a wrong file fails
before anything listens); each worker process then loads it again and builds its own
pipeline (`app_from_environment`, uvicorn's app factory), since clients, connection pools
and breakers in memory cannot cross a process boundary. Replicas and workers share state
only through what the file puts in Redis (breakers, session affinity).

Shutdown (SIGTERM or SIGINT): the workers stop accepting connections, the requests in
flight get ``[gateway] drain_timeout`` seconds to finish, then they are cancelled (a
cancelled stream ends with an in-band error event, see `pipeline.gateway.app`), and the
pipeline's clients are closed.

Telemetry: with ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)
set, each worker exports its spans and metrics over OTLP (`pipeline.telemetry.configure`,
service name ``OTEL_SERVICE_NAME`` or ``chat-pipeline-gateway``), flushed at shutdown.
"""

from __future__ import annotations

import inspect
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from pipeline.config import ENVIRONMENT_VARIABLE, load_config
from pipeline.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from starlette.applications import Starlette

    _Telemetry = tuple[TracerProvider | None, MeterProvider | None, Callable[[], None] | None]

__all__ = ["CONFIG_VARIABLE", "app_from_environment", "serve", "uvicorn_options"]

CONFIG_VARIABLE = "CHAT_PIPELINE_GATEWAY_CONFIG"
"""The configuration file's path, handed to the worker processes."""

SERVICE_NAME = "chat-pipeline-gateway"


def _telemetry() -> _Telemetry:
    """(tracer provider, meter provider, shutdown) when OTLP export is configured."""
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None, None, None
    from pipeline.telemetry import configure

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    handle = configure(
        None if os.environ.get("OTEL_SERVICE_NAME") else SERVICE_NAME,
        protocol="grpc" if protocol == "grpc" else "http/protobuf",
        set_global=False,
    )
    return handle.tracer_provider, handle.meter_provider, handle.shutdown


def uvicorn_options(settings: GatewaySettings | None) -> dict[str, Any]:
    """The uvicorn settings the gateway runs with (`serve` and embedders alike)."""
    settings = settings or GatewaySettings()
    return {
        # uvicorn stops accepting, waits this long for requests in flight, then cancels them.
        "timeout_graceful_shutdown": math.ceil(settings.drain_timeout),
        "access_log": False,  # a line per request costs CPU; the gateway logs failures
        "server_header": False,
    }


def app_from_environment() -> Starlette:
    """The app of one worker process, from the file named by ``CHAT_PIPELINE_GATEWAY_CONFIG``
    (and the environment overlay named by ``CHAT_PIPELINE_ENV``)."""
    from pipeline.gateway.app import create_app

    path = os.environ.get(CONFIG_VARIABLE)
    if not path:
        raise RuntimeError(f"{CONFIG_VARIABLE} names no configuration file")
    config = load_config(path)
    tracer_provider, meter_provider, shutdown = _telemetry()
    return create_app(
        config,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        on_shutdown=shutdown,
    )


def serve(
    config_path: str | os.PathLike[str],
    environment: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    workers: int = 1,
    log_level: str = "info",
) -> None:
    """Serve the pipeline `config_path` describes until SIGTERM/SIGINT (see the module
    docstring). Raises `ConfigError` for a wrong file before anything listens."""
    from pipeline.gateway.app import Gateway

    if workers < 1:
        raise ValueError("workers must be at least 1")
    config = load_config(config_path, environment)
    Gateway(config)  # refuses what a gateway cannot serve, before any worker starts
    os.environ[CONFIG_VARIABLE] = str(Path(config_path).resolve())
    if environment is not None:
        os.environ[ENVIRONMENT_VARIABLE] = environment
    server_config = uvicorn.Config(
        "pipeline.gateway.server:app_from_environment",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        **uvicorn_options(config.gateway),
    )
    server = uvicorn.Server(server_config)
    sock = listening_socket(server_config)
    try:
        if workers > 1:
            from uvicorn.supervisors import Multiprocess

            supervisor: Any = Multiprocess
            # Older uvicorn releases take the worker's entry point; newer ones make it.
            if "target" in inspect.signature(supervisor).parameters:
                supervisor(server_config, target=server.run, sockets=[sock]).run()
            else:
                supervisor(server_config, sockets=[sock]).run()
        else:
            server.run(sockets=[sock])
    finally:
        sock.close()


def listening_socket(config: uvicorn.Config) -> socket.socket:
    """uvicorn's listening socket, with ``TCP_NODELAY``: connections accepted from it
    inherit the option (asyncio sets it only on sockets it made itself). Without it, a
    keep-alive client waits for a delayed ACK (about 40 ms) between writes."""
    sock = config.bind_socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
