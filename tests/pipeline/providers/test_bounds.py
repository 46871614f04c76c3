"""What a misbehaving server cannot do to a provider client, over both transports: make it
hold an unbounded body (a decompression bomb, streamed or not), or make it drop the
events it sent before bytes that are not UTF-8."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest

from pipeline.errors import ProviderError
from pipeline.providers import OpenAIChatClient
from pipeline.testing import collect
from tests.pipeline.providers.raw_http import RawHTTPServer

SSE_HEAD = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream"
JSON_GZIP_HEAD = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip"
SSE_GZIP_HEAD = SSE_HEAD + "\r\ncontent-encoding: gzip"


def bomb(prefix: bytes, size: int) -> bytes:
    """`prefix`, then `size` spaces: gzip makes that about a thousandth of its size."""
    compressor = gzip.compress(prefix + b" " * size, compresslevel=9)
    return compressor


def chunk(text: str) -> bytes:
    payload = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return f"data: {json.dumps(payload)}\n\n".encode()


async def test_a_non_streamed_body_past_the_bound_fails_typed_holding_little(
    transport: str,
) -> None:
    # 200 MB of JSON once decompressed, 200 KB on the wire.
    body = bomb(b'{"id": "x", "pad": "', 200_000_000)
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
    # The bound and a decompressed chunk or two; never the 200 MB.
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
    async with RawHTTPServer(JSON_GZIP_HEAD, body) as server:
        client = OpenAIChatClient(
            "m", api_key="sk-test", base_url=server.base_url, max_response_bytes=200_000
        )
        try:
            result = await collect(client, "hi", streaming=False)
        finally:
            await client.aclose()
    assert result.error is None and result.text.strip() == "ok"


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
    body = bomb(chunk("first") + b"data: ", 200_000_000)
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
    assert peak < 64_000_000, peak  # the 8 Mi-character line bound, not the 200 MB


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
