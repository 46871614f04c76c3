"""Another replica: a process sharing a Redis breaker with the test process.

    python -m tests.middleware.breaker_replica URL NAME CLOCK N STREAMING

Builds a breaker (fail_max=1, reset_timeout=30) named NAME on URL whose clock stands still
at CLOCK (ISO 8601), around a `GatedClient`; prints ``ready``. On ``go`` (stdin) it starts
N requests at once, and prints ``admitted A refused R`` once each has either reached the
client (A) or failed with `CircuitOpenError` (R). On ``release`` it lets the admitted
calls answer, waits for every request, and prints ``served S``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator
from datetime import datetime

from middleware.breaker import CircuitBreakerChatClient
from pipeline import ChatResponse, ChatResponseUpdate, ChatRole
from pipeline.client import ChatClientMetadata
from pipeline.errors import CircuitOpenError
from pipeline.testing import Collected, collect
from pipeline.types import ChatMessage, ChatOptions, Messages, TextContent


class GatedClient:
    """A client whose calls wait for `gate`, counting the calls that reached it."""

    def __init__(self) -> None:
        self.metadata = ChatClientMetadata(name="gated")
        self.gate = asyncio.Event()
        self.calls = 0
        self.changed = asyncio.Event()

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        self.calls += 1
        self.changed.set()
        await self.gate.wait()
        return ChatResponse(messages=[ChatMessage.assistant("ok")])

    async def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        self.calls += 1
        self.changed.set()
        await self.gate.wait()
        yield ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent("ok")])

    async def aclose(self) -> None:
        return None


class Burst:
    """`n` requests at once through `client`; `settled()` returns once each has reached
    `inner` or been refused."""

    def __init__(self, client: object, inner: GatedClient, n: int, streaming: bool) -> None:
        self.inner = inner
        self.n = n
        self.refused = 0
        self.tasks = [asyncio.create_task(self._one(client, streaming)) for _ in range(n)]

    async def _one(self, client: object, streaming: bool) -> Collected:
        result = await collect(client, "hi", streaming=streaming)  # type: ignore[arg-type]
        if isinstance(result.error, CircuitOpenError):
            self.refused += 1
            self.inner.changed.set()
        return result

    async def settled(self) -> tuple[int, int]:
        while self.inner.calls + self.refused < self.n:
            self.inner.changed.clear()
            await self.inner.changed.wait()
        return self.inner.calls, self.refused

    async def finish(self) -> int:
        self.inner.gate.set()
        results = await asyncio.gather(*self.tasks)
        return sum(1 for r in results if r.error is None and r.text == "ok")


def replica(url: str, name: str, clock: datetime) -> tuple[CircuitBreakerChatClient, GatedClient]:
    inner = GatedClient()
    # A generous Redis timeout: a loaded test machine must not make Redis look down (then
    # each process would decide alone, which is a different test).
    client = CircuitBreakerChatClient(
        inner,
        fail_max=1,
        reset_timeout=30,
        name=name,
        redis=url,
        redis_timeout=5,
        now=lambda: clock,
    )
    return client, inner


async def main(url: str, name: str, clock: str, n: int, streaming: bool) -> None:
    loop = asyncio.get_running_loop()
    client, inner = replica(url, name, datetime.fromisoformat(clock))

    async def line() -> str:
        return (await loop.run_in_executor(None, sys.stdin.readline)).strip()

    print("ready", flush=True)
    assert await line() == "go"
    burst = Burst(client, inner, n, streaming)
    admitted, refused = await burst.settled()
    print(f"admitted {admitted} refused {refused}", flush=True)
    assert await line() == "release"
    print(f"served {await burst.finish()}", flush=True)
    await client.aclose()


if __name__ == "__main__":
    url, name, clock, n, streaming = sys.argv[1:]
    asyncio.run(main(url, name, clock, int(n), streaming == "1"))
