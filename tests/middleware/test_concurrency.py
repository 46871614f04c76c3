"""Concurrent streams never wait for each other in the pipeline: no layer holds a lock or a
shared structure across an await that would serialize them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from middleware.routing import Route
from pipeline import ChatClientMetadata, ChatPipeline, ChatResponseUpdate, TextContent
from pipeline.testing import collect

STREAMS = 32


class GatedClient:
    """Streams one update, then waits for the gate before the rest; counts streams in flight."""

    def __init__(self) -> None:
        self.metadata = ChatClientMetadata(provider_name="gated", model_id="g", name="gated")
        self.gate = asyncio.Event()
        self.in_flight = 0
        self.all_in_flight = asyncio.Event()

    async def get_response(self, messages, options=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def get_streaming_response(  # type: ignore[no-untyped-def]
        self, messages, options=None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream()

    async def _stream(self) -> AsyncGenerator[ChatResponseUpdate, None]:
        yield ChatResponseUpdate(contents=[TextContent("first ")])
        self.in_flight += 1
        if self.in_flight == STREAMS:
            self.all_in_flight.set()
        await self.gate.wait()
        yield ChatResponseUpdate(contents=[TextContent("second")], finish_reason="stop")

    async def aclose(self) -> None:
        return None


@pytest.mark.parametrize("layers", ["full", "router only"])
async def test_concurrent_streams_are_all_in_flight_at_once(layers: str) -> None:
    client = GatedClient()
    route = ChatPipeline.builder().use_circuit_breaker().use_retry().build(client, name="gated")
    builder = ChatPipeline.builder()
    if layers == "full":
        builder = builder.use_telemetry().use_logging()
    chat = builder.use_ordered_failover([Route("gated", route)], request_timeout=60).build()
    requests = [asyncio.ensure_future(collect(chat, "hi", streaming=True)) for _ in range(STREAMS)]
    # Every stream passed its first update and waits at the same time: had any layer held
    # something across an await, fewer would get here (the bound only turns a hang into a
    # failure; it is not a speed requirement).
    async with asyncio.timeout(30):
        await client.all_in_flight.wait()
    client.gate.set()
    results = await asyncio.gather(*requests)
    assert [r.text for r in results] == ["first second"] * STREAMS
    assert all(r.error is None for r in results)
