"""Fail over from an OpenAI-format route to an Anthropic route: a second vendor is a
boundary an outage of the first does not cross.

With ``OPENAI_API_KEY`` and ``ANTHROPIC_API_KEY`` set, it calls the real APIs (models from
``OPENAI_MODEL`` and ``ANTHROPIC_MODEL``). Without them it starts the library's fake servers
on 127.0.0.1 and makes the OpenAI one answer 529 (overloaded), so the answer streams from
the Anthropic route::

    python examples/cross_vendor_failover.py "Why fail over across vendors?"
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

from middleware.routing import OrderedFailoverChatClient, Route
from pipeline.providers import AnthropicChatClient, OpenAIChatClient
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse


@contextlib.asynccontextmanager
async def routes() -> AsyncIterator[list[Route]]:
    if os.environ.get("OPENAI_API_KEY") and os.environ.get("ANTHROPIC_API_KEY"):
        yield [
            Route("openai", OpenAIChatClient(os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))),
            Route(
                "anthropic",
                AnthropicChatClient(os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5")),
            ),
        ]
        return
    async with FakeOpenAIServer() as openai_fake, FakeAnthropicServer() as anthropic_fake:
        openai_fake.default = FakeResponse.error(529, message="overloaded")
        anthropic_fake.default = FakeResponse(text="Answered by the Anthropic route.")
        yield [
            Route(
                "openai", OpenAIChatClient("gpt-fake", api_key="x", base_url=openai_fake.base_url)
            ),
            Route(
                "anthropic",
                AnthropicChatClient("claude-fake", api_key="x", base_url=anthropic_fake.base_url),
            ),
        ]


async def main(question: str) -> str:
    async with routes() as both:
        chat = OrderedFailoverChatClient(both)
        async with chat:
            parts = []
            async for update in chat.get_streaming_response(question):
                print(update.text, end="", flush=True)
                parts.append(update.text)
            print()
            return "".join(parts)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "Why fail over across vendors?"))
