"""A replica of the Redis chaos test: a pipeline whose shared state lives in one Redis,
run by the test process and by a process of its own.

    python -m tests.chaos.redis_replica URL NAMESPACE

The pipeline: a tool loop (`charge(phase, amount)`, idempotent through a
`RedisIdempotencyStore`) over ordered failover of routes ``a``, ``b``, ``c`` (each behind a
breaker shared through Redis), with session affinity in a `RedisAffinityStore`. Each route's
model asks for the charge its prompt names, then answers ``<route|tool result>``.

It prints ``ready``, then takes commands on stdin, one a line, each answered with one JSON
line:

* ``burst PHASE N GATED``: N requests at once; request i (streamed when i is odd) has the
  session ``PHASE-s<i>``, the operation ``PHASE-op<i>`` and asks for
  ``charge(PHASE, i)``; with GATED ``1`` each charge that runs here waits at a gate. Answers
  once each request is running its charge here, waiting for its run in the other replica,
  or over: ``{"running": R, "waiting": W, "ended": E}``;
* ``release``: opens the gate, waits for every request: ``{"answers": [...], "ran": [...],
  "calls": {route: n}}`` (the ``<route|result>`` of each request or its error's type; the
  amounts charged here; each route's model calls in this burst);
* ``log``: what the replica logged so far (see `LogCounter`);
* ``quit``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections import Counter
from typing import Any

from middleware.breaker import CircuitBreakerChatClient
from middleware.function_invocation import (
    FunctionInvokingChatClient,
    RedisIdempotencyStore,
    operation_scope,
    tool,
)
from middleware.routing import OrderedFailoverChatClient, Route
from middleware.routing.affinity import RedisAffinityStore, SessionAffinity
from pipeline import (
    ChatMessage,
    ChatOptions,
    FunctionCallContent,
    FunctionResultContent,
    _scope,
)
from pipeline.testing import ScriptedChatClient, call_tools, collect, reply

ROUTES = ("a", "b", "c")
# Generous bounds: 2,000 requests in flight on a loaded machine must not make a healthy
# Redis look down; a paused one costs each wave of calls this long.
TIMEOUT = 5.0
LEASE = 15.0


class LogCounter(logging.Handler):
    """Counts the lines the shared-state components log, by what they say."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.text.append(message)
        if record.name == "chat_pipeline.breaker":
            what = "breaker"
        elif record.name == "chat_pipeline.routing.affinity":
            what = "affinity"
        else:
            what = "tools"
        if "unavailable" in message:
            self.counts[f"{what} unavailable"] += 1
        elif "reachable again" in message:
            self.counts[f"{what} back"] += 1
        elif "could not be recorded" in message:
            self.counts["result unrecorded"] += 1
        elif "claim ran out" in message:
            self.counts["claim lost"] += 1
        else:
            self.counts[f"{what} other"] += 1


class WatchedStore(RedisIdempotencyStore):
    """Tells the replica which requests wait for a run held by the other replica."""

    replica: Replica | None = None

    async def _pause(self, key: str, seconds: float) -> None:
        if self.replica is not None:
            self.replica.waits(str(_scope.current_operation()))
        await super()._pause(key, seconds)


def model(route: str) -> ScriptedChatClient:
    """A route's model: asks for the charge the prompt names, then answers with its result."""

    def answer(messages: list[ChatMessage], options: ChatOptions | None) -> Any:
        last = messages[-1].contents[0] if messages[-1].contents else None
        if isinstance(last, FunctionResultContent):
            return reply(f"<{route}|{last.result}>")
        phase, amount = str(messages[0].text).split()
        call = FunctionCallContent(
            f"{phase}-{amount}", "charge", {"phase": phase, "amount": int(amount)}
        )
        return call_tools(call)

    return ScriptedChatClient(answer, name=route)


class Replica:
    def __init__(self, url: str, namespace: str) -> None:
        self.gate = asyncio.Event()
        self.changed = asyncio.Event()
        self.ran: list[int] = []
        self.running: set[str] = set()
        self.waiting: set[str] = set()
        self.ended: set[str] = set()
        self.log = LogCounter()
        for name in (
            "chat_pipeline.breaker",
            "chat_pipeline.routing.affinity",
            "chat_pipeline.tools",
        ):
            logger = logging.getLogger(name)
            logger.addHandler(self.log)
            logger.setLevel(logging.INFO)

        @tool
        async def charge(phase: str, amount: int) -> str:
            self.ran.append(amount)
            self.running.add(f"{phase}-op{amount}")
            self.changed.set()
            await self.gate.wait()
            return f"charged {phase}-{amount}"

        self.models = {route: model(route) for route in ROUTES}
        routes = [
            Route(
                route,
                CircuitBreakerChatClient(
                    self.models[route],
                    name=f"{namespace}-{route}",
                    redis=url,
                    redis_timeout=TIMEOUT,
                    # Every call tries Redis while it is paused (the worst case), and the
                    # first call after it resumes finds it.
                    redis_retry_interval=0,
                    fail_max=5,
                    reset_timeout=600,
                ),
            )
            for route in ROUTES
        ]
        self.affinity_store = RedisAffinityStore(
            url, ttl=600, namespace=f"{namespace}:affinity", timeout=TIMEOUT, retry_interval=0
        )
        self.router = OrderedFailoverChatClient(
            routes, affinity=SessionAffinity(self.affinity_store)
        )
        self.store = WatchedStore(url, namespace=f"{namespace}:tool", timeout=TIMEOUT, lease=LEASE)
        self.store.replica = self
        self.chat = FunctionInvokingChatClient(self.router, [charge], idempotency_store=self.store)
        self.tasks: list[asyncio.Task[Any]] = []
        self.before: dict[str, int] = {}

    def waits(self, operation: str) -> None:
        self.waiting.add(operation)
        self.changed.set()

    def start(self, phase: str, n: int, gated: bool) -> None:
        if gated:
            self.gate.clear()
        else:
            self.gate.set()
        self.ran.clear()
        self.running.clear()
        self.waiting.clear()
        self.ended.clear()
        self.before = {route: m.call_count for route, m in self.models.items()}
        self.tasks = []
        for i in range(n):
            with operation_scope(f"{phase}-op{i}"):
                self.tasks.append(asyncio.create_task(self._one(phase, i)))

    async def _one(self, phase: str, i: int) -> str:
        options = ChatOptions(session_id=f"{phase}-s{i}")
        try:
            result = await collect(self.chat, f"{phase} {i}", options, streaming=i % 2 == 1)
        finally:
            self.ended.add(f"{phase}-op{i}")
            self.changed.set()
        if result.error is not None:
            return type(result.error).__name__
        return result.text

    async def settled(self, n: int) -> dict[str, int]:
        while len(self.running | self.waiting | self.ended) < n:
            self.changed.clear()
            await self.changed.wait()
        return {
            "running": len(self.running - self.ended),
            "waiting": len(self.waiting - self.running - self.ended),
            "ended": len(self.ended),
        }

    async def finish(self) -> dict[str, Any]:
        self.gate.set()
        answers = await asyncio.gather(*self.tasks)
        calls = {route: m.call_count - self.before[route] for route, m in self.models.items()}
        return {"answers": answers, "ran": sorted(self.ran), "calls": calls}

    async def aclose(self) -> None:
        await self.chat.aclose()  # the router and the routes' breakers
        await self.affinity_store.aclose()
        await self.store.aclose()


async def main(url: str, namespace: str) -> None:
    loop = asyncio.get_running_loop()
    replica = Replica(url, namespace)

    def say(value: Any) -> None:
        print(json.dumps(value), flush=True)

    print("ready", flush=True)
    while True:
        command = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not command or command[0] == "quit":
            break
        if command[0] == "burst":
            phase, n, gated = command[1], int(command[2]), command[3] == "1"
            replica.start(phase, n, gated)
            say(await replica.settled(n))
        elif command[0] == "release":
            say(await replica.finish())
        elif command[0] == "log":
            say(dict(replica.log.counts))
        else:
            raise ValueError(f"unknown command {command[0]!r}")
    await replica.aclose()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
