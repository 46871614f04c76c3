"""`chat-pipeline serve` as a real process: workers, signals, draining, OTLP export."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider

from pipeline.cli import main
from pipeline.gateway._exchange import enter_request_id, exit_request_id
from pipeline.gateway.server import _LineFormatter, _RequestIdFilter, log_config
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.otel import Receiver
from tests.processes import UVICORN_PORT, ChildProcess, StartError, serve_argv

pytestmark = pytest.mark.gateway

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
SERVER_SPAN_KIND = 2  # SPAN_KIND_SERVER in OTLP


class Serving:
    def __init__(self, server: ChildProcess, port: int) -> None:
        self.server = server
        self.process = server.process
        self.port = port
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
    config: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 90,
    ready: str = "Application startup complete",
) -> Iterator[Serving]:
    """``chat-pipeline serve`` on port 0 until the block ends; ready once every worker
    logged `ready` (uvicorn's startup line, after the pipeline was built); a process that
    exits fails at once. Its port is the one it logged once bound (before the workers
    start), or, at a log level that leaves that line out, the one it listens on."""
    workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
    env = {**os.environ, **(env or {})}
    argv = serve_argv(config, *args)
    # A group of its own: stopping it after a failed test stops its workers too.
    with ChildProcess("chat-pipeline serve", argv, env=env, own_group=True) as server:
        try:
            server.wait_for_line(ready, timeout, count=workers)
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        logged = UVICORN_PORT.search(server.output())
        yield Serving(server, int(logged.group(1)) if logged else listening_port(server.pid))


def listening_port(pid: int) -> int:
    """The TCP port process `pid` listens on, from /proc (its listening socket's inode)."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        # local address (hex ip:port), state 0A = LISTEN, inode
        if fields[3] == "0A" and fields[9] in sockets:
            return int(fields[1].rsplit(":", 1)[1], 16)
    raise AssertionError(f"process {pid} listens on no TCP port")


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


# -- what an operator sees: logs, /metrics -----------------------------------------------------


async def test_log_level_governs_the_gateways_own_lines(tmp_path: Path) -> None:
    async with FakeOpenAIServer() as upstream:
        config = write_config(
            tmp_path / "gateway.toml",
            upstream,
            '\n[layers]\nlogging = true\n[gateway]\napi_keys_env = "GATEWAY_TEST_KEYS"\n',
        )
        env = {"GATEWAY_TEST_KEYS": "key-1"}
        with serving(config, "--log-level", "info", env=env) as server:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="key-1", max_retries=0)
            answer = await client.chat.completions.with_raw_response.create(
                model="pipeline", messages=MESSAGES
            )
            with pytest.raises(openai.BadRequestError) as invalid:
                await client.chat.completions.create(model="pipeline", messages=[])
            upstream.script(FakeResponse.error(503))
            with pytest.raises(openai.InternalServerError) as failed:
                await client.chat.completions.create(model="pipeline", messages=MESSAGES)
            await client.close()
            async with server.client() as wrong_key:
                with pytest.raises(openai.AuthenticationError) as refused:
                    await wrong_key.chat.completions.create(model="pipeline", messages=MESSAGES)
            assert await server.terminate()
        log = server.log()
        keyless = write_config(tmp_path / "keyless.toml", upstream)
        # At warning uvicorn says nothing at startup; the gateway warns (its lifespan ran).
        with serving(keyless, "--log-level", "warning", ready="no API keys configured") as quiet:
            async with quiet.client() as client:
                await client.chat.completions.create(model="pipeline", messages=MESSAGES)
            assert await quiet.terminate()
        quiet_log = quiet.log()
    started = next(line for line in log.splitlines() if "serving" in line)
    assert str(config) in started and "models pipeline, primary" in started
    assert "1 API key(s) from GATEWAY_TEST_KEYS" in started
    for request_id, status in [
        (answer.headers["x-request-id"], 200),
        (invalid.value.request_id, 400),
        (failed.value.request_id, 503),
        (refused.value.request_id, 401),
    ]:
        (line,) = [
            line
            for line in log.splitlines()
            if f"request_id={request_id}" in line and "POST /v1/chat/completions" in line
        ]
        assert f" {status} " in line and " ms " in line and "route=" in line
    # The logging layer's line about the failed call carries the request's id too.
    assert any(
        "chat request failed" in line and f"request_id={failed.value.request_id}" in line
        for line in log.splitlines()
    )
    assert "key-1" not in log
    # At warning: no line per request, and the warning that any caller is served.
    assert "POST /v1/chat/completions" not in quiet_log
    assert "no API keys configured" in quiet_log


async def test_metrics_endpoint_serves_prometheus_text_without_a_key(tmp_path: Path) -> None:
    async with FakeOpenAIServer() as upstream:
        config = write_config(
            tmp_path / "gateway.toml", upstream, '\n[gateway]\napi_keys_env = "GATEWAY_TEST_KEYS"\n'
        )
        env = {"GATEWAY_TEST_KEYS": "key-1"}
        with serving(config, "--prometheus-metrics", env=env) as server:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="key-1", max_retries=0)
            await client.chat.completions.create(model="pipeline", messages=MESSAGES)
            await client.close()
            async with httpx.AsyncClient() as http:
                response = await http.get(f"{server.url}/metrics")
            assert await server.terminate()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert response.headers["x-request-id"].startswith("req_")
    text = response.text
    # The LLM-fit buckets, from the same meters the OTLP export reads.
    assert "http_server_request_duration_seconds_bucket{" in text and 'le="0.08"' in text
    assert "gen_ai_client_operation_duration_seconds_bucket" not in text  # telemetry layer off
    assert 'http_response_status_code="200"' in text


async def test_with_several_workers_each_scrape_is_one_workers_series(tmp_path: Path) -> None:
    async with FakeOpenAIServer() as upstream:
        config = write_config(
            tmp_path / "gateway.toml", upstream, "\n[gateway]\nprometheus_metrics = true\n"
        )
        with serving(config, "--workers", "2") as server:
            instances: set[str] = set()
            # Fresh connections each time: the kernel hands each to either worker.
            async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as http:
                for _ in range(200):  # bounded
                    await http.post(
                        f"{server.url}/v1/chat/completions",
                        json={"model": "pipeline", "messages": MESSAGES},
                    )
                    response = await http.get(f"{server.url}/metrics")
                    assert response.headers["connection"] == "close"
                    instances |= set(re.findall(r'service_instance_id="([^"]+)"', response.text))
                    if len(instances) == 2:
                        break
            assert await server.terminate()
    assert len(instances) == 2, instances


# -- slow and idle clients against the real process -------------------------------------------


async def _open(port: int, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    return await reader.read()


async def _legitimate_requests_succeed(server: Serving, streaming: bool, count: int = 5) -> None:
    async with server.client() as client:
        for _ in range(count):
            if streaming:
                stream = await client.chat.completions.create(
                    model="pipeline", messages=MESSAGES, stream=True
                )
                assert [c async for c in stream]
            else:
                answer = await client.chat.completions.create(model="pipeline", messages=MESSAGES)
                assert answer.choices[0].message.content == "Hello from the fake server."


async def _served_while_attacked(
    server: Serving,
    streaming: bool,
    attackers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    within: float,
) -> list[bytes]:
    """Real requests are served while the attackers' connections are open, and after the
    gateway closed every one of them (within `within` seconds); what each attacker got."""
    await _legitimate_requests_succeed(server, streaming)
    async with asyncio.timeout(within):
        answers = await asyncio.gather(*(_until_closed(reader) for reader, _ in attackers))
    for _, writer in attackers:
        writer.close()
    await _legitimate_requests_succeed(server, streaming)
    return answers


async def test_slowloris_heads_and_bodies_lock_nobody_out(tmp_path: Path, streaming: bool) -> None:
    # 400 connections trickling their heads a byte at a time, and 100 trickling their
    # bodies (more than the 64 slots a key-less gateway gave everyone): real requests are
    # served all along, and every slow connection ends with a 408 at its deadline.
    async with FakeOpenAIServer() as upstream:
        config = write_config(
            tmp_path / "gateway.toml",
            upstream,
            "\n[gateway]\nheader_timeout = 1\nbody_timeout = 1\n",
        )
        with serving(config) as server:
            heads = await _open(server.port, 400)
            bodies = await _open(server.port, 100)
            data = json.dumps({"model": "pipeline", "messages": MESSAGES}).encode()
            for _, writer in heads:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n")
            for _, writer in bodies:
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data[:5]
                )

            async def trickle() -> None:
                for index in range(100):  # bounded; the deadlines end it long before
                    for _, writer in [*heads, *bodies]:
                        if not writer.is_closing():
                            writer.write(b"X" if index % 2 else b"-")
                    await asyncio.sleep(0.1)  # the attackers' pace, not a wait for a result

            trickling = asyncio.create_task(trickle())
            answers = await _served_while_attacked(server, streaming, [*heads, *bodies], 60)
            trickling.cancel()
            assert await server.terminate()
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), {
        answer[:40] for answer in answers
    }


async def test_an_idle_connection_flood_is_bounded(tmp_path: Path, streaming: bool) -> None:
    # 3,000 connections that send nothing: past max_connections the idle ones make room for
    # new ones, requests are served, and every silent connection is closed at its deadline.
    async with FakeOpenAIServer() as upstream:
        config = write_config(
            tmp_path / "gateway.toml",
            upstream,
            "\n[gateway]\nheader_timeout = 2\nmax_connections = 1000\n",
        )
        with serving(config) as server:
            idle = await _open(server.port, 3000)
            answers = await _served_while_attacked(server, streaming, idle, 120)
            assert await server.terminate()
    assert answers == [b""] * 3000  # closed without a word: they asked nothing


async def test_idle_connections_outlive_the_sdks_own_idle_expiry(tmp_path: Path) -> None:
    # uvicorn's default (5 s) equals the openai SDK's pool expiry (5 s): a request sent on
    # a connection idle 4.99 s could meet the server closing it ("connection closed
    # without a response"). The gateway keeps idle connections longer than the SDK does.
    async with openai.AsyncOpenAI(api_key="unused") as sdk:
        expiry = sdk._client._transport._pool._keepalive_expiry  # type: ignore[attr-defined]
    assert 1 <= expiry <= 30
    async with FakeOpenAIServer() as upstream:
        config = write_config(tmp_path / "gateway.toml", upstream)
        with serving(config) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            data = json.dumps({"model": "pipeline", "messages": MESSAGES}).encode()
            request = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            for second in (False, True):  # the second request reuses the idle connection
                writer.write(request)
                status = await reader.readline()
                assert status.startswith(b"HTTP/1.1 200")
                length = 0
                while (line := await reader.readline()) != b"\r\n":
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if not second:
                    # Idle past the SDK's expiry: the gateway has not closed the connection.
                    try:
                        early = await asyncio.wait_for(reader.read(200), timeout=expiry + 1)
                    except TimeoutError:
                        early = None  # nothing came, the connection stayed open
                    assert early is None, f"the idle connection gave {early!r}"
            writer.close()
            assert await server.terminate()


def test_the_line_formatter_writes_tracebacks_and_the_request_id() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)  # as `log_config` makes it, on a stream of ours
    handler.setFormatter(_LineFormatter(use_colors=False))
    handler.addFilter(_RequestIdFilter())

    def record(name: str, level: int, message: str, *args: Any, **kwargs: Any) -> None:
        made = logging.getLogger(name).makeRecord(name, level, "f.py", 1, message, args, None)
        made.__dict__.update(kwargs)
        handler.handle(made)

    token = enter_request_id("req_x")
    try:
        record("chat_pipeline.gateway", logging.INFO, "%s %d", "line", 1)
        record("chat_pipeline.layer", logging.WARNING, "layer")
        try:
            raise ValueError("boom")
        except ValueError:
            record("chat_pipeline.layer", logging.ERROR, "failed", exc_info=sys.exc_info())
    finally:
        exit_request_id(token)
    # The gateway's own line carries its request id already; other lines get it appended,
    # and a traceback follows its line.
    written = stream.getvalue()
    assert written.startswith(
        "INFO:     line 1\nWARNING:  layer request_id=req_x\n"
        "ERROR:    failed request_id=req_x\nTraceback (most recent call last):\n"
    )
    assert written.endswith("ValueError: boom\n")


@pytest.mark.parametrize("stream", ["line-buffered", "unbuffered", "buffered"])
def test_each_log_line_reaches_the_file_as_it_is_written(tmp_path: Path, stream: str) -> None:
    path = tmp_path / "log"
    raw = io.FileIO(path, "w")
    text: io.TextIOWrapper[Any]
    if stream == "unbuffered":  # stderr under PYTHONUNBUFFERED
        text = io.TextIOWrapper(raw, write_through=True)
    else:  # stderr otherwise (line-buffered), and a file's (flushed by the handler)
        text = io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=stream == "line-buffered")
    config = log_config("info")["handlers"]["chat_pipeline"]
    handler = config["()"](stream=text)
    handler.setFormatter(_LineFormatter(use_colors=False))
    logger = logging.getLogger("chat_pipeline.gateway")
    try:
        for n in range(2):
            handler.handle(
                logger.makeRecord(logger.name, logging.INFO, "f.py", 1, "line %d", (n,), None)
            )
            assert path.read_text() == "".join(f"INFO:     line {i}\n" for i in range(n + 1))
    finally:
        text.close()
