"""The response cache over a real redis-server: shared entries, one round trip per hit, a
thousand concurrent lookups, and Redis paused or killed under load."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from middleware.cache import CachingChatClient, RedisCacheStore
from pipeline import ChatPipeline, ChatResponse
from pipeline.testing import ScriptedChatClient, reply
from tests.redis_server import RedisServer, counting_client

TIMEOUT = 0.1


async def ask(chat: Any, text: str, streaming: bool) -> ChatResponse:
    if not streaming:
        return await chat.get_response(text)
    return ChatResponse.from_updates([u async for u in chat.get_streaming_response(text)])


def layer_of(chat: ChatPipeline) -> CachingChatClient:
    assert isinstance(chat.client, CachingChatClient)
    return chat.client


async def settle(chat: ChatPipeline) -> None:
    """Wait for the writes under way (they land beside the answers)."""
    layer = layer_of(chat)
    for _ in range(1000):
        if not layer._tasks:
            return
        await asyncio.gather(*list(layer._tasks), return_exceptions=True)


def cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "chat_pipeline.cache" and r.levelno == logging.WARNING
    ]


async def test_two_processes_share_entries(redis_url: str, streaming: bool) -> None:
    one = ScriptedChatClient(reply("from one", chunks=["from ", "one"]))
    two = ScriptedChatClient(reply("from two"))
    first = (
        ChatPipeline.builder()
        .use_cache(RedisCacheStore(redis_url, namespace=f"t1-{streaming}", timeout=5.0))
        .build(one)
    )
    second = (
        ChatPipeline.builder()
        .use_cache(RedisCacheStore(redis_url, namespace=f"t1-{streaming}", timeout=5.0))
        .build(two)
    )
    assert (await ask(first, f"shared {streaming}", streaming)).text == "from one"
    await settle(first)
    assert (await ask(second, f"shared {streaming}", streaming)).text == "from one"
    assert (one.call_count, two.call_count) == (1, 0)
    await first.aclose()
    await second.aclose()
    await layer_of(first).store.aclose()  # type: ignore[attr-defined]
    await layer_of(second).store.aclose()  # type: ignore[attr-defined]


async def test_a_hit_is_one_round_trip(redis_url: str, streaming: bool) -> None:
    client = counting_client(redis_url)
    store = RedisCacheStore(client, namespace=f"t2-{streaming}", timeout=5.0)
    inner = ScriptedChatClient("ok")
    chat = ChatPipeline.builder().use_cache(store).build(inner)
    await ask(chat, "q", streaming)
    await settle(chat)
    client.sent.clear()
    for _ in range(10):
        assert (await ask(chat, "q", streaming)).text == "ok"
    assert client.sent == ["MGET"] * 10
    assert inner.call_count == 1
    await store.aclose()
    await client.aclose()


async def test_a_tampered_entry_in_redis_is_a_miss_and_is_deleted(
    redis_url: str, streaming: bool
) -> None:
    namespace = f"t-tampered-{streaming}"
    store = RedisCacheStore(redis_url, namespace=namespace, timeout=5.0)
    inner = ScriptedChatClient([reply("first"), reply("second")])
    chat = ChatPipeline.builder().use_cache(store).build(inner)
    await ask(chat, "q", streaming)
    await settle(chat)
    client = redis_asyncio.from_url(redis_url)
    (key,) = await client.keys(f"{namespace}:*")
    entry = json.loads(await client.get(key))
    entry["t"] = float("nan")  # a time no request can age: every hit raised, before
    await client.set(key, json.dumps(entry))
    assert (await ask(chat, "q", streaming)).text == "second"  # a miss, no error
    await settle(chat)
    # The garbage was deleted and the new answer took its place.
    assert json.loads(await client.get(key))["t"] == pytest.approx(time.time(), abs=60)
    assert (await ask(chat, "q", streaming)).text == "second" and inner.call_count == 2
    await client.aclose()
    await store.aclose()


async def test_a_thousand_concurrent_lookups(redis_url: str, streaming: bool) -> None:
    client = counting_client(redis_url)
    store = RedisCacheStore(client, namespace=f"t3-{streaming}", timeout=5.0)
    inner = ScriptedChatClient(lambda messages, options: reply(f"re {messages[-1].text}"))
    chat = ChatPipeline.builder().use_cache(store).build(inner)
    texts = [f"question {i}" for i in range(1000)]
    misses = await asyncio.gather(*(ask(chat, text, streaming) for text in texts))
    await settle(chat)
    assert [r.text for r in misses] == [f"re {t}" for t in texts]
    client.sent.clear()
    hits = await asyncio.gather(*(ask(chat, text, streaming) for text in texts))
    assert [r.text for r in hits] == [f"re {t}" for t in texts]
    assert inner.call_count == 1000
    # One MGET per turn of the event loop, not one per lookup.
    assert 1 <= client.sent.count("MGET") <= 10
    await store.aclose()
    await client.aclose()


async def _load(chat: ChatPipeline, texts: list[str], streaming: bool) -> None:
    answers = await asyncio.gather(*(ask(chat, text, streaming) for text in texts))
    assert [response.text for response in answers] == [f"re {text}" for text in texts]


@pytest.mark.parametrize("outage", ["paused", "killed"])
async def test_redis_down_under_load_answers_every_request_as_a_miss(
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    streaming: bool,
    outage: str,
) -> None:
    caplog.set_level(logging.INFO, logger="chat_pipeline.cache")
    # A client of the caller's own: no socket timeout of its own, so only the store's bound
    # ends a call to a Redis that never answers; and it counts what reaches Redis.
    client = counting_client(redis_server.url)
    store = RedisCacheStore(client, timeout=TIMEOUT, retry_interval=60.0)
    inner = ScriptedChatClient(lambda messages, options: reply(f"re {messages[-1].text}"))
    chat = ChatPipeline.builder().use_cache(store).build(inner)
    texts = [f"q{i}" for i in range(200)]
    await _load(chat, texts, streaming)
    await settle(chat)
    assert inner.call_count == 200
    await _load(chat, texts, streaming)
    assert inner.call_count == 200  # all hits
    if outage == "paused":
        redis_server.pause()
    else:
        redis_server.stop()
    client.sent.clear()
    try:
        # A paused Redis never answers: every request of the first round is answered only
        # because the store's bound ends its lookup (the outer bound catches a hang).
        async with asyncio.timeout(60):
            await _load(chat, texts, streaming)
            await settle(chat)
            reached = len(client.sent)
            for _ in range(2):  # mid-outage: the store is skipped, Redis not even tried
                await _load(chat, texts, streaming)
            await settle(chat)
    finally:
        redis_server.resume()
    # Every request answered (as a miss); at most one lookup each in the first round (one
    # MGET per turn of the event loop), nothing after the first failure, no write at all.
    assert inner.call_count == 200 + 3 * 200
    assert 1 <= reached <= 200
    assert set(client.sent) == {"MGET"}
    assert len(client.sent) == reached
    assert len(cache_warnings(caplog)) == 1
    assert "Redis unavailable" in cache_warnings(caplog)[0]
    await chat.aclose()
    await store.aclose()
    await client.aclose()
