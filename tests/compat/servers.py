"""The real third-party servers of the compatibility suite: what they serve, and how they
are started and stopped on 127.0.0.1.

Each server is a `tests.processes.ChildProcess` in a process group of its own (stopped
together with any worker it forks), started on port 0: it is ready once uvicorn logs the
port it got, after the application's startup. A crash or a missed deadline fails at once
with the end of its output.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pipeline.testing import CHAT_PATH, FakeOpenAIServer, FakeResponse, RecordedRequest
from tests.processes import UVICORN_PORT, ChildProcess

T = TypeVar("T")


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


@contextlib.contextmanager
def server_process(
    name: str, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float
) -> Iterator[str]:
    """Run `argv` (a uvicorn server told to listen on port 0) until the block ends; yields
    its base URL once uvicorn reports the port it got, within `timeout` seconds."""
    with ChildProcess(name, argv, env=env, cwd=cwd, own_group=True) as server:
        port = server.wait_for_port(UVICORN_PORT, timeout)
        yield f"http://127.0.0.1:{port}"


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
