"""Another replica: a process sharing a Redis breaker with the test process.

    python -m tests.middleware.breaker_replica URL NAME FAIL_MAX [FAILURE_RATIO MINIMUM_CALLS]

Builds a breaker (`fail_max` FAIL_MAX, reset_timeout=30, and the failure-ratio policy when
given) named NAME on URL around a `GatedClient`, whose clock stands still until told
otherwise; prints ``ready``. Then it reads one command a line from stdin and answers each
with one line:

* ``clock ISO`` sets the clock (ISO 8601): ``ok``;
* ``burst N OUTCOME STREAMING`` starts N requests at once (OUTCOME ``ok``, ``fail``, or
  ``mixK``: K of every ten calls fail; how the admitted calls will end; STREAMING ``1`` or
  ``0``) and answers
  ``admitted A refused R`` once each has either reached the client (A) or failed with
  `CircuitOpenError` (R);
* ``release`` lets the admitted calls end, waits for every request: ``served S``;
* ``state``: ``state <this process's view> warnings W`` (W: the "Redis unavailable"
  warnings logged so far);
* ``quit``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncGenerator
from datetime import datetime
from typing import Any

from middleware.breaker import CircuitBreakerChatClient
from pipeline import ChatResponse, ChatResponseUpdate, ChatRole
from pipeline.client import ChatClientMetadata
from pipeline.errors import CircuitOpenError, TransientProviderError
from pipeline.testing import Collected, collect
from pipeline.types import ChatMessage, ChatOptions, Messages, TextContent


class GatedClient:
    """A client whose calls wait for `gate`, counting the calls that reached it; they then
    answer, or fail with a transient error when `failing` (or, with `fail_tenths` K, when
    they are among the first K of each ten calls to arrive)."""

    def __init__(self) -> None:
        self.metadata = ChatClientMetadata(name="gated")
        self.gate = asyncio.Event()
        self.calls = 0
        self.changed = asyncio.Event()
        self.failing = False
        self.fail_tenths = 0

    def expect(self, outcome: str) -> None:
        """How the next calls end: ``ok``, ``fail`` or ``mixK``."""
        self.failing = outcome == "fail"
        self.fail_tenths = int(outcome[3:]) if outcome.startswith("mix") else 0

    async def _arrive(self) -> None:
        index = self.calls
        self.calls += 1
        self.changed.set()
        await self.gate.wait()
        if self.failing or index % 10 < self.fail_tenths:
            raise TransientProviderError("gated failure")

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        await self._arrive()
        return ChatResponse(messages=[ChatMessage.assistant("ok")])

    async def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        await self._arrive()
        yield ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent("ok")])

    async def aclose(self) -> None:
        return None


class Burst:
    """`n` requests at once through `client`; `settled()` returns once each has reached
    `inner` or been refused."""

    def __init__(self, client: object, inner: GatedClient, n: int, streaming: bool) -> None:
        self.inner = inner
        self.n = n
        self.before = inner.calls
        self.refused = 0
        self.tasks = [asyncio.create_task(self._one(client, streaming)) for _ in range(n)]

    async def _one(self, client: object, streaming: bool) -> Collected:
        result = await collect(client, "hi", streaming=streaming)  # type: ignore[arg-type]
        if isinstance(result.error, CircuitOpenError):
            self.refused += 1
            self.inner.changed.set()
        return result

    async def settled(self) -> tuple[int, int]:
        while self.inner.calls - self.before + self.refused < self.n:
            self.inner.changed.clear()
            await self.inner.changed.wait()
        return self.inner.calls - self.before, self.refused

    async def finish(self) -> int:
        """Let the admitted calls end; how many requests were served ``ok``."""
        self.inner.gate.set()
        results = await asyncio.gather(*self.tasks)
        self.inner.gate.clear()
        return sum(1 for r in results if r.error is None and r.text == "ok")


class WarningCounter(logging.Handler):
    """Counts the breaker's "Redis unavailable" warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Redis unavailable" in record.getMessage():
            self.count += 1


class Clock:
    """A clock that stands still until set."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def replica(
    url: str, name: str, clock: datetime | Clock, fail_max: int = 1, **options: Any
) -> tuple[CircuitBreakerChatClient, GatedClient]:
    inner = GatedClient()
    now = clock if isinstance(clock, Clock) else Clock(clock)
    # A generous Redis timeout: a loaded test machine must not make Redis look down (then
    # each process would decide alone, which is a different test).
    client = CircuitBreakerChatClient(
        inner,
        fail_max=fail_max,
        reset_timeout=30,
        name=name,
        redis=url,
        redis_timeout=5,
        now=now,
        clock=lambda: now().timestamp(),
        redis_clock=lambda: now().timestamp(),
        **options,
    )
    return client, inner


async def main(url: str, name: str, fail_max: int, options: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    warnings = WarningCounter()
    logging.getLogger("chat_pipeline.breaker").addHandler(warnings)
    clock = Clock(datetime.fromisoformat("2026-01-01T00:00:00+00:00"))
    client, inner = replica(url, name, clock, fail_max, **options)
    burst: Burst | None = None

    async def line() -> list[str]:
        return (await loop.run_in_executor(None, sys.stdin.readline)).split()

    def say(text: str) -> None:
        print(text, flush=True)

    say("ready")
    while True:
        command = await line()
        if not command or command[0] == "quit":
            break
        if command[0] == "clock":
            clock.now = datetime.fromisoformat(command[1])
            say("ok")
        elif command[0] == "burst":
            inner.expect(command[2])
            burst = Burst(client, inner, int(command[1]), command[3] == "1")
            admitted, refused = await burst.settled()
            say(f"admitted {admitted} refused {refused}")
        elif command[0] == "release":
            assert burst is not None
            say(f"served {await burst.finish()}")
        elif command[0] == "state":
            say(f"state {client.state} warnings {warnings.count}")
        else:
            raise ValueError(f"unknown command {command[0]!r}")
    await client.aclose()


if __name__ == "__main__":
    url, name, fail_max, *ratio = sys.argv[1:]
    policy: dict[str, Any] = {}
    if ratio:
        policy = {"failure_ratio": float(ratio[0]), "minimum_calls": int(ratio[1])}
    asyncio.run(main(url, name, int(fail_max), policy))
