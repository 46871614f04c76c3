"""The boundaries every HTTP chat client shares (they live in `_base`), once per wire
format: Chat Completions against FakeOpenAIServer, Messages against FakeAnthropicServer."""

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx2
import pytest

from middleware.routing import OrderedFailoverChatClient
from pipeline.errors import ProviderError, TransientProviderError
from pipeline.providers import AnthropicChatClient, OpenAIChatClient
from pipeline.providers._base import HTTPChatClient
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse, collect

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
async def server(wire: tuple[type[Server], Factory]) -> AsyncIterator[Server]:
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
    assert isinstance(result.error.__cause__, httpx2.ConnectError)
    await client.aclose()


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
            assert (await collect(client, "hi", streaming=streaming)).text == ANSWER
        assert not http.is_closed


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


def test_only_an_httpx2_client_is_accepted(wire: tuple[type[Server], Factory]) -> None:
    with pytest.raises(TypeError, match=r"httpx2\.AsyncClient"):
        wire[1]("http://127.0.0.1:1", http_client=object())


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


async def test_the_default_pool_keeps_every_connection_of_a_burst_alive(
    server: Server, client: HTTPChatClient
) -> None:
    # Each open stream holds its connection, so a burst of 32 opens 32. httpx2's default
    # pool keeps only 20 of them alive and would open 12 more for the second burst.
    for _burst in range(2):
        streams = [client.get_streaming_response("hi") for _ in range(32)]
        for stream in streams:
            assert (await anext(stream)).text
        for stream in streams:
            assert "".join([u.text async for u in stream])
    assert server.connections_accepted == 32
