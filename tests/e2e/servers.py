"""Real observability backends on 127.0.0.1, started and stopped by the tests.

Each server is a `tests.processes.ChildProcess` that binds port 0 and reports the port it
got; readiness is its own log line, never a guessed sleep. A server that cannot be found
or started fails with its last log lines, so the suite fails loudly instead of skipping.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests.processes import UVICORN_PORT, ChildProcess, require_binary

T = TypeVar("T")

# Prometheus logs the address it listens on, with the port it got for port 0.
PROMETHEUS_PORT = re.compile(r'msg="Listening on" address=\S+:(\d+)')


def poll(probe: Callable[[], T | None], *, timeout: float, interval: float, what: str) -> T:
    """Call `probe` until it returns something other than None, for at most `timeout` s.

    Only for the state of an external process (a scrape, an asynchronous ingest), which
    announces nothing we could wait on; the deadline bounds the loop."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


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
