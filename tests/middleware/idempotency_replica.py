"""Another process running the same tool calls, under the same operations, through Redis.

    python -m tests.middleware.idempotency_replica URL NAMESPACE OPERATION

Runs one request whose model asks for ``charge(amount=5)`` with a `RedisIdempotencyStore`
on URL under NAMESPACE. If the tool runs here it pushes ``replica`` onto the Redis list
``NAMESPACE:runs``. Prints ``waiting`` the first time its claim finds the call running in
another process, then ``result <the tool result>``.

    python -m tests.middleware.idempotency_replica URL NAMESPACE burst

A replica for bursts (`Charges`): prints ``ready``, then reads commands, one a line, each
answered by one line:

* ``go N STREAMING``: N requests at once, request i under operation ``op-i`` asking for
  ``charge(amount=i)``; answers ``started S waiting W`` once each call is either running
  here (S, held at a gate) or waiting for its run in another process (W);
* ``release``: opens the gate, waits for every request: ``ok K failed F ran <amounts>``
  (K requests whose tool result was the charge, F others; the amounts charged here);
* ``quit``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import redis.asyncio as redis_asyncio

from middleware.function_invocation import (
    FunctionInvokingChatClient,
    RedisIdempotencyStore,
    operation_scope,
    tool,
)
from pipeline import ChatMessage, ChatOptions, FunctionCallContent, FunctionResultContent, _scope
from pipeline.testing import ScriptedChatClient, call_tools, collect, reply


class ReportingStore(RedisIdempotencyStore):
    """Says when it first waits for a claim held elsewhere."""

    waited = False

    async def _pause(self, key: str, seconds: float) -> None:
        if not self.waited:
            self.waited = True
            print("waiting", flush=True)
        await super()._pause(key, seconds)


async def main(url: str, namespace: str, operation: str) -> None:
    redis = redis_asyncio.Redis.from_url(url)

    @tool
    async def charge(amount: int) -> str:
        await redis.rpush(f"{namespace}:runs", "replica")
        return "charged by the replica"

    model = ScriptedChatClient(
        [call_tools(FunctionCallContent("c1", "charge", {"amount": 5})), reply("Done.")]
    )
    store = ReportingStore(url, namespace=namespace)
    chat = FunctionInvokingChatClient(model, [charge], idempotency_store=store)
    with operation_scope(operation):
        response = await chat.get_response("charge me 5")
    result = response.messages[1].contents[0]
    assert isinstance(result, FunctionResultContent)
    print(f"result {result.result}", flush=True)
    await store.aclose()
    await redis.aclose()


def tool_result(messages: list[ChatMessage]) -> Any:
    """The result of the last tool call in `messages` (the model's second turn sees it)."""
    content = messages[-1].contents[0]
    assert isinstance(content, FunctionResultContent)
    return content.result


class Charges:
    """N requests at once, each charging its own amount once under its own operation;
    every charge is held at a gate, so all N are in flight together."""

    def __init__(self, store: RedisIdempotencyStore) -> None:
        self.store = store
        self.gate = asyncio.Event()
        self.changed = asyncio.Event()
        self.ran: list[int] = []
        self.waiting: set[int] = set()
        self.ended: set[int] = set()

        @tool
        async def charge(amount: int) -> str:
            self.ran.append(amount)
            self.changed.set()
            await self.gate.wait()
            return f"charged {amount}"

        def model(messages: list[ChatMessage], options: ChatOptions | None) -> Any:
            if messages[-1].contents and isinstance(
                messages[-1].contents[0], FunctionResultContent
            ):
                return reply(str(tool_result(messages)))
            amount = int(str(messages[-1].text))
            return call_tools(FunctionCallContent(f"c{amount}", "charge", {"amount": amount}))

        self.model = ScriptedChatClient(model)
        self.chat = FunctionInvokingChatClient(self.model, [charge], idempotency_store=store)

    def waits(self, amount: int) -> None:
        self.waiting.add(amount)
        self.changed.set()

    def start(self, n: int, streaming: bool, prefix: str = "op") -> list[asyncio.Task[Any]]:
        """Request i asks for ``charge(amount=i)`` under the operation ``<prefix>-i``."""
        tasks = []
        for i in range(n):
            with operation_scope(f"{prefix}-{i}"):
                tasks.append(asyncio.create_task(self._one(i, streaming)))
        return tasks

    async def _one(self, i: int, streaming: bool) -> Any:
        try:
            return await collect(self.chat, str(i), streaming=streaming)
        finally:
            self.ended.add(i)
            self.changed.set()

    async def settled(self, n: int) -> tuple[int, int]:
        """Once each call is running here, waiting for another replica's run, or over
        (which it must not be before `finish`): ``(running, waiting)``."""
        while len(set(self.ran) | self.waiting | self.ended) < n:
            self.changed.clear()
            await self.changed.wait()
        return len(self.ran), len(self.waiting - set(self.ran))

    async def finish(self, tasks: list[asyncio.Task[Any]]) -> tuple[int, int]:
        """Open the gate and wait for every request: ``(charged, not charged)``."""
        self.gate.set()
        results = await asyncio.gather(*tasks)
        ok = sum(
            1 for i, r in enumerate(results) if r.error is None and r.text.endswith(f"charged {i}")
        )
        return ok, len(results) - ok


class BurstStore(RedisIdempotencyStore):
    """Tells its `Charges` which calls wait for a run held elsewhere (the amount is the
    last part of the call's operation id, ``op-<amount>``)."""

    charges: Charges | None = None

    async def _pause(self, key: str, seconds: float) -> None:
        if self.charges is not None:
            operation = str(_scope.current_operation())
            self.charges.waits(int(operation.rsplit("-", 1)[1]))
        await super()._pause(key, seconds)


def charges(url: str, namespace: str) -> Charges:
    # A generous timeout: a loaded test machine must not make Redis look down.
    store = BurstStore(url, namespace=namespace, timeout=5)
    store.charges = Charges(store)
    return store.charges


async def burst(url: str, namespace: str) -> None:
    loop = asyncio.get_running_loop()
    replica = charges(url, namespace)
    tasks: list[asyncio.Task[Any]] = []
    print("ready", flush=True)
    while True:
        command = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not command or command[0] == "quit":
            break
        if command[0] == "go":
            n = int(command[1])
            tasks = replica.start(n, command[2] == "1")
            started, waiting = await replica.settled(n)
            print(f"started {started} waiting {waiting}", flush=True)
        elif command[0] == "release":
            ok, failed = await replica.finish(tasks)
            ran = ",".join(map(str, replica.ran)) or "-"
            print(f"ok {ok} failed {failed} ran {ran}", flush=True)
        else:
            raise ValueError(f"unknown command {command[0]!r}")
    await replica.chat.aclose()
    await replica.store.aclose()


if __name__ == "__main__":
    if sys.argv[3] == "burst":
        asyncio.run(burst(*sys.argv[1:3]))
    else:
        asyncio.run(main(*sys.argv[1:4]))
