"""Real observability backends on 127.0.0.1, started and stopped by the tests.

Each server is a child process whose log is read line by line: readiness is its own log
line, never a guessed sleep. A server that cannot be found or started raises with its last
log lines, so the suite fails loudly instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A child process whose merged stdout/stderr is kept (and always drained)."""

    def __init__(self, name: str, argv: list[str], *, env: Mapping[str, str] | None = None):
        self.name = name
        self.lines: list[str] = []
        self._wanted: tuple[str, int] | None = None
        self._seen = threading.Event()
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=dict(env) if env is not None else None,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            wanted = self._wanted
            if wanted is not None and self._count(wanted[0]) >= wanted[1]:
                self._seen.set()
        self._seen.set()  # the process ended: wake any waiter, which then reports it

    def _count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def wait_for_line(self, text: str, timeout: float, count: int = 1) -> None:
        """Return once `count` log lines contain `text`; raise if the process dies or time
        runs out."""
        self._seen.clear()
        self._wanted = (text, count)
        if self._count(text) >= count:
            return
        self._seen.wait(timeout)
        if self._count(text) < count:
            state = (
                f"exited with {self.process.returncode}"
                if self.process.poll() is not None
                else f"no {text!r} within {timeout:.0f} s"
            )
            raise RuntimeError(f"{self.name} did not start ({state}):\n{self.log_tail()}")

    def log_tail(self, count: int = 40) -> str:
        return "".join(self.lines[-count:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._reader.join(timeout=10)


def serve_argv(config: Path, port: int, *args: str) -> list[str]:
    """The command line of ``chat-pipeline serve`` for `config` on 127.0.0.1:`port`."""
    return [
        sys.executable,
        "-m",
        "pipeline",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        *args,
    ]


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

    def __init__(self, url: str, server: ServerProcess):
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
    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError(
            "the prometheus binary is not installed (.ci/run installs Debian's 'prometheus')"
        )
    port = free_port()
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
    server = ServerProcess(
        "prometheus",
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
    )
    try:
        server.wait_for_line("ready to receive web requests", timeout)
        yield Prometheus(f"http://127.0.0.1:{port}", server)
    finally:
        server.stop()


# -- Arize Phoenix ---------------------------------------------------------------------------


class Phoenix:
    """A Phoenix server: OTLP/HTTP on `url` + /v1/traces, REST API under `url` + /v1."""

    def __init__(self, url: str, workdir: Path, server: ServerProcess):
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
    .ci/run installs it: its pins, such as anthropic<2, clash with the test extra), else
    from this one."""
    for binary in (PHOENIX_VENV / "bin" / "phoenix", Path(sys.executable).with_name("phoenix")):
        if binary.exists():
            return binary
    raise FileNotFoundError(
        "Arize Phoenix is not installed: python3 -m venv .servers/phoenix && "
        ".servers/phoenix/bin/pip install arize-phoenix (as .ci/run does)"
    )


@contextmanager
def running_phoenix(workdir: Path, timeout: float = 180.0) -> Iterator[Phoenix]:
    binary = phoenix_binary()
    port, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "PHOENIX_TELEMETRY_ENABLED": "false",
        # No public-internet requests of its own (fonts, sandbox downloads): loopback only.
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
        "PHOENIX_WORKING_DIR": str(workdir),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
    }
    server = ServerProcess("phoenix", [str(binary), "serve"], env=env)
    try:
        server.wait_for_line("Application startup complete", timeout)
        yield Phoenix(f"http://127.0.0.1:{port}", workdir, server)
    finally:
        server.stop()
