"""The boundaries every HTTP chat client shares (they live in `_base`), once per wire
format: Chat Completions against FakeOpenAIServer, Messages against FakeAnthropicServer."""

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import httpx2
import pytest

from middleware.routing import OrderedFailoverChatClient
from pipeline.errors import ProviderError, TransientProviderError
from pipeline.providers import AnthropicChatClient, OpenAIChatClient
from pipeline.providers._base import HTTPChatClient
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse, collect
from tests.otel import Otel

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")

Server = FakeOpenAIServer | FakeAnthropicServer
Factory = Callable[..., HTTPChatClient]

ANSWER = "Hello from the fake server."


def _openai(url: str, **settings: object) -> HTTPChatClient:
    return OpenAIChatClient("m", api_key="k", base_url=url, **settings)  # type: ignore[arg-type]


def _anthropic(url: str, **settings: object) -> HTTPChatClient:
    return AnthropicChatClient("m", api_key="k", base_url=url, **settings)  # type: ignore[arg-type]


WIRES: dict[str, tuple[type[Server], Factory]] = {
    "openai": (FakeOpenAIServer, _openai),
    "anthropic": (FakeAnthropicServer, _anthropic),
}


@pytest.fixture(params=sorted(WIRES))
def wire(request: pytest.FixtureRequest) -> tuple[type[Server], Factory]:
    return WIRES[request.param]


@pytest.fixture
async def server(wire: tuple[type[Server], Factory], transport: str) -> AsyncIterator[Server]:
    async with wire[0]() as fake:
        yield fake


@pytest.fixture
async def client(
    server: Server, wire: tuple[type[Server], Factory]
) -> AsyncIterator[HTTPChatClient]:
    chat = wire[1](server.base_url)
    yield chat
    await chat.aclose()


async def test_connection_refused_is_transient(
    wire: tuple[type[Server], Factory], streaming: bool
) -> None:
    async with wire[0]() as fake:
        url = fake.base_url
    client = wire[1](url)
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    refused = {"httpx2": httpx2.ConnectError, "aiohttp": aiohttp.ClientConnectorError}
    assert isinstance(result.error.__cause__, refused[client.transport])
    assert (
        str(result.error)
        == f"{client.provider_name}: transport failure: " + type(result.error.__cause__).__name__
    )
    await client.aclose()


@pytest.mark.parametrize("first_chunk_timeout", [None, 60.0])
async def test_a_read_timeout_is_transient(
    server: Server,
    wire: tuple[type[Server], Factory],
    streaming: bool,
    first_chunk_timeout: float | None,
) -> None:
    # (aiohttp's timeouts are TimeoutErrors: one inside an armed first-chunk deadline is
    # still the transport's, not the deadline's.)
    server.script(FakeResponse(hang=True))  # never answers: the read timeout must end it
    client = wire[1](server.base_url, timeout=0.2, first_chunk_timeout=first_chunk_timeout)
    async with client:
        result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    timeouts = {"httpx2": httpx2.TimeoutException, "aiohttp": aiohttp.ServerTimeoutError}
    assert isinstance(result.error.__cause__, timeouts[client.transport])
    assert result.error.code is None  # the transport's timeout, not a stream deadline


async def test_caller_cancellation_propagates(
    server: Server, client: HTTPChatClient, streaming: bool
) -> None:
    server.script(FakeResponse(hang=True))
    task = asyncio.create_task(collect(client, "hi", streaming=streaming))
    await server.wait_for_requests(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_abandoning_a_stream_releases_the_connection(
    server: Server, client: HTTPChatClient
) -> None:
    server.script(FakeResponse(text="a b c d e f"))
    stream = client.get_streaming_response("hi")
    await anext(stream)
    await anext(stream)
    await stream.aclose()
    # The pool can serve another request on the released connection.
    assert (await client.get_response("hi")).text == ANSWER


async def test_given_http_client_is_used_and_left_open(
    server: Server, wire: tuple[type[Server], Factory], streaming: bool
) -> None:
    async with httpx2.AsyncClient() as http:
        async with wire[1](server.base_url, http_client=http) as client:
            assert client.transport == "httpx2"
            assert (await collect(client, "hi", streaming=streaming)).text == ANSWER
        assert not http.is_closed
    async with aiohttp.ClientSession() as session:
        async with wire[1](server.base_url, http_client=session) as client:
            assert client.transport == "aiohttp"
            assert (await collect(client, "hi", streaming=streaming)).text == ANSWER
        assert not session.closed
    assert server.count() == 2


async def test_first_chunk_timeout_is_transient_and_fails_over(
    wire: tuple[type[Server], Factory],
) -> None:
    async with wire[0]() as primary, wire[0]() as backup:
        primary.script(FakeResponse(hang=True))
        slow = wire[1](primary.base_url, first_chunk_timeout=0.5, name="slow")
        router = OrderedFailoverChatClient([slow, wire[1](backup.base_url, name="backup")])
        async with router:
            result = await collect(router, "hi", streaming=True)
    assert result.text == ANSWER
    assert (primary.count(), backup.count()) == (1, 1)


async def test_stream_idle_timeout_after_output(
    server: Server, wire: tuple[type[Server], Factory]
) -> None:
    server.script(FakeResponse(text="a b", chunk_delay=5.0))
    async with wire[1](server.base_url, stream_idle_timeout=0.05) as client:
        result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert result.error.code == "stream_timeout"
    assert [u.text for u in result.updates] == ["a "]


async def test_a_stream_that_does_not_say_it_is_complete_is_transient(
    server: Server, client: HTTPChatClient
) -> None:
    server.script(FakeResponse(text="a b", omit_done=True))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert result.error.code == "incomplete_stream"
    assert f"ended before {client.stream_end_type or '[DONE]'}" in str(result.error)
    assert "".join(u.text for u in result.updates) == "a b"


async def test_the_transport_is_checked_against_the_http_client(
    wire: tuple[type[Server], Factory],
) -> None:
    with pytest.raises(TypeError, match=r"httpx2\.AsyncClient or an aiohttp\.ClientSession"):
        wire[1]("http://127.0.0.1:1", http_client=object())
    with pytest.raises(ValueError, match="transport must be one of 'aiohttp', 'httpx2'"):
        wire[1]("http://127.0.0.1:1", transport="requests")
    async with httpx2.AsyncClient() as http:
        with pytest.raises(ValueError, match=r"cannot call through an httpx2\.AsyncClient"):
            wire[1]("http://127.0.0.1:1", http_client=http, transport="aiohttp")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ValueError, match="cannot call through an aiohttp session"):
            wire[1]("http://127.0.0.1:1", http_client=session, transport="httpx2")
    for name in ("aiohttp", "httpx2"):
        async with wire[1]("http://127.0.0.1:1", transport=name) as chosen:
            assert chosen.transport == name


@pytest.mark.parametrize(
    "charset", ["base64", "zlib_codec", "hex", "uu", "rot13", "idna", "utf-16"]
)
async def test_a_declared_charset_never_picks_the_stream_decoder(charset: str) -> None:
    """Server-sent events are UTF-8 whatever the Content-Type says: a stream that declares
    a strange charset still decodes, and bytes that are not UTF-8 are a ProviderError."""
    import asyncio

    from pipeline.providers import OpenAIChatClient

    good = (
        b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
        b"data: [DONE]\n\n"
    )
    bodies = [good, b"data: \xff\xfe\n\n"]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = bodies.pop(0)
        head = (
            "HTTP/1.1 200 OK\r\n"
            f"Content-Type: text/event-stream; charset={charset}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with OpenAIChatClient("m", api_key="k", base_url=f"http://127.0.0.1:{port}/v1") as c:
        assert (await collect(c, "hi", streaming=True)).text == "hi"
        broken = await collect(c, "hi", streaming=True)
    server.close()
    await server.wait_closed()
    assert isinstance(broken.error, ProviderError) and broken.error.code == "malformed"


def _held(server_class: type[Server], burst: int) -> type[Server]:
    """`server_class`, holding each request until `burst` of them arrived: every request of
    a burst then holds a connection of its own (a response answered at once would free its
    connection for the next one)."""

    class Held(server_class):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Barrier(burst)

        async def _handle(self, *args: Any) -> bool:
            async with asyncio.timeout(60):  # bounded: a burst that never fills fails
                await self.gate.wait()
            return bool(await super()._handle(*args))

    return Held


async def test_the_default_pool_keeps_every_connection_of_a_burst_alive(
    wire: tuple[type[Server], Factory], streaming: bool
) -> None:
    # A burst of 32 concurrent requests opens 32 connections. httpx2's default pool keeps
    # only 20 of them alive and would open 12 more for the second burst.
    async with _held(wire[0], 32)() as server, wire[1](server.base_url) as client:
        for _burst in range(2):
            calls = [collect(client, "hi", streaming=streaming) for _ in range(32)]
            assert [r.text for r in await asyncio.gather(*calls)] == [ANSWER] * 32
    assert server.connections_accepted == 32


async def test_requests_carry_the_attempt_spans_trace_context(
    server: Server, wire: tuple[type[Server], Factory], streaming: bool, otel: Otel
) -> None:
    """The attempt span is current while its route runs: the upstream request names it as
    its parent (W3C ``traceparent``), so the provider's own spans join the trace."""
    client = wire[1](server.base_url, name="a")
    async with OrderedFailoverChatClient([client], **otel.providers) as router:
        assert (await collect(router, "hi", streaming=streaming)).text == ANSWER
        # Without a current span, nothing is injected.
        assert (await collect(client, "hi", streaming=streaming)).text == ANSWER
    [attempt] = otel.attempt_spans()
    assert attempt.context is not None
    traced, untraced = server.requests
    version, trace_id, span_id, flags = traced.headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert trace_id == format(attempt.context.trace_id, "032x")
    assert span_id == format(attempt.context.span_id, "016x")
    assert "traceparent" not in untraced.headers
