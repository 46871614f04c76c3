"""The real third-party servers of the compatibility suite: what they serve, and how they
are started and stopped on 127.0.0.1.

Each server runs as a child process of the test session, on a free loopback port, with its
output in a log file (never a pipe that could fill and stall it). Readiness is polled on
the server's own HTTP endpoint with a bounded deadline, and the process is checked on every
poll so a crash fails at once with the end of its log. Stopping terminates the process and
kills it if it does not exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from pipeline.testing import CHAT_PATH, FakeOpenAIServer, FakeResponse, RecordedRequest

T = TypeVar("T")

INSTALL_HINT = (
    "install the compatibility suite's servers with: .venv/bin/pip install -e '.[compat]' "
    "(.ci/run does this), or deselect the suite with: pytest -m 'not compat'"
)


# Mock models of the LiteLLM proxy. The strings LiteLLM's mock_response turns into errors
# are its own: "litellm.RateLimitError" (429), "litellm.InternalServerError" (500),
# "litellm.ContextWindowExceededError" (400), "Exception: content_filter_policy" (400) and
# "Exception: mock_streaming_error" (529).
MOCK_TEXT = "Hello from LiteLLM."
MOCK_MODELS: dict[str, dict[str, object]] = {
    "mock-text": {"mock_response": MOCK_TEXT},
    "mock-tools": {
        "mock_response": "",
        "mock_tool_calls": [
            {
                "id": "call_mock_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    "mock-429": {"mock_response": "litellm.RateLimitError"},
    "mock-500": {"mock_response": "litellm.InternalServerError"},
    "mock-context-window": {"mock_response": "litellm.ContextWindowExceededError"},
    "mock-content-filter": {"mock_response": "Exception: content_filter_policy"},
    "mock-529": {"mock_response": "Exception: mock_streaming_error"},
}
UPSTREAM_MODEL = "upstream"


@dataclass(frozen=True)
class Proxy:
    base_url: str
    api_key: str


@dataclass(frozen=True)
class LlamaServer:
    base_url: str
    model: str


def require_module(module: str, what: str) -> None:
    """Fail the test session loudly (never skip) when a server's package is missing.

    `module` is a top-level name: finding a submodule would import its package here, and
    importing litellm in the test process starts its network fetches.
    """
    if importlib.util.find_spec(module) is None:
        pytest.fail(
            f"COMPAT SUITE CANNOT RUN: {what} is not installed (no module {module!r}); "
            + INSTALL_HINT,
            pytrace=False,
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def server_process(
    name: str,
    argv: Sequence[str],
    *,
    ready_url: str,
    log_path: Path,
    cwd: Path,
    env: Mapping[str, str],
    timeout: float,
    headers: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `argv` until the block ends; ready once `ready_url` answers 200 within `timeout`."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=dict(env),
            start_new_session=True,  # its own process group: stopped together with its workers
        )
    try:
        _wait_ready(name, process, ready_url, log_path, timeout, headers or {})
        yield process
    finally:
        _stop(process)


def _wait_ready(
    name: str,
    process: subprocess.Popen[bytes],
    url: str,
    log_path: Path,
    timeout: float,
    headers: Mapping[str, str],
) -> None:
    # Polling is bounded by `timeout` and ends early if the process dies.
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"COMPAT SUITE CANNOT RUN: {name} exited with status {process.returncode} "
                f"before it was ready. Its log ends with:\n{_tail(log_path)}",
                pytrace=False,
            )
        request = urllib.request.Request(url, headers=dict(headers))
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
                last_error = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            last_error = str(exc)
        time.sleep(0.25)
    pytest.fail(
        f"COMPAT SUITE CANNOT RUN: {name} was not ready within {timeout:g} s "
        f"({url}: {last_error}). Its log ends with:\n{_tail(log_path)}",
        pytrace=False,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=15)


def python_module_argv(module: str, *args: str) -> list[str]:
    """Run `module` with this interpreter, so the servers come from the same environment."""
    return [sys.executable, "-m", module, *args]


class ThreadedFakeServer:
    """A `FakeOpenAIServer` on its own event loop in a thread, for a whole test session.

    Other processes (the LiteLLM proxy) keep connections to it across tests, so it cannot
    live on a test's event loop. Every access goes through its loop (`_call`), so a test
    never touches its state from another thread.
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="compat-fake-upstream", daemon=True
        )
        self._server = FakeOpenAIServer()

    def start(self) -> None:
        self._thread.start()
        self._run(self._server.start())

    def stop(self) -> None:
        try:
            self._run(self._server.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def _run(self, coroutine: Awaitable[T]) -> T:
        async def run() -> T:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def _call(self, function: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            try:
                future.set_result(function())
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(call)
        return future.result(timeout=30)

    @property
    def base_url(self) -> str:
        return self._call(lambda: self._server.base_url)

    def reset(self) -> None:
        """Forget recorded requests and any script left by the previous test."""

        def reset() -> None:
            self._server.requests.clear()
            self._server._scripts.clear()  # the fake has no public reset

        self._call(reset)

    def script(self, *responses: FakeResponse) -> None:
        self._call(lambda: self._server.script(*responses))

    def count(self, path: str = CHAT_PATH) -> int:
        return self._call(lambda: self._server.count(path))

    def requests(self) -> list[RecordedRequest]:
        return self._call(lambda: list(self._server.requests))
