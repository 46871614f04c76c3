"""What a misbehaving server cannot do to a provider client, over both transports: make it
hold an unbounded body (a decompression bomb, streamed or not), or make it drop the
events it sent before bytes that are not UTF-8."""

from __future__ import annotations

import functools
import gzip
import json
import tracemalloc
import zlib

import pytest

from pipeline.errors import ProviderError
from pipeline.providers import OpenAIChatClient
from pipeline.testing import Collected, collect
from tests.pipeline.providers.raw_http import RawHTTPServer

SSE_HEAD = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream"
JSON_HEAD = "HTTP/1.1 200 OK\r\ncontent-type: application/json"
JSON_GZIP_HEAD = JSON_HEAD + "\r\ncontent-encoding: gzip"
SSE_GZIP_HEAD = SSE_HEAD + "\r\ncontent-encoding: gzip"


@functools.cache
def bomb(prefix: bytes, size: int, filler: bytes = b" ") -> bytes:
    """`prefix`, then `size` bytes of `filler`, gzipped (about a thousandth of the size),
    made once per test session."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    block = filler * 1_000_000
    parts = [compressor.compress(prefix)]
    parts.extend(compressor.compress(block) for _ in range(size // len(block)))
    return b"".join(parts) + compressor.flush()


def chunk(text: str) -> bytes:
    payload = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return f"data: {json.dumps(payload)}\n\n".encode()


async def whole_answer(head: str, body: bytes, *, max_response_bytes: int) -> Collected:
    """A non-streamed call to a server answering `head` and `body`, with that bound."""
    async with RawHTTPServer(head, body) as server:
        client = OpenAIChatClient(
            "m", api_key="sk-test", base_url=server.base_url, max_response_bytes=max_response_bytes
        )
        try:
            return await collect(client, "hi", streaming=False)
        finally:
            await client.aclose()


async def test_a_non_streamed_body_past_the_bound_fails_typed_holding_little(
    transport: str,
) -> None:
    # 50 MB of JSON once decompressed, 50 KB on the wire.
    body = bomb(b'{"id": "x", "pad": "', 50_000_000)
    async with RawHTTPServer(JSON_GZIP_HEAD, body) as server:
        client = OpenAIChatClient(
            "m", api_key="sk-test", base_url=server.base_url, max_response_bytes=4_000_000
        )
        tracemalloc.start()
        try:
            result = await collect(client, "hi", streaming=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await client.aclose()
    error = result.error
    assert isinstance(error, ProviderError) and error.code == "response_too_large"
    assert "4000000 bytes" in str(error)
    # The bound and a decompressed chunk or two; never the 50 MB.
    assert peak < 16_000_000, peak


async def test_a_body_inside_the_bound_is_read_whole(transport: str) -> None:
    answer = {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok" + " " * 100_000},
                "finish_reason": "stop",
            }
        ],
    }
    body = gzip.compress(json.dumps(answer).encode())
    result = await whole_answer(JSON_GZIP_HEAD, body, max_response_bytes=200_000)
    assert result.error is None and result.text.strip() == "ok"


async def test_a_plain_body_past_the_bound_fails_typed_whether_or_not_it_came_whole(
    transport: str,
) -> None:
    # Far past the bound and not compressed: aiohttp may hand it over in one read, which
    # is checked against the bound like every later chunk.
    answer = {"id": "c1", "object": "chat.completion", "model": "m", "pad": "x" * 5_000}
    result = await whole_answer(JSON_HEAD, json.dumps(answer).encode(), max_response_bytes=1_000)
    error = result.error
    assert isinstance(error, ProviderError) and error.code == "response_too_large"
    assert "1000 bytes" in str(error)


def test_the_bound_must_be_positive_bytes() -> None:
    bad: object
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_response_bytes"):
            OpenAIChatClient(
                "m",
                api_key="k",
                base_url="http://127.0.0.1:9",
                max_response_bytes=bad,  # type: ignore[arg-type]
            )


async def test_a_streamed_bomb_of_one_endless_line_fails_typed_holding_little(
    transport: str,
) -> None:
    body = bomb(chunk("first") + b"data: ", 50_000_000)
    async with RawHTTPServer(SSE_GZIP_HEAD, body) as server:
        client = OpenAIChatClient("m", api_key="sk-test", base_url=server.base_url)
        tracemalloc.start()
        try:
            result = await collect(client, "hi", streaming=True)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await client.aclose()
    assert result.text == "first"
    error = result.error
    assert isinstance(error, ProviderError) and error.code == "malformed"
    assert "line longer than" in str(error)
    assert peak < 32_000_000, peak  # the 8 Mi-character line bound, not the 50 MB


async def test_events_before_bytes_that_are_not_utf8_reach_the_caller_first(
    transport: str,
) -> None:
    # One write: the good events and the bad bytes arrive in the same network chunk.
    body = chunk("Hello") + chunk(" world") + b"data: \xff\xfe\n\n"
    async with RawHTTPServer(SSE_HEAD, body) as server:
        client = OpenAIChatClient("m", api_key="sk-test", base_url=server.base_url)
        try:
            result = await collect(client, "hi", streaming=True)
        finally:
            await client.aclose()
    assert result.text == "Hello world"  # output first: the failure is after output
    error = result.error
    assert isinstance(error, ProviderError) and error.code == "malformed"
    assert "UTF-8" in str(error)


async def test_a_streamed_bomb_of_blank_lines_lets_the_first_chunk_timeout_fire(
    transport: str,
) -> None:
    # 50 MB of blank lines once decompressed: no payload ever completes. The reader gives
    # the loop a turn every megabyte, so the deadline cuts it long before the body ends.
    body = bomb(b"", 50_000_000, b"\n")
    async with RawHTTPServer(SSE_GZIP_HEAD, body) as server:
        client = OpenAIChatClient(
            "m", api_key="sk-test", base_url=server.base_url, first_chunk_timeout=0.05
        )
        try:
            result = await collect(client, "hi", streaming=True)
        finally:
            await client.aclose()
    assert result.text == ""
    error = result.error
    assert isinstance(error, ProviderError) and error.code == "stream_timeout"
