"""Another process running the same tool call, under the same operation, through Redis.

    python -m tests.middleware.idempotency_replica URL NAMESPACE OPERATION

Runs one request whose model asks for ``charge(amount=5)`` with a `RedisIdempotencyStore`
on URL under NAMESPACE. If the tool runs here it pushes ``replica`` onto the Redis list
``NAMESPACE:runs``. Prints ``waiting`` the first time its claim finds the call running in
another process, then ``result <the tool result>``.
"""

from __future__ import annotations

import asyncio
import sys

import redis.asyncio as redis_asyncio

from middleware.function_invocation import (
    FunctionInvokingChatClient,
    RedisIdempotencyStore,
    operation_scope,
    tool,
)
from pipeline import FunctionCallContent, FunctionResultContent
from pipeline.testing import ScriptedChatClient, call_tools, reply


class ReportingStore(RedisIdempotencyStore):
    """Says when it first waits for a claim held elsewhere."""

    waited = False

    async def _pause(self, seconds: float) -> None:
        if not self.waited:
            self.waited = True
            print("waiting", flush=True)
        await super()._pause(seconds)


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


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
