"""`chat-pipeline serve` as a real process: workers, signals, draining, OTLP export."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider

from pipeline.cli import main
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.otel import Receiver
from tests.processes import UVICORN_PORT, ChildProcess, StartError

pytestmark = pytest.mark.gateway

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
SERVER_SPAN_KIND = 2  # SPAN_KIND_SERVER in OTLP


class Serving:
    def __init__(self, server: ChildProcess, port: int) -> None:
        self.server = server
        self.process = server.process
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.server.output()

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    async def terminate(self, within: float = 60) -> bool:
        """SIGTERM; whether the server then stopped by itself (waited for off the event
        loop, which keeps serving the fake upstreams meanwhile). uvicorn re-raises the
        signal once it has shut down, so a clean stop is 0 or "ended by SIGTERM"."""
        self.process.send_signal(signal.SIGTERM)
        status = await asyncio.to_thread(self.process.wait, within)
        return status in (0, -signal.SIGTERM)

    def workers(self) -> list[int]:
        """The worker processes (children other than multiprocessing's resource tracker)."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        pids = [int(pid) for pid in path.read_text().split()]
        return [
            pid
            for pid in pids
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]


@contextlib.contextmanager
def serving(
    config: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 90
) -> Iterator[Serving]:
    """``chat-pipeline serve`` on port 0 until the block ends; ready once every worker
    logged uvicorn's startup line (after the pipeline was built); a process that exits
    fails at once."""
    workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
    argv = [sys.executable, "-m", "pipeline", "serve", "--config", str(config), "--port", "0"]
    env = {**os.environ, **(env or {})}
    # A group of its own: stopping it after a failed test stops its workers too.
    with ChildProcess("chat-pipeline serve", [*argv, *args], env=env, own_group=True) as server:
        try:
            # The port is logged once bound, before the workers start.
            port = server.wait_for_port(UVICORN_PORT, timeout)
            server.wait_for_line("Application startup complete", timeout, count=workers)
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield Serving(server, port)


def write_config(path: Path, upstream: FakeOpenAIServer, extra: str = "") -> Path:
    path.write_text(
        f"""
[routes.primary]
provider = "openai"
model = "model-primary"
base_url = "{upstream.base_url}"
{extra}
"""
    )
    return path


async def test_workers_serve_and_stop_cleanly(tmp_path: Path, streaming: bool) -> None:
    async with FakeOpenAIServer() as upstream:
        config = write_config(tmp_path / "gateway.toml", upstream)
        with serving(config, "--workers", "2") as server:
            assert len(server.workers()) == 2  # one pipeline per worker process
            async with server.client() as client:
                for _ in range(4):
                    if streaming:
                        stream = await client.chat.completions.create(
                            model="pipeline", messages=MESSAGES, stream=True
                        )
                        text = "".join(
                            [c.choices[0].delta.content or "" async for c in stream if c.choices]
                        )
                    else:
                        response = await client.chat.completions.create(
                            model="pipeline", messages=MESSAGES
                        )
                        text = response.choices[0].message.content or ""
                    assert text == "Hello from the fake server."
            assert await server.terminate()
        assert upstream.count() == 4


async def test_sigterm_drains_then_cancels_streams_in_flight(tmp_path: Path) -> None:
    async with FakeOpenAIServer() as upstream:
        config = write_config(
            tmp_path / "gateway.toml", upstream, "\n[gateway]\ndrain_timeout = 1\n"
        )
        upstream.script(FakeResponse(chunks=["Hello ", "world"], hang_after=2))
        with serving(config) as server:
            async with server.client() as client:
                stream = await client.chat.completions.create(
                    model="pipeline", messages=MESSAGES, stream=True
                )
                received = ""
                stopping: asyncio.Future[bool] | None = None
                with pytest.raises(openai.APIError) as raised:
                    async for chunk in stream:
                        received += chunk.choices[0].delta.content or "" if chunk.choices else ""
                        if received and stopping is None:
                            stopping = asyncio.ensure_future(server.terminate())
                assert received == "Hello "
                assert raised.value.code == "shutting_down"
                await upstream.wait_for_disconnects(1)
                assert stopping is not None and await stopping
        log = server.log()
        assert "Waiting for connections to close" in log or "Cancel 1 running task" in log


async def test_the_callers_trace_reaches_the_collector(tmp_path: Path, receiver: Receiver) -> None:
    async with FakeOpenAIServer() as upstream:
        config = write_config(tmp_path / "gateway.toml", upstream, "\n[layers]\ntelemetry = true\n")
        caller = TracerProvider().get_tracer("caller")
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "gw-test"}
        with serving(config, env=env) as server:
            async with server.client() as client:
                with caller.start_as_current_span("caller") as span:
                    headers: dict[str, str] = {}
                    propagate.inject(headers)
                    await client.chat.completions.create(
                        model="pipeline", messages=MESSAGES, extra_headers=headers
                    )
            assert await server.terminate()  # exporting is flushed at shutdown
    context = span.get_span_context()
    spans: list[Any] = receiver.spans()
    trace_id = context.trace_id.to_bytes(16, "big")
    assert spans and {s.trace_id for s in spans} == {trace_id}
    server_span = next(s for s in spans if s.kind == SERVER_SPAN_KIND)
    assert server_span.name == "POST /v1/chat/completions"
    assert server_span.parent_span_id == context.span_id.to_bytes(8, "big")
    chat = next(s for s in spans if s.name.startswith("chat "))
    assert chat.parent_span_id == server_span.span_id
    services = {
        attribute.value.string_value
        for request in receiver.requests
        for resource in request.resource_spans
        for attribute in resource.resource.attributes
        if attribute.key == "service.name"
    }
    assert services == {"gw-test"}


def test_a_bad_configuration_is_refused_before_listening(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[routes.a]\nprovider = "scripted"\n[gateway]\nmax_body_byte = 1\n')
    assert main(["serve", "--config", str(config), "--port", "1"]) == 2
    assert "gateway.max_body_byte: unknown setting" in capsys.readouterr().err
    config.write_text('[routes.a]\nprovider = "scripted"\n[layers]\nfunction_invocation = true\n')
    assert main(["serve", "--config", str(config), "--port", "1"]) == 2
    assert "a gateway runs no code tools" in capsys.readouterr().err
