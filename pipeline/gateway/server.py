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

Connections (`pipeline.gateway._protocol`): uvicorn's httptools protocol with a deadline
for each request head (``header_timeout``) and body (``body_timeout``), a cap on the head's
size, idle connections kept ``keep_alive_timeout`` seconds (longer than the clients' own
idle expiry), and at most ``max_connections`` connections per worker (beyond it the
connection idle the longest is closed; with none idle the new one gets 503).

Telemetry: with ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)
set, each worker exports its spans and metrics over OTLP (`pipeline.telemetry.configure`,
service name ``OTEL_SERVICE_NAME`` or ``chat-pipeline-gateway``), flushed at shutdown.
With ``prometheus_metrics`` (or ``--prometheus-metrics``) each worker also serves its meters
at ``GET /metrics``. With several workers, a scrape is answered by the one worker that
accepts its connection, and each worker's series carry its ``service_instance_id`` (the
answer ends with ``connection: close``, so successive scrapes reach other workers): sum
across instances, and use a rate window of several scrape intervals per worker, or run one
worker per replica and scrape each.

Logs: ``--log-level`` sets uvicorn's level and the gateway's (the ``chat_pipeline``
loggers, on stderr): a startup line per worker (configuration, environment, models, how
callers authenticate; a warning without API keys) and one line per request at ``info``
(``warning`` for failures of the service). Lines logged while a request is served carry
its request id.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import logging
import math
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
import uvicorn.config
import uvicorn.logging

from pipeline.config import ENVIRONMENT_VARIABLE, load_config
from pipeline.gateway._exchange import current_request_id, loggable
from pipeline.gateway._protocol import ConnectionLimits, protocol_factory
from pipeline.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry
    from starlette.applications import Starlette

    _Telemetry = tuple[TracerProvider | None, MeterProvider | None, Callable[[], None] | None]

__all__ = [
    "CONFIG_VARIABLE",
    "app_from_environment",
    "log_config",
    "serve",
    "uvicorn_options",
]

CONFIG_VARIABLE = "CHAT_PIPELINE_GATEWAY_CONFIG"
"""The configuration file's path, handed to the worker processes."""
PROMETHEUS_VARIABLE = "CHAT_PIPELINE_GATEWAY_PROMETHEUS"
"""``1`` when ``--prometheus-metrics`` turned ``/metrics`` on, for the worker processes."""
WORKERS_VARIABLE = "CHAT_PIPELINE_GATEWAY_WORKERS"
"""How many worker processes serve, for the worker processes."""

_logger = logging.getLogger("chat_pipeline.gateway")

SERVICE_NAME = "chat-pipeline-gateway"


def _telemetry(prometheus: bool, workers: int) -> tuple[_Telemetry, CollectorRegistry | None]:
    """(tracer provider, meter provider, shutdown) for OTLP export and ``/metrics``, and the
    registry ``/metrics`` serves."""
    otlp = bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    if not otlp and not prometheus:
        return (None, None, None), None
    from pipeline.telemetry import configure

    readers: list[Any] = []
    registry = None
    attributes: dict[str, str] = {}
    if prometheus:
        from opentelemetry.semconv.attributes.service_attributes import SERVICE_INSTANCE_ID

        from pipeline.gateway._endpoints import prometheus_reader

        reader, registry = prometheus_reader(per_instance=workers > 1)
        readers.append(reader)
        if workers > 1:
            attributes[SERVICE_INSTANCE_ID] = f"{socket.gethostname()}-{os.getpid()}"
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    handle = configure(
        None if os.environ.get("OTEL_SERVICE_NAME") else SERVICE_NAME,
        protocol="grpc" if protocol == "grpc" else "http/protobuf",
        set_global=False,
        traces=otlp,
        metrics=otlp,
        metric_readers=readers,
        resource_attributes=attributes,
    )
    return (handle.tracer_provider, handle.meter_provider, handle.shutdown), registry


def uvicorn_options(settings: GatewaySettings | None) -> dict[str, Any]:
    """The uvicorn settings the gateway runs with (`serve` and embedders alike): its
    connection protocol (deadlines, bounds), keep-alive and shutdown."""
    settings = settings or GatewaySettings()
    limits = ConnectionLimits(
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        max_connections=settings.max_connections,
        retry_after=settings.retry_after,
    )
    return {
        "http": protocol_factory(limits),
        "ws": "none",
        # Longer than the clients' own idle expiry: the client, not the gateway, ends an
        # idle connection, so no request is ever sent on one the gateway is closing.
        "timeout_keep_alive": settings.keep_alive_timeout,
        # uvicorn stops accepting, waits this long for requests in flight, then cancels them.
        "timeout_graceful_shutdown": math.ceil(settings.drain_timeout),
        "access_log": False,  # the gateway logs its own line per request, with its id
        "server_header": False,
    }


class _RequestIdFilter(logging.Filter):
    """Adds the request id to the lines the pipeline's layers log while a gateway request
    is served (the gateway's own lines carry it already)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = current_request_id()
        record.request = (
            f" request_id={loggable(request_id)}"
            if request_id is not None and not record.name.startswith(_logger.name)
            else ""
        )
        return True


class _LineFormatter(logging.Formatter):
    """uvicorn's line shape (``INFO:     message``, the level coloured on a terminal) for
    the ``chat_pipeline`` loggers, plus the request id the filter found. uvicorn's own
    formatter copies every record to colour it: one line per request made that a visible
    part of the gateway's CPU per request."""

    def __init__(self, use_colors: bool | None = None) -> None:
        super().__init__("%(message)s")
        self._colors = sys.stderr.isatty() if use_colors is None else use_colors
        self._prefixes: dict[int, str] = {}

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            return super().format(record)
        # A line without a traceback (all the request lines): `Formatter.format`'s steps
        # without its questions of the format string (it holds no time).
        record.message = record.getMessage()
        return self.formatMessage(record)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return f"{self.prefix(record.levelno)} {record.message}{getattr(record, 'request', '')}"

    def prefix(self, level: int) -> str:
        """What a line at `level` starts with: its level's name (coloured on a terminal),
        a colon and the padding to the message's column."""
        prefix = self._prefixes.get(level)
        if prefix is None:
            name = logging.getLevelName(level)
            shown = (
                uvicorn.logging.ColourizedFormatter().color_level_name(name, level)
                if self._colors
                else name
            )
            prefix = self._prefixes[level] = f"{shown}:{' ' * (8 - len(name))}"
        return prefix


class _LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that leaves out the flush after each line when its stream writes
    a line through by itself: line-buffered (stderr is), or unbuffered (stderr under
    ``PYTHONUNBUFFERED``). The flush (a lock and three calls) cost as much as the write."""

    _checked: object = None  # the stream `_through` was found for
    _through = False

    def emit(self, record: logging.LogRecord) -> None:
        stream = self.stream
        if not self._writes_through(stream):
            super().emit(record)
            return
        try:
            stream.write(self.format(record) + self.terminator)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)  # as `StreamHandler.emit` does

    def _writes_through(self, stream: object) -> bool:
        """Whether a line this handler writes to `stream` reaches the file without a flush
        (found once a stream)."""
        if stream is not self._checked:
            self._checked = stream
            self._through = _writes_lines_through(stream) and self.terminator.endswith("\n")
        return self._through

    def write_line(self, level: int, msg: str, args: tuple[Any, ...]) -> bool:
        """Writes the gateway's request line (`msg % args`, at `level`) as `handle` writes
        its record, without making a record or walking logging's handler chain, when
        nothing but this handler's own parts would see the record: its formatter is
        `_LineFormatter`, its only filter `_RequestIdFilter` (which adds nothing to the
        gateway's own lines), its stream writes a line through. False, having formatted and
        written nothing, otherwise: the caller then logs the record as usual. Logging's
        chain (a record of 20-odd fields, the filters, the formatter's steps) cost more than
        half of the request line."""
        if level < self.level or type(self.formatter) is not _LineFormatter:
            return False
        for found in self.filters:
            if type(found) is not _RequestIdFilter:
                return False
        stream = self.stream
        if not self._writes_through(stream):
            return False
        message = msg % args
        line = self.formatter.prefix(level) + " " + message + self.terminator
        with self.lock:  # type: ignore[union-attr]  # made by `Handler.__init__`
            try:
                stream.write(line)
            except RecursionError:
                raise
            except Exception:
                self.handleError(
                    logging.makeLogRecord(
                        {"name": _logger.name, "levelno": level, "msg": msg, "args": args}
                    )
                )
        return True


def _writes_lines_through(stream: object) -> bool:
    """Whether a line written to `stream` (its end included) reaches the file without a
    flush."""
    if getattr(stream, "line_buffering", False) is True:
        return True  # a text stream that flushes at every line's end
    # A text stream writing straight to the file, with no buffer between.
    return getattr(stream, "write_through", False) is True and isinstance(
        getattr(stream, "buffer", None), io.RawIOBase
    )


def log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging configuration, with the ``chat_pipeline`` loggers (the gateway's
    and the pipeline's layers') on stderr at `log_level`."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["filters"] = {"request_id": {"()": _RequestIdFilter}}
    config["formatters"]["chat_pipeline"] = {"()": _LineFormatter}
    config["handlers"]["chat_pipeline"] = {
        "formatter": "chat_pipeline",
        "()": _LineHandler,
        "stream": "ext://sys.stderr",
        "filters": ["request_id"],
    }
    config["loggers"]["chat_pipeline"] = {
        "handlers": ["chat_pipeline"],
        "level": log_level.upper(),
        "propagate": False,
    }
    return config


def app_from_environment() -> Starlette:
    """The app of one worker process, from the file named by ``CHAT_PIPELINE_GATEWAY_CONFIG``
    (and the environment overlay named by ``CHAT_PIPELINE_ENV``)."""
    from pipeline.gateway.app import create_app

    path = os.environ.get(CONFIG_VARIABLE)
    if not path:
        raise RuntimeError(f"{CONFIG_VARIABLE} names no configuration file")
    config = load_config(path)
    if os.environ.get(PROMETHEUS_VARIABLE) == "1":
        settings = (config.gateway or GatewaySettings()).model_copy(
            update={"prometheus_metrics": True}
        )
        config = dataclasses.replace(config, gateway=settings)
    settings = config.gateway or GatewaySettings()
    workers = int(os.environ.get(WORKERS_VARIABLE, "1"))
    (tracer_provider, meter_provider, shutdown), registry = _telemetry(
        settings.prometheus_metrics, workers
    )
    return create_app(
        config,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        on_shutdown=shutdown,
        prometheus_registry=registry,
        prometheus_close=workers > 1,
        source=path,
    )


def _raise_file_limit(connections: int) -> None:
    """Let the process open a file per connection and some more (upstream connections,
    Redis, logs): raise the soft limit on open files towards the hard one."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return
    needed = connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        if wanted < needed:
            _logger.warning(
                "the open-file limit (%d) is below max_connections + 256: connections past "
                "it are refused by the system",
                wanted,
            )


def serve(
    config_path: str | os.PathLike[str],
    environment: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    workers: int = 1,
    log_level: str = "info",
    prometheus_metrics: bool = False,
) -> None:
    """Serve the pipeline `config_path` describes until SIGTERM/SIGINT (see the module
    docstring). Raises `ConfigError` for a wrong file before anything listens.
    `prometheus_metrics` serves ``GET /metrics`` whatever ``[gateway]`` says."""
    from pipeline.gateway.app import Gateway

    if workers < 1:
        raise ValueError("workers must be at least 1")
    config = load_config(config_path, environment)
    Gateway(config)  # refuses what a gateway cannot serve, before any worker starts
    settings = config.gateway or GatewaySettings()
    if prometheus_metrics or settings.prometheus_metrics:
        from pipeline.gateway._endpoints import prometheus_reader

        prometheus_reader()  # the exporter is installed, before any worker starts
    os.environ[CONFIG_VARIABLE] = str(Path(config_path).resolve())
    os.environ[WORKERS_VARIABLE] = str(workers)
    if prometheus_metrics:
        os.environ[PROMETHEUS_VARIABLE] = "1"
    if environment is not None:
        os.environ[ENVIRONMENT_VARIABLE] = environment
    _raise_file_limit(settings.max_connections)
    if workers > 1 and settings.responses_store == "memory":
        _logger.warning(
            "responses_store = 'memory' keeps each worker's stored responses apart: a "
            "continuation (previous_response_id, item_reference) served by another of the %d "
            "workers finds nothing; set [gateway] responses_store = 'redis'",
            workers,
        )
    server_config = uvicorn.Config(
        "pipeline.gateway.server:app_from_environment",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        log_config=log_config(log_level),
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
    keep-alive client waits for a delayed ACK (about 40 ms) between writes.

    It listens from the start: uvicorn runs the app's startup (building the pipeline)
    before it listens, so a client connecting in between (as soon as the startup is
    logged) would be refused; now it waits in the backlog and is served."""
    sock = config.bind_socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(config.backlog)
    return sock
