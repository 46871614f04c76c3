"""Real observability backends on 127.0.0.1, started and stopped by the tests.

Each server is a `tests.processes.ChildProcess` that binds port 0 and reports the port it
got; readiness is its own log line, never a guessed sleep. A server that cannot be found
or started fails with its last log lines, so the suite fails loudly instead of skipping.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from tests.processes import UVICORN_PORT, ChildProcess, StartError, free_port, require_binary

T = TypeVar("T")

# Prometheus logs the address it listens on, with the port it got for port 0.
PROMETHEUS_PORT = re.compile(r'msg="Listening on" address=\S+:(\d+)')


def poll(probe: Callable[[], T | None], *, timeout: float, interval: float, what: str) -> T:
    """Call `probe` until it returns something other than None, every `interval` s for at
    most `timeout` s; then an `AssertionError` naming `what` and how often it was asked. A
    probe that raises (a query to a server that died) fails at once.

    Never for a server's start (that is its own log line: `ChildProcess.wait_for_line`).
    Only for what a started third-party server does later, on its own schedule, and tells
    no one (no line in its output, nothing in its API to wait on): Prometheus storing a
    scrape (every second), Jaeger storing what the collector's exporter queue sends a
    moment after it took it, Phoenix's bulk inserter writing spans after it acknowledged
    their export. Asking again is the only way to see those; the deadline bounds it."""
    deadline = time.monotonic() + timeout
    asked = 0
    while True:
        asked += 1
        found = probe()
        if found is not None:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what} (asked {asked} times)"
            )
        time.sleep(min(interval, left))


# -- Prometheus ------------------------------------------------------------------------------


class Prometheus:
    """A Prometheus server scraping `targets` every second, with an HTTP query API."""

    def __init__(self, url: str, server: ChildProcess):
        self.url = url
        self.server = server

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The result vector of an instant query (raises on a query error)."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"query {promql!r} failed: {response.status_code} {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


@contextmanager
def running_prometheus(
    targets: list[str], workdir: Path, timeout: float = 60.0
) -> Iterator[Prometheus]:
    binary = require_binary("prometheus", marker="e2e")
    config = workdir / "prometheus.yml"
    target_list = ", ".join(f'"{t}"' for t in targets)
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        "  - job_name: chat-pipeline\n"
        "    static_configs:\n"
        f"      - targets: [{target_list}]\n"
    )
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        "--web.listen-address=127.0.0.1:0",
    ]
    with ChildProcess("prometheus", argv) as server:
        port = server.wait_for_port(PROMETHEUS_PORT, timeout)
        server.wait_for_line("ready to receive web requests", timeout)
        yield Prometheus(f"http://127.0.0.1:{port}", server)


# -- Arize Phoenix ---------------------------------------------------------------------------


class Phoenix:
    """A Phoenix server: OTLP/HTTP on `url` + /v1/traces, REST API under `url` + /v1."""

    def __init__(self, url: str, workdir: Path, server: ChildProcess):
        self.url = url
        self.workdir = workdir
        self.server = server

    def spans(self, project: str = "default") -> list[dict[str, Any]]:
        """Every span of `project`, through the REST API (following its cursor)."""
        spans: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(100):  # bounded: 100 pages of 1000 spans
            params: dict[str, Any] = {"limit": 1000}
            if cursor:
                params["cursor"] = cursor
            response = httpx.get(
                f"{self.url}/v1/projects/{project}/spans", params=params, timeout=10
            )
            response.raise_for_status()
            body = response.json()
            spans.extend(body["data"])
            cursor = body.get("next_cursor")
            if not cursor:
                return spans
        raise AssertionError("more than 100 pages of spans")

    def stored_bytes(self) -> bytes:
        """Everything Phoenix wrote to its working directory (database, WAL, ...)."""
        return b"".join(
            path.read_bytes() for path in sorted(self.workdir.rglob("*")) if path.is_file()
        )


PHOENIX_VENV = Path(__file__).resolve().parents[2] / ".servers" / "phoenix"


def phoenix_binary() -> Path:
    """Phoenix's ``phoenix`` command: from its own environment (``.servers/phoenix``, where
    ./scripts/test installs it: its pins, such as anthropic<2, clash with the test extra),
    else from this one."""
    for binary in (PHOENIX_VENV / "bin" / "phoenix", Path(sys.executable).with_name("phoenix")):
        if binary.exists():
            return binary
    raise FileNotFoundError(
        "Arize Phoenix is not installed: run ./scripts/test, which installs it in "
        ".servers/phoenix (python3 -m venv .servers/phoenix && .servers/phoenix/bin/pip "
        "install arize-phoenix)"
    )


@contextmanager
def running_phoenix(workdir: Path, timeout: float = 180.0) -> Iterator[Phoenix]:
    binary = phoenix_binary()
    env = {
        **os.environ,
        "PHOENIX_TELEMETRY_ENABLED": "false",
        # No public-internet requests of its own (fonts, sandbox downloads): loopback only.
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
        "PHOENIX_WORKING_DIR": str(workdir),
        "PHOENIX_HOST": "127.0.0.1",
        # Port 0 for both: uvicorn logs the HTTP port it got (OTLP/HTTP and the REST API
        # are served there); the gRPC port is not used here.
        "PHOENIX_PORT": "0",
        "PHOENIX_GRPC_PORT": "0",
    }
    with ChildProcess("phoenix", [str(binary), "serve"], env=env) as server:
        port = server.wait_for_port(UVICORN_PORT, timeout)  # logged after its startup
        yield Phoenix(f"http://127.0.0.1:{port}", workdir, server)


# -- Jaeger and the OpenTelemetry Collector ------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
OTEL_BIN = ROOT / ".servers" / "otel" / "bin"
SHIPPED_COLLECTOR_CONFIG = ROOT / "otel-collector.yaml"
# What every collector build (Jaeger 2 is one) logs once its pipelines run.
COLLECTOR_READY = "Everything is ready. Begin running and processing data."
# What a Go program logs when a port it was given is taken; it then exits.
PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)
START_ATTEMPTS = 3  # fresh ports each time another process took one in between


def otel_binary(name: str) -> Path:
    """``.servers/otel/bin/<name>`` (``jaeger`` or ``otelcol``), which ``scripts/build-otel``
    (run by ./scripts/test) builds from the Go module proxy; fails the test, never skips,
    when it is missing."""
    binary = OTEL_BIN / name
    if not binary.exists():
        import pytest

        pytest.fail(
            f"{binary.relative_to(ROOT)} is missing: run ./scripts/build-otel (./scripts/test "
            "runs it), which builds Jaeger and the collector with Go from the module proxy; "
            "or deselect these tests with -m 'not e2e'",
            pytrace=False,
        )
    return binary


def _collector_process(
    name: str, binary: Path, config: Path, timeout: float
) -> ChildProcess | None:
    """A collector build running `config`, once it is ready; None when a port it was given
    was taken meanwhile (the caller tries again with new ones)."""
    server = ChildProcess(name, [str(binary), f"--config={config}"])
    try:
        server.wait_for_line(COLLECTOR_READY, timeout)
    except StartError:
        server.stop()
        if PORT_TAKEN.search(server.output()):
            return None
        raise
    return server


def _started(
    name: str, binary: Path, write_config: Callable[[], Path], timeout: float
) -> ChildProcess:
    for _ in range(START_ATTEMPTS):
        server = _collector_process(name, binary, write_config(), timeout)
        if server is not None:
            return server
    raise StartError(f"{name}: its ports were taken {START_ATTEMPTS} times in a row")


class Jaeger:
    """Jaeger 2 (memory storage): OTLP/gRPC in on `otlp_endpoint`, the query API the UI
    reads (``/api/traces``, ``/api/services``) on `url`."""

    def __init__(self, url: str, otlp_endpoint: str, server: ChildProcess):
        self.url = url
        self.otlp_endpoint = otlp_endpoint
        self.server = server

    def services(self) -> list[str]:
        response = httpx.get(f"{self.url}/api/services", timeout=10)
        response.raise_for_status()
        return list(response.json()["data"] or [])

    def traces(
        self, service: str, *, tags: Mapping[str, str] | None = None, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Every trace of `service` in the last hour (with a span carrying `tags`, when
        given), as the UI's search gets them."""
        params: dict[str, Any] = {"service": service, "limit": limit, "lookback": "1h"}
        if tags:
            params["tags"] = json.dumps(dict(tags))
        response = httpx.get(f"{self.url}/api/traces", params=params, timeout=30)
        response.raise_for_status()
        return list(response.json()["data"] or [])


@contextmanager
def running_jaeger(workdir: Path, timeout: float = 60.0) -> Iterator[Jaeger]:
    """Jaeger 2 with memory storage, every port on 127.0.0.1: OTLP/gRPC in, the query API
    (HTTP and gRPC) out, its own metrics off."""
    binary = otel_binary("jaeger")
    ports: dict[str, int] = {}

    def write_config() -> Path:
        ports.update(otlp=free_port(), http=free_port(), grpc=free_port())
        config = workdir / "jaeger.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "service": {
                        "extensions": ["jaeger_storage", "jaeger_query"],
                        "pipelines": {
                            "traces": {
                                "receivers": ["otlp"],
                                "exporters": ["jaeger_storage_exporter"],
                            }
                        },
                        "telemetry": {"metrics": {"level": "none"}},
                    },
                    "extensions": {
                        "jaeger_storage": {
                            "backends": {"memstore": {"memory": {"max_traces": 100000}}}
                        },
                        "jaeger_query": {
                            "storage": {"traces": "memstore"},
                            "http": {"endpoint": f"127.0.0.1:{ports['http']}"},
                            "grpc": {"endpoint": f"127.0.0.1:{ports['grpc']}"},
                        },
                    },
                    "receivers": {
                        "otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{ports['otlp']}"}}}
                    },
                    "exporters": {"jaeger_storage_exporter": {"trace_storage": "memstore"}},
                }
            )
        )
        return config

    with _started("jaeger", binary, write_config, timeout) as server:
        yield Jaeger(f"http://127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['otlp']}", server)


class Collector:
    """The collector on a copy of the shipped ``otel-collector.yaml`` (`collector_config`):
    OTLP in on `grpc_endpoint` and `http_url`, its Prometheus exporter on
    `prometheus_target`."""

    def __init__(
        self,
        *,
        grpc_endpoint: str,
        http_url: str,
        prometheus_target: str,
        config: dict[str, Any],
        server: ChildProcess,
    ):
        self.grpc_endpoint = grpc_endpoint
        self.http_url = http_url
        self.prometheus_target = prometheus_target
        self.config = config
        self.server = server


def collector_config(
    shipped: dict[str, Any], ports: Mapping[str, int], jaeger: str
) -> dict[str, Any]:
    """The shipped collector config with only its endpoints moved onto 127.0.0.1:`ports`
    (``grpc``, ``http``, ``prometheus``, ``telemetry``: the collector's own metrics, on
    localhost:8888 by default) and its Jaeger exporter onto `jaeger`; the Tempo exporter
    is dropped (no Tempo runs here). Everything else, the processors first, is the same."""
    config = copy.deepcopy(shipped)
    protocols = config["receivers"]["otlp"]["protocols"]
    protocols["grpc"]["endpoint"] = f"127.0.0.1:{ports['grpc']}"
    protocols["http"]["endpoint"] = f"127.0.0.1:{ports['http']}"
    config["exporters"]["prometheus"]["endpoint"] = f"127.0.0.1:{ports['prometheus']}"
    config["exporters"]["otlp_grpc/jaeger"]["endpoint"] = jaeger
    del config["exporters"]["otlp_grpc/tempo"]
    traces = config["service"]["pipelines"]["traces"]
    traces["exporters"] = [e for e in traces["exporters"] if e != "otlp_grpc/tempo"]
    reader = {
        "pull": {"exporter": {"prometheus": {"host": "127.0.0.1", "port": ports["telemetry"]}}}
    }
    config["service"].setdefault("telemetry", {}).setdefault("metrics", {})["readers"] = [reader]
    return config


@contextmanager
def running_collector(jaeger: Jaeger, workdir: Path, timeout: float = 60.0) -> Iterator[Collector]:
    """The collector built by ``scripts/build-otel`` on `collector_config` of the shipped
    file, exporting traces to `jaeger`."""
    binary = otel_binary("otelcol")
    shipped = yaml.safe_load(SHIPPED_COLLECTOR_CONFIG.read_text())
    ports: dict[str, int] = {}
    config: dict[str, Any] = {}

    def write_config() -> Path:
        ports.update({name: free_port() for name in ("grpc", "http", "prometheus", "telemetry")})
        config.clear()
        config.update(collector_config(shipped, ports, jaeger.otlp_endpoint))
        path = workdir / "otel-collector.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    with _started("otelcol", binary, write_config, timeout) as server:
        yield Collector(
            grpc_endpoint=f"127.0.0.1:{ports['grpc']}",
            http_url=f"http://127.0.0.1:{ports['http']}",
            prometheus_target=f"127.0.0.1:{ports['prometheus']}",
            config=config,
            server=server,
        )
