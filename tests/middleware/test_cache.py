"""The response cache layer: hits, what is never stored, scopes, modes, single flight,
telemetry, semantic lookups (with a deterministic fake encoder)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import typing
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from middleware.cache import (
    DEFAULT_IGNORE_FIELDS,
    CacheSettings,
    CachingChatClient,
    MemoryCacheStore,
    SemanticCacheSettings,
    cache_key,
)
from pipeline import (
    CacheMode,
    ChatMessage,
    ChatOptions,
    ChatPipeline,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    ReasoningContent,
    ReasoningOptions,
    UsageDetails,
)
from pipeline._cache_scope import CacheReport, enter_cache_report, exit_cache_report
from pipeline._retry_signal import signal_of as retry_signal_of
from pipeline.client import ChatClientMetadata
from pipeline.errors import RateLimitedError, ResponseValidationError, TransientProviderError
from pipeline.testing import ScriptedChatClient, call_tools, fail, fail_after, hang, reply
from pipeline.types import (
    ANTHROPIC_EXTRAS,
    OPENAI_RESPONSES_EXTRAS,
    Content,
    CustomTool,
    DataContent,
    FunctionResultContent,
    FunctionTool,
    TextContent,
)
from tests.otel import Otel

USAGE = UsageDetails(input_tokens=12, output_tokens=5, total_tokens=17)


async def ask(
    chat: Any, messages: Any, options: ChatOptions | None, streaming: bool
) -> tuple[ChatResponse, list[ChatResponseUpdate]]:
    if not streaming:
        return await chat.get_response(messages, options), []
    updates = [u async for u in chat.get_streaming_response(messages, options)]
    return ChatResponse.from_updates(updates), updates


def cached(inner: Any, **options: Any) -> ChatPipeline:
    return ChatPipeline.builder().use_cache(**options).build(inner)


def shape(updates: Sequence[ChatResponseUpdate]) -> list[tuple[Any, ...]]:
    return [
        (u.role, list(u.contents), u.response_id, u.model_id, u.finish_reason, u.usage)
        for u in updates
    ]


def answer(response: ChatResponse) -> tuple[Any, ...]:
    return (
        [(m.role, list(m.contents)) for m in response.messages],
        response.response_id,
        response.model_id,
        response.finish_reason,
        response.usage,
    )


# -- hits ------------------------------------------------------------------------------------


async def test_a_hit_returns_what_the_miss_returned(streaming: bool) -> None:
    inner = ScriptedChatClient(reply("hello there", chunks=["hel", "lo ", "there"], usage=USAGE))
    chat = cached(inner)
    first, first_updates = await ask(chat, "hi", None, streaming)
    second, second_updates = await ask(chat, "hi", None, streaming)
    assert inner.call_count == 1
    assert second.text == "hello there"
    assert answer(second) == answer(first)
    assert second.usage == USAGE and second.finish_reason == "stop"
    assert second.model_id == first.model_id is not None
    if streaming:
        assert len(second_updates) == 3
        assert shape(second_updates) == shape(first_updates)


async def test_tool_calls_and_reasoning_come_back_as_they_were(streaming: bool) -> None:
    call = FunctionCallContent("call_1", "get_weather", {"city": "Paris", "units": ["c"]})
    inner = ScriptedChatClient(call_tools(call, text="let me look"))
    chat = cached(inner)
    first, _ = await ask(chat, "weather?", None, streaming)
    second, _ = await ask(chat, "weather?", None, streaming)
    assert inner.call_count == 1
    assert second.finish_reason == "tool_calls"
    calls = [c for m in second.messages for c in m.contents if isinstance(c, FunctionCallContent)]
    assert calls == [call]
    assert answer(second) == answer(first)


async def test_an_entry_serves_the_other_call_shape() -> None:
    inner = ScriptedChatClient(reply("abc", chunks=["a", "b", "c"], usage=USAGE))
    chat = cached(inner)
    whole = await chat.get_response("q")
    updates = [u async for u in chat.get_streaming_response("q")]
    assert inner.call_count == 1
    assert ChatResponse.from_updates(updates).text == whole.text == "abc"
    assert ChatResponse.from_updates(updates).usage == USAGE


async def test_reasoning_contents_are_part_of_the_key() -> None:
    inner = ScriptedChatClient("ok")
    chat = cached(inner)
    history = [
        ChatMessage.user("hi"),
        ChatMessage.assistant([ReasoningContent("thought", protected="sig-a"), "hello"]),
        ChatMessage.user("and?"),
    ]
    other = [
        history[0],
        ChatMessage.assistant([ReasoningContent("thought", protected="sig-b"), "hello"]),
        history[2],
    ]
    await chat.get_response(history)
    await chat.get_response(other)
    await chat.get_response(history)
    assert inner.call_count == 2


# -- never stored ----------------------------------------------------------------------------


async def test_errors_are_not_stored(streaming: bool) -> None:
    inner = ScriptedChatClient([fail(TransientProviderError("down")), reply("ok")])
    chat = cached(inner)
    with pytest.raises(TransientProviderError):
        await ask(chat, "q", None, streaming)
    assert (await ask(chat, "q", None, streaming))[0].text == "ok"
    assert inner.call_count == 2


async def test_a_cut_stream_is_not_stored() -> None:
    inner = ScriptedChatClient([fail_after(["a", "b"], TransientProviderError("cut")), reply("ab")])
    chat = cached(inner)
    seen = []
    with pytest.raises(TransientProviderError):
        async for update in chat.get_streaming_response("q"):
            seen.append(update.text)
    assert seen == ["a", "b"]
    assert (await chat.get_response("q")).text == "ab"
    assert inner.call_count == 2


async def test_an_abandoned_stream_is_not_stored(streaming: bool) -> None:
    inner = ScriptedChatClient([hang(["a"]), reply("abc", chunks=["a", "b", "c"])])
    chat = cached(inner)
    stream = chat.get_streaming_response("q")
    assert (await anext(stream)).text == "a"
    await stream.aclose()
    assert (await ask(chat, "q", None, streaming))[0].text == "abc"
    assert inner.call_count == 2


async def test_a_cancelled_call_is_not_stored(streaming: bool) -> None:
    inner = ScriptedChatClient([hang(), reply("ok")])
    chat = cached(inner)
    task = asyncio.ensure_future(ask(chat, "q", None, streaming))
    async with asyncio.timeout(10):
        await inner.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await ask(chat, "q", None, streaming))[0].text == "ok"
    assert inner.call_count == 2


async def test_a_response_rejected_by_validation_beneath_is_not_stored(streaming: bool) -> None:
    inner = ScriptedChatClient([reply("not json"), reply('{"a": 1}')])
    chat = (
        ChatPipeline.builder()
        .use_cache()
        .use_response_validation({"type": "object"}, buffer_streams=True)
        .build(inner)
    )
    with pytest.raises(ResponseValidationError):
        await ask(chat, "q", None, streaming)
    assert (await ask(chat, "q", None, streaming))[0].text == '{"a": 1}'
    assert (await ask(chat, "q", None, streaming))[0].text == '{"a": 1}'
    assert inner.call_count == 2


@pytest.mark.parametrize(
    ("finish_reason", "stored"),
    [("stop", True), ("length", True), ("content_filter", False), ("weird", False)],
)
async def test_only_some_finish_reasons_are_stored(
    streaming: bool, finish_reason: str, stored: bool
) -> None:
    inner = ScriptedChatClient(reply("x", finish_reason=finish_reason))
    chat = cached(inner)
    await ask(chat, "q", None, streaming)
    await ask(chat, "q", None, streaming)
    assert inner.call_count == (1 if stored else 2)


async def test_finish_reasons_are_configurable(streaming: bool) -> None:
    inner = ScriptedChatClient(reply("x", finish_reason="content_filter"))
    chat = cached(inner, finish_reasons={"stop", "content_filter"})
    await ask(chat, "q", None, streaming)
    await ask(chat, "q", None, streaming)
    assert inner.call_count == 1


# -- scopes and keys -------------------------------------------------------------------------


async def test_entries_never_cross_scopes(streaming: bool) -> None:
    inner = ScriptedChatClient(lambda messages, options: reply(f"answer {len(inner.calls)}"))
    chat = cached(inner, per_session=True, scope=lambda messages, options: options.seed and "s")
    tool_a = {"type": "function", "function": {"name": "a", "parameters": {}}}
    tool_b = {"type": "function", "function": {"name": "b", "parameters": {}}}
    variants: list[tuple[Any, ChatOptions | None, str | None]] = [
        ("q", None, None),
        ("q", None, "key:1"),  # another gateway key
        ("q", ChatOptions(session_id="s1"), None),
        ("q", ChatOptions(session_id="s2"), None),
        ([ChatMessage.system("be brief"), ChatMessage.user("q")], None, None),
        ([ChatMessage.system("be long"), ChatMessage.user("q")], None, None),
        ("q", ChatOptions(tools=[tool_a]), None),
        ("q", ChatOptions(tools=[tool_b]), None),
        ("q", ChatOptions(temperature=0.0), None),
        ("q", ChatOptions(temperature=1.0), None),
        ("q", ChatOptions(model_id="big"), None),
        ("q", ChatOptions(seed=1), None),  # the scope function's value
        ("q", ChatOptions(additional_properties={"x": 1}), None),
    ]
    rounds: list[list[str]] = [[], []]
    for texts in rounds:
        for messages, options, partition in variants:
            token = enter_cache_report(CacheReport(partition))
            try:
                response, _ = await ask(chat, messages, options, streaming)
            finally:
                exit_cache_report(token)
            texts.append(response.text)
    assert inner.call_count == len(variants)
    assert len(set(rounds[0])) == len(variants)
    assert rounds[1] == rounds[0]


def test_keys_are_hashes_and_see_every_option() -> None:
    base = cache_key("secret prompt", ChatOptions(temperature=0.5))
    assert len(base) == 64 and "secret" not in base
    assert base == cache_key("secret prompt", ChatOptions(temperature=0.5))
    assert base != cache_key("secret prompt", ChatOptions(temperature=0.6))
    assert base != cache_key("secret prompt", ChatOptions(temperature=0.5), scope="k")
    # Cache mode and session are not the answer's: the same key.
    assert base == cache_key("secret prompt", ChatOptions(temperature=0.5, cache=CacheMode.USE))
    assert base == cache_key("secret prompt", ChatOptions(temperature=0.5, session_id="s"))
    assert base != cache_key(
        "secret prompt", ChatOptions(temperature=0.5, session_id="s"), per_session=True
    )


async def test_an_option_the_key_cannot_represent_bypasses(otel: Otel) -> None:
    inner = ScriptedChatClient("ok")
    chat = ChatPipeline.builder(**otel.providers).use_cache().build(inner)
    odd = ChatOptions(additional_properties={"x": object()})
    await chat.get_response("q", odd)
    await chat.get_response("q", odd)
    assert inner.call_count == 2
    assert (
        otel.total("chat_pipeline.cache.lookups", **{"chat_pipeline.cache.result": "bypass"}) == 2
    )


# -- ttl and bounds --------------------------------------------------------------------------


async def test_entries_expire_after_their_ttl(streaming: bool) -> None:
    now = [0.0]
    store = MemoryCacheStore(clock=lambda: now[0])
    inner = ScriptedChatClient("ok")
    chat = cached(inner, store=store, ttl=10.0)
    await ask(chat, "q", None, streaming)
    now[0] = 9.9
    await ask(chat, "q", None, streaming)
    assert inner.call_count == 1
    now[0] = 10.0
    await ask(chat, "q", None, streaming)
    assert inner.call_count == 2


async def test_the_memory_store_holds_its_byte_bound() -> None:
    store = MemoryCacheStore(max_bytes=4000)
    for i in range(100):
        await store.set(f"k{i}", b"x" * 500, 60)
        assert store.bytes <= 4000
    assert len(store) == 7  # 7 x (2-3 + 500 + 64) bytes fit
    assert await store.get("k0") is None
    assert await store.get("k99") == b"x" * 500
    await store.set("big", b"x" * 5000, 60)
    assert await store.get("big") is None
    # Least recently used first out: a read keeps an entry.
    await store.get("k93")
    await store.set("new", b"y" * 500, 60)
    assert await store.get("k93") is not None
    assert await store.get("k94") is None


async def test_large_answers_are_not_stored(streaming: bool) -> None:
    inner = ScriptedChatClient(reply("x" * 5000))
    chat = cached(inner, max_entry_bytes=1000)
    await ask(chat, "q", None, streaming)
    await ask(chat, "q", None, streaming)
    assert inner.call_count == 2


# -- modes -----------------------------------------------------------------------------------


async def test_refresh_calls_and_stores_the_new_answer(streaming: bool) -> None:
    inner = ScriptedChatClient([reply("old"), reply("new")])
    chat = cached(inner)
    assert (await ask(chat, "q", None, streaming))[0].text == "old"
    refreshed = await ask(chat, "q", ChatOptions(cache=CacheMode.REFRESH), streaming)
    assert refreshed[0].text == "new"
    assert (await ask(chat, "q", None, streaming))[0].text == "new"
    assert inner.call_count == 2


async def test_bypass_calls_and_stores_nothing(streaming: bool) -> None:
    inner = ScriptedChatClient([reply("first"), reply("second"), reply("third")])
    chat = cached(inner)
    bypass = ChatOptions(cache=CacheMode.BYPASS)
    assert (await ask(chat, "q", bypass, streaming))[0].text == "first"
    assert (await ask(chat, "q", None, streaming))[0].text == "second"
    assert (await ask(chat, "q", bypass, streaming))[0].text == "third"
    assert (await ask(chat, "q", None, streaming))[0].text == "second"
    assert inner.call_count == 3


# -- single flight ---------------------------------------------------------------------------


class Gate:
    """A scripted client's sleep that waits until the test opens the gate."""

    def __init__(self) -> None:
        self.open = asyncio.Event()

    async def sleep(self, _: float) -> None:
        await self.open.wait()


async def wait_for(condition: Any) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def listeners(chat: ChatPipeline) -> int:
    layer = chat.client
    assert isinstance(layer, CachingChatClient)
    # A non-streaming flight's leader calls in its own task: it is no listener.
    return sum(flight.listeners + (not flight.streaming) for flight in layer._flights.values())


async def test_a_hundred_identical_requests_make_one_call(streaming: bool) -> None:
    gate = Gate()
    inner = ScriptedChatClient(
        reply("shared", chunks=["sha", "red"], delay=1.0, usage=USAGE), sleep=gate.sleep
    )
    chat = cached(inner)
    tasks = [asyncio.ensure_future(ask(chat, "q", None, streaming)) for _ in range(100)]
    await wait_for(lambda: listeners(chat) == 100)
    gate.open.set()
    results = await asyncio.gather(*tasks)
    assert inner.call_count == 1
    assert all(response.text == "shared" for response, _ in results)
    assert all(response.usage == USAGE for response, _ in results)
    if streaming:
        assert all(len(updates) == 2 for _, updates in results)


async def test_followers_call_again_when_the_leaders_call_fails(streaming: bool) -> None:
    gate = Gate()
    inner = ScriptedChatClient(
        [fail(TransientProviderError("down"), delay=1.0), reply("ok")], sleep=gate.sleep
    )
    chat = cached(inner)
    tasks = [asyncio.ensure_future(ask(chat, "q", None, streaming)) for _ in range(100)]
    await wait_for(lambda: listeners(chat) == 100)
    gate.open.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert len(failures) == 1 and isinstance(failures[0], TransientProviderError)
    assert [r[0].text for r in results if not isinstance(r, BaseException)] == ["ok"] * 99
    assert inner.call_count == 2


async def test_every_request_of_a_flight_hears_what_every_route_said(streaming: bool) -> None:
    # The failure a waiting request gets is another request's: it carries every attempt's
    # word all the same (a gateway answers each of them with the earliest wait).
    gate = Gate()
    limited = ScriptedChatClient(
        fail(RateLimitedError(retry_after=30.0), delay=1.0), sleep=gate.sleep, name="a"
    )
    down = ScriptedChatClient(fail(TransientProviderError("down")), name="b")
    chat = ChatPipeline.builder().use_cache().use_ordered_failover([limited, down]).build()
    tasks = [asyncio.ensure_future(ask(chat, "q", None, streaming)) for _ in range(100)]
    await wait_for(lambda: listeners(chat) == 100)
    gate.open.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, TransientProviderError) for r in results)
    waits = [retry_signal_of(r).wait() for r in results if isinstance(r, BaseException)]
    assert len(waits) == 100 and all(w is not None and 29.0 <= w <= 30.0 for w in waits)


async def test_a_cancelled_leader_does_not_fail_its_followers(streaming: bool) -> None:
    gate = Gate()
    inner = ScriptedChatClient(reply("ok", chunks=["o", "k"], delay=1.0), sleep=gate.sleep)
    chat = cached(inner)
    leader = asyncio.ensure_future(ask(chat, "q", None, streaming))
    await wait_for(lambda: listeners(chat) == 1)
    followers = [asyncio.ensure_future(ask(chat, "q", None, streaming)) for _ in range(10)]
    await wait_for(lambda: listeners(chat) == 11)
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    gate.open.set()
    results = await asyncio.gather(*followers)
    assert [r[0].text for r in results] == ["ok"] * 10
    # Streaming: the call runs on for the followers; not streaming: the leader's call was
    # its own, and one follower calls again for all of them.
    assert inner.call_count == (1 if streaming else 2)


async def test_a_followers_own_deadline_holds(streaming: bool) -> None:
    gate = Gate()
    inner = ScriptedChatClient(reply("ok", delay=1.0), sleep=gate.sleep)
    chat = cached(inner)
    leader = asyncio.ensure_future(ask(chat, "q", None, streaming))
    await wait_for(lambda: listeners(chat) == 1)

    async def impatient() -> Any:
        async with asyncio.timeout(0.01):
            return await ask(chat, "q", None, streaming)

    with pytest.raises(TimeoutError):
        await impatient()
    assert not leader.done()
    gate.open.set()
    assert (await leader)[0].text == "ok"
    assert inner.call_count == 1


async def test_when_every_listener_leaves_the_call_is_cancelled(streaming: bool) -> None:
    inner = ScriptedChatClient([hang(), reply("ok")])
    chat = cached(inner)
    task = asyncio.ensure_future(ask(chat, "q", None, streaming))
    await wait_for(lambda: inner.call_count == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    layer = chat.client
    assert isinstance(layer, CachingChatClient)
    await wait_for(lambda: not layer._tasks)
    assert inner.streams_closed == (1 if streaming else 0)
    assert (await ask(chat, "q", None, streaming))[0].text == "ok"


async def test_without_single_flight_each_request_calls(streaming: bool) -> None:
    gate = Gate()
    inner = ScriptedChatClient(reply("ok", delay=1.0), sleep=gate.sleep)
    chat = cached(inner, single_flight=False)
    tasks = [asyncio.ensure_future(ask(chat, "q", None, streaming)) for _ in range(5)]
    await wait_for(lambda: inner.call_count == 5)
    gate.open.set()
    await asyncio.gather(*tasks)
    await ask(chat, "q", None, streaming)
    assert inner.call_count == 5


# -- telemetry -------------------------------------------------------------------------------


async def test_results_on_the_request_span_and_the_lookup_metric(
    otel: Otel, streaming: bool
) -> None:
    inner = ScriptedChatClient("ok")
    chat = ChatPipeline.builder(**otel.providers).use_telemetry().use_cache().build(inner)
    await ask(chat, "q", None, streaming)
    await ask(chat, "q", None, streaming)
    await ask(chat, "q", ChatOptions(cache=CacheMode.REFRESH), streaming)
    await ask(chat, "q", ChatOptions(cache=CacheMode.BYPASS), streaming)
    results = [s.attributes.get("chat_pipeline.cache.result") for s in otel.finished()]
    assert results == ["miss", "hit", "refresh", "bypass"]
    assert {s.attributes.get("chat_pipeline.cache.kind") for s in otel.finished()} == {"exact"}
    for result in ("miss", "hit", "refresh", "bypass"):
        assert (
            otel.total("chat_pipeline.cache.lookups", **{"chat_pipeline.cache.result": result}) == 1
        )


async def test_hits_count_the_cost_they_saved(otel: Otel, streaming: bool) -> None:
    from middleware.routing import Price, Route

    inner = ScriptedChatClient(reply("ok", usage=USAGE))
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_cache()
        .use_ordered_failover([Route("priced", inner, price=Price(1.0, 2.0))])
        .build()
    )
    await ask(chat, "q", None, streaming)
    await ask(chat, "q", None, streaming)
    await ask(chat, "q", None, streaming)
    saved = otel.total("chat_pipeline.cache.saved_cost", **{"chat_pipeline.route.name": "priced"})
    assert saved == pytest.approx(2 * (12 * 1.0 + 5 * 2.0) / 1_000_000)


async def test_no_content_reaches_spans_metrics_or_logs(
    otel: Otel, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    canary = "CANARY-7f3a"

    class Broken:
        async def get(self, key: str) -> bytes | None:
            raise RuntimeError(f"{canary} {key}")

        async def set(self, key: str, value: bytes, ttl: float) -> None:
            raise RuntimeError(canary)

    inner = ScriptedChatClient(reply(f"answer {canary}"))
    caplog.set_level(logging.DEBUG)
    for store in (None, Broken()):
        chat = (
            ChatPipeline.builder(**otel.providers)
            .use_telemetry()
            .use_cache(store, scope=lambda m, o: canary)
            .build(inner)
        )
        for _ in range(2):
            await ask(chat, f"question {canary}", ChatOptions(session_id=canary), streaming)
    exported = " ".join(otel.everything_exported())
    assert "chat_pipeline.cache.result" in exported
    assert canary not in exported
    assert canary not in caplog.text
    assert "response cache store (Broken) unavailable (RuntimeError)" in caplog.text


# -- semantic --------------------------------------------------------------------------------


class WordsEncoder:
    """A deterministic encoder: a bag of words hashed into 64 dimensions (after folding a
    few synonyms), so paraphrases score high and different questions low."""

    SYNONYMS: ClassVar[dict[str, str]] = {
        "capital": "capital",
        "city": "capital",
        "main": "capital",
    }

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, values: Sequence[str]) -> Any:
        self.calls += 1
        rows = np.zeros((len(values), 64), dtype=np.float32)
        for row, text in enumerate(values):
            for word in text.lower().replace("?", "").split():
                if word in {"what", "is", "the", "of", "which"}:
                    continue
                word = self.SYNONYMS.get(word, word)
                rows[row, sum(map(ord, word)) % 64] += 1.0
        return rows

    async def aclose(self) -> None:
        return None


async def test_a_paraphrase_is_a_semantic_hit(otel: Otel, streaming: bool) -> None:
    inner = ScriptedChatClient(lambda messages, options: reply(f"about {messages[-1].text}"))
    encoder = WordsEncoder()
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_cache(semantic=SemanticCacheSettings(embeddings=encoder, threshold=0.9))
        .build(inner)
    )
    first, _ = await ask(chat, "What is the capital of France?", None, streaming)
    second, _ = await ask(chat, "Which city is the capital of France", None, streaming)
    third, _ = await ask(chat, "What is the capital of Spain?", None, streaming)
    assert inner.call_count == 2
    assert second.text == first.text
    assert third.text != first.text
    spans = otel.finished()
    assert [s.attributes.get("chat_pipeline.cache.kind") for s in spans] == ["semantic"] * 3
    assert [s.attributes.get("chat_pipeline.cache.result") for s in spans] == [
        "miss",
        "hit",
        "miss",
    ]
    assert spans[1].attributes["chat_pipeline.cache.similarity"] >= 0.9


async def test_semantic_entries_never_cross_system_prompts_or_options(streaming: bool) -> None:
    inner = ScriptedChatClient(lambda messages, options: reply(f"answer {len(inner.calls)}"))
    chat = cached(inner, semantic=SemanticCacheSettings(embeddings=WordsEncoder(), threshold=0.9))
    await ask(chat, "capital of France", None, streaming)
    await ask(
        chat, [ChatMessage.system("pirate"), ChatMessage.user("capital of France")], None, streaming
    )
    await ask(chat, "capital of France?", ChatOptions(temperature=1.0), streaming)
    token = enter_cache_report(CacheReport("another key"))
    try:
        await ask(chat, "capital of France", None, streaming)
    finally:
        exit_cache_report(token)
    assert inner.call_count == 4
    await ask(chat, "main city of France", None, streaming)
    assert inner.call_count == 4


async def test_an_embedding_failure_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    class Failing:
        async def generate(self, values: Sequence[str]) -> Any:
            raise RuntimeError("boom")

        async def aclose(self) -> None:
            return None

    inner = ScriptedChatClient("ok")
    chat = cached(inner, semantic=Failing())
    await chat.get_response("q one")
    await chat.get_response("q two")
    await chat.get_response("q one")
    assert inner.call_count == 2
    assert caplog.text.count("semantic cache embeddings unavailable") == 1


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="ttl"):
        CacheSettings(ttl=0)
    with pytest.raises(ValueError, match="threshold"):
        SemanticCacheSettings(embeddings=WordsEncoder(), threshold=1.5)
    with pytest.raises(ValueError, match="max_bytes"):
        MemoryCacheStore(max_bytes=0)
    with pytest.raises(TypeError, match="store"):
        ChatPipeline.builder().use_cache(object())
    assert ChatPipeline.builder().use_cache().build(ScriptedChatClient()).describe()[0] == (
        "CachingChatClient(MemoryCacheStore)"
    )


# -- entries: every content type, exactly ------------------------------------------------------


class Fixed:
    """A client answering one given response (streamed: its updates)."""

    metadata = ChatClientMetadata(provider_name="fixed", model_id="m", name="fixed")

    def __init__(self, response: ChatResponse) -> None:
        self.response = response
        self.call_count = 0

    async def get_response(self, messages: Any, options: Any = None) -> ChatResponse:
        self.call_count += 1
        return self.response

    async def get_streaming_response(self, messages: Any, options: Any = None) -> Any:
        self.call_count += 1
        for update in self.response.to_updates():
            yield update

    async def aclose(self) -> None:
        return None


SAMPLES: dict[type, tuple[Any, ...]] = {
    TextContent: (TextContent("text"),),
    FunctionCallContent: (
        FunctionCallContent.custom_call("call_1", "apply_patch", "*** Begin"),
        FunctionCallContent("call_2", "get_weather", {"city": "Paris", "units": ["c"]}),
    ),
    FunctionResultContent: (FunctionResultContent("call_1", result={"ok": [1, 2]}),),
    DataContent: (
        DataContent(data=b"\x00\xffbytes", media_type="image/png"),
        DataContent(uri="https://example.com/a.png"),
    ),
    ReasoningContent: (
        ReasoningContent("thought", protected="sig", id="rs_1", redacted=True),
        ReasoningContent("", protected="opaque"),
    ),
}
"""Instances of every content class, each field away from its default in one of them (a
field the cache entry left out would come back as its default)."""


def test_every_content_class_has_samples_with_every_field_set() -> None:
    # A new content class (or a new field) fails here until it has a sample: then the
    # round trip below covers it.
    assert set(SAMPLES) == set(typing.get_args(Content))
    for kind, samples in SAMPLES.items():
        for field in dataclasses.fields(kind):
            if field.name == "exception":
                continue  # an exception is never stored (the answer is not cached)
            default = (
                field.default_factory()
                if field.default_factory is not dataclasses.MISSING
                else field.default
            )
            assert any(getattr(s, field.name) != default for s in samples), (kind, field.name)


@pytest.mark.parametrize(
    "content",
    [sample for samples in SAMPLES.values() for sample in samples],
    ids=lambda content: type(content).__name__,
)
async def test_every_content_type_comes_back_exactly(streaming: bool, content: Any) -> None:
    message = ChatMessage(
        ChatRole.ASSISTANT,
        [content],
        author_name="bot",
        additional_properties={"cache_control": {"type": "ephemeral"}},
    )
    original = ChatResponse(
        messages=[message],
        response_id="r1",
        model_id="served",
        finish_reason="tool_calls",
        usage=UsageDetails(1, 2, 3, 4, 5, 6),
    )
    inner = Fixed(original)
    chat = cached(inner)
    await ask(chat, "q", None, streaming)
    hit, _ = await ask(chat, "q", None, streaming)
    other, _ = await ask(chat, "q", None, not streaming)  # the other shape, the same entry
    assert inner.call_count == 1
    for got in (hit, other):
        assert got.messages[0].contents == [content]
        assert type(got.messages[0].contents[0]) is type(content)
        assert (got.response_id, got.model_id, got.finish_reason) == ("r1", "served", "tool_calls")
        assert got.usage == UsageDetails(1, 2, 3, 4, 5, 6)
    if not streaming:
        assert hit.messages[0].author_name == "bot"
        assert hit.messages[0].additional_properties == {"cache_control": {"type": "ephemeral"}}


async def test_a_custom_tool_call_stays_custom(streaming: bool) -> None:
    call = FunctionCallContent.custom_call("call_1", "apply_patch", "*** Begin Patch")
    inner = ScriptedChatClient(call_tools(call))
    chat = cached(inner)
    await ask(chat, "patch it", None, streaming)
    hit, _ = await ask(chat, "patch it", None, streaming)
    assert inner.call_count == 1
    (got,) = [c for m in hit.messages for c in m.contents if isinstance(c, FunctionCallContent)]
    assert got.custom and got.input_text == "*** Begin Patch"


def test_a_custom_call_and_a_json_call_are_different_keys() -> None:
    custom = FunctionCallContent.custom_call("c1", "apply_patch", "x")
    plain = FunctionCallContent("c1", "apply_patch", {"input": "x"})
    history = [ChatMessage.user("q"), ChatMessage.assistant([custom])]
    other = [ChatMessage.user("q"), ChatMessage.assistant([plain])]
    assert cache_key(history) != cache_key(other)


def test_a_custom_tools_grammar_and_a_tools_extra_fields_are_in_the_key() -> None:
    lark = {"type": "grammar", "syntax": "lark", "definition": "start: /a+/"}
    other = {"type": "grammar", "syntax": "lark", "definition": "start: /b+/"}
    keys = {
        cache_key("q", ChatOptions(tools=[CustomTool("exec", "run", lark)])),
        cache_key("q", ChatOptions(tools=[CustomTool("exec", "run", other)])),
        cache_key("q", ChatOptions(tools=[CustomTool("exec", "run", None)])),
        # A function tool of the same name and schema is offered as another kind of tool.
        cache_key(
            "q", ChatOptions(tools=[FunctionTool("exec", "run", CustomTool("exec").parameters)])
        ),
    }
    assert len(keys) == 4
    strict = FunctionTool("f", "d", {"type": "object"}, {"messages": {"strict": True}})
    loose = FunctionTool("f", "d", {"type": "object"}, {})
    cached_tool = FunctionTool("f", "d", {"type": "object"}, {"messages": {"cache_control": {}}})
    assert cache_key("q", ChatOptions(tools=[strict])) != cache_key("q", ChatOptions(tools=[loose]))
    # A prompt-cache breakpoint changes the bill, not the answer.
    assert cache_key("q", ChatOptions(tools=[cached_tool])) == cache_key(
        "q", ChatOptions(tools=[loose])
    )


async def test_requests_differing_in_a_grammar_do_not_share_an_entry(streaming: bool) -> None:
    inner = ScriptedChatClient("ok")
    chat = cached(inner)
    for definition in ("start: /a+/", "start: /b+/", "start: /a+/"):
        grammar = {"type": "grammar", "syntax": "lark", "definition": definition}
        await ask(chat, "q", ChatOptions(tools=[CustomTool("exec", None, grammar)]), streaming)
    assert inner.call_count == 2


# -- entries that do not decode ----------------------------------------------------------------


def tamper(entry: bytes, change: Any) -> bytes:
    body = json.loads(entry)
    change(body)
    return json.dumps(body).encode()


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def change(body: Any) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


TAMPERED = {
    "nan-time": _set(("t",), float("nan")),
    "infinite-time": _set(("t",), float("inf")),
    "string-time": _set(("t",), "1700000000"),
    "usage-as-strings": _set(("r", 3), ["12", "5", "17", None, None, None]),
    "usage-as-floats": _set(("r", 3), [12.5, 5.0, 17.0, None, None, None]),
    "negative-usage": _set(("r", 3), [-1, 5, 17, None, None, None]),
    "bool-usage": _set(("r", 3), [True, 5, 17, None, None, None]),
    "short-usage": _set(("r", 3), [12, 5]),
    "nan-cost": _set(("c",), float("nan")),
    "number-as-text": _set(("m", 0, 1, 0, 1), 42),
    "unknown-role": _set(("m", 0, 0), "wizard"),
    "unknown-content": _set(("m", 0, 1, 0, 0), "?"),
    "flag-as-string": _set(("m", 0, 1, 1, 4), "yes"),
    "arguments-as-list": _set(("m", 0, 1, 1, 3), [1]),
    "model-as-number": _set(("r", 1), 7),
    "no-messages": _set(("m",), None),
    "old-version": _set(("v",), 1),
    "not-an-object": lambda body: body.clear(),
}


@pytest.mark.parametrize("how", list(TAMPERED))
async def test_a_tampered_entry_is_a_miss_and_is_deleted(streaming: bool, how: str) -> None:
    call = FunctionCallContent("c1", "f", {"a": 1})
    inner = ScriptedChatClient(
        [
            call_tools(call, text="hi"),
            call_tools(FunctionCallContent("c2", "g", {"b": 2}), text="again"),
        ]
    )
    # Stored by the non-streaming call shape, so every field above is there to tamper with.
    store = MemoryCacheStore()
    chat = cached(inner, store=store)
    first = await chat.get_response("q")
    first.usage = USAGE
    ((key, (raw, _)),) = store._entries.items()
    store._entries[key] = (tamper(raw, TAMPERED[how]), float("inf"))
    answer_, _ = await ask(chat, "q", None, streaming)  # no error, no wrong value: a miss
    assert inner.call_count == 2
    assert answer_.text == "again"
    # The garbage is gone: the new answer took its place, and is what comes back now.
    hit, _ = await ask(chat, "q", None, streaming)
    assert inner.call_count == 2 and hit.text == "again"


async def test_a_tampered_entry_in_a_store_of_your_own_is_deleted(streaming: bool) -> None:
    class Own:
        def __init__(self) -> None:
            self.entries: dict[str, bytes] = {}
            self.deleted: list[str] = []

        async def get(self, key: str) -> bytes | None:
            return self.entries.get(key)

        async def set(self, key: str, value: bytes, ttl: float) -> None:
            self.entries[key] = value

        async def delete(self, key: str) -> None:
            self.deleted.append(key)
            self.entries.pop(key, None)

    store = Own()
    inner = ScriptedChatClient(reply("ok", usage=USAGE))
    chat = cached(inner, store=store)
    await ask(chat, "q", None, streaming)
    layer = chat.client
    assert isinstance(layer, CachingChatClient)
    await wait_for(lambda: bool(store.entries) and not layer._tasks)
    ((key, raw),) = store.entries.items()
    store.entries[key] = tamper(raw, _set(("t",), float("nan")))
    await ask(chat, "q", None, streaming)
    await wait_for(lambda: not layer._tasks)
    assert store.deleted == [key] and inner.call_count == 2


# -- single flight: one way out ----------------------------------------------------------------


async def test_a_stream_nobody_listens_to_is_closed_whoever_left_last() -> None:
    # A streamed leader and a non-streamed follower both leave (the follower last): the
    # provider stream is closed, nobody joins the orphan, and closing the layer is prompt.
    inner = ScriptedChatClient([hang(), reply("fresh")])
    chat = cached(inner)
    layer = chat.client
    assert isinstance(layer, CachingChatClient)
    leader = asyncio.ensure_future(ask(chat, "q", None, True))
    await wait_for(lambda: inner.call_count == 1)
    follower = asyncio.ensure_future(ask(chat, "q", None, False))
    await wait_for(lambda: listeners(chat) == 2)
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert listeners(chat) == 1 and inner.streams_closed == 0  # the follower still listens
    follower.cancel()
    with pytest.raises(asyncio.CancelledError):
        await follower
    await wait_for(lambda: not layer._tasks)
    assert inner.streams_closed == 1 and not layer._flights
    later, _ = await ask(chat, "q", None, False)
    assert later.text == "fresh" and inner.call_count == 2
    async with asyncio.timeout(5):
        await chat.aclose()


async def test_a_thousand_identical_requests_with_cancels_and_deadlines_leave_nothing() -> None:
    # Half streamed, half not; a third cancelled at random moments, a third with deadlines
    # shorter than the call: every request ends, every provider stream is closed, and no
    # flight or task is left.
    rng = random.Random(20261206)
    gate = Gate()
    inner = ScriptedChatClient(
        reply("shared", chunks=["sha", "red"], delay=1.0, usage=USAGE), sleep=gate.sleep
    )
    chat = cached(inner)
    layer = chat.client
    assert isinstance(layer, CachingChatClient)

    async def one(index: int) -> str:
        streaming = index % 2 == 0
        if index % 3 == 1:
            async with asyncio.timeout(0):  # a deadline that passed: the request leaves
                return (await ask(chat, "q", None, streaming))[0].text
        return (await ask(chat, "q", None, streaming))[0].text

    tasks = [asyncio.ensure_future(one(i)) for i in range(1000)]
    for _ in range(50):
        await asyncio.sleep(0)
        for task in rng.sample(tasks, 7):
            task.cancel()
    gate.open.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    answered = [r for r in results if r == "shared"]
    left = [r for r in results if isinstance(r, asyncio.CancelledError | TimeoutError)]
    assert len(answered) + len(left) == 1000 and answered
    await wait_for(lambda: not layer._tasks)
    assert not layer._flights
    assert inner.streams_opened == inner.streams_closed
    async with asyncio.timeout(5):
        await chat.aclose()


# -- semantic candidates: memory follows what is held --------------------------------------------


class Wide:
    """An encoder of 1,536 dimensions (as OpenAI's small embedding model): a vector per
    text from its hash."""

    async def generate(self, values: Sequence[str]) -> Any:
        return np.stack(
            [
                np.random.default_rng(abs(hash(text)) % 2**32).standard_normal(1536)
                for text in values
            ]
        ).astype(np.float32)

    async def aclose(self) -> None:
        return None


async def test_one_answer_conversations_hold_one_vector_each() -> None:
    inner = ScriptedChatClient("ok")
    store = MemoryCacheStore(max_bytes=256 << 20)
    chat = cached(inner, store=store, semantic=SemanticCacheSettings(embeddings=Wide()))
    layer = chat.client
    assert isinstance(layer, CachingChatClient)
    for i in range(2000):
        # Each a conversation of its own (its system prompt): a partition per answer.
        await chat.get_response([ChatMessage.system(f"user {i}"), ChatMessage.user("hello")])
    vectors = 2000 * 1536 * 4  # 12 MB of vectors
    held = sum(index._rows.nbytes for index in layer._partitions.values())
    assert held == vectors  # one row each, none reserved
    # Counted in the store's bound, with the keys and the bookkeeping.
    assert vectors < layer._candidate_bytes < vectors * 1.2
    assert store.bytes <= store.max_bytes
    assert store.bytes >= layer._candidate_bytes


async def test_candidates_count_in_the_memory_stores_byte_bound() -> None:
    inner = ScriptedChatClient(reply("x" * 2000))
    store = MemoryCacheStore(max_bytes=1 << 20)
    chat = cached(inner, store=store, semantic=SemanticCacheSettings(embeddings=Wide()))
    layer = chat.client
    assert isinstance(layer, CachingChatClient)
    for i in range(1000):  # 6 MB of vectors against a 1 MiB bound
        await chat.get_response([ChatMessage.system(f"user {i}"), ChatMessage.user("hello")])
        assert store.bytes <= store.max_bytes
        assert layer._candidate_bytes <= store.max_bytes
    assert 0 < len(layer._partitions) < 1000  # the oldest went out
    # The newest conversations are still found by meaning.
    again = await chat.get_response([ChatMessage.system("user 999"), ChatMessage.user("hello")])
    assert again.text == "x" * 2000 and inner.call_count == 1000


async def test_candidates_have_a_byte_bound_of_their_own_beside_any_store() -> None:
    inner = ScriptedChatClient("ok")
    semantic = SemanticCacheSettings(embeddings=Wide(), max_bytes=1 << 20)
    store = MemoryCacheStore(max_bytes=64 << 20)
    chat = cached(inner, store=store, semantic=semantic)
    layer = chat.client
    assert isinstance(layer, CachingChatClient)
    for i in range(500):
        await chat.get_response([ChatMessage.system(f"user {i}"), ChatMessage.user("hello")])
        assert layer._candidate_bytes <= 1 << 20
    held = sum(index.nbytes for index in layer._partitions.values())
    assert held <= 1 << 20 and len(layer._partitions) > 100


# -- what the key leaves out, and partitions ---------------------------------------------------


@pytest.mark.parametrize("field", sorted(DEFAULT_IGNORE_FIELDS))
@pytest.mark.parametrize("where", ["top", ANTHROPIC_EXTRAS, OPENAI_RESPONSES_EXTRAS])
def test_each_field_that_cannot_change_the_answer_changes_no_key(field: str, where: str) -> None:
    def options(value: Any) -> ChatOptions:
        extras: dict[str, Any] = {"top_k": 5}
        if where == "top":
            extras[field] = value
        else:
            extras[where] = {field: value, "thinking": {"type": "enabled"}}
        return ChatOptions(temperature=0.2, additional_properties=extras)

    one = cache_key("q", options({"user_id": "session-1"}))
    assert one == cache_key("q", options({"user_id": "session-2"}))
    assert one == cache_key("q", options("another"))
    # The same as a request without it at all.
    without = (
        {"top_k": 5} if where == "top" else {"top_k": 5, where: {"thinking": {"type": "enabled"}}}
    )
    assert one == cache_key("q", ChatOptions(temperature=0.2, additional_properties=without))


def test_a_table_left_empty_is_as_if_absent() -> None:
    only = ChatOptions(additional_properties={OPENAI_RESPONSES_EXTRAS: {"prompt_cache_key": "s"}})
    assert cache_key("q", only) == cache_key("q", ChatOptions())


SPLITTING: dict[str, ChatOptions] = {
    "temperature": ChatOptions(temperature=0.9),
    "top_p": ChatOptions(top_p=0.5),
    "max_output_tokens": ChatOptions(max_output_tokens=7),
    "stop": ChatOptions(stop=["x"]),
    "seed": ChatOptions(seed=3),
    "model": ChatOptions(model_id="other"),
    "tools": ChatOptions(tools=[FunctionTool("f", "d", {"type": "object"})]),
    "tool_mode": ChatOptions(
        tools=[FunctionTool("f", "d", {"type": "object"})], tool_mode="required"
    ),
    "response_format": ChatOptions(response_format={"type": "json_object"}),
    "reasoning_effort": ChatOptions(reasoning_effort="high"),
    "reasoning": ChatOptions(reasoning=ReasoningOptions(effort="low")),
    "reasoning_budget": ChatOptions(reasoning=ReasoningOptions(budget_tokens=1024)),
    "reasoning_summary": ChatOptions(reasoning=ReasoningOptions(summary="auto")),
    "an_extra": ChatOptions(additional_properties={"top_k": 9}),
    "parallel_tool_calls": ChatOptions(additional_properties={"parallel_tool_calls": False}),
    "verbosity": ChatOptions(additional_properties={"verbosity": "low"}),
    "anthropic_thinking": ChatOptions(
        additional_properties={ANTHROPIC_EXTRAS: {"thinking": {"type": "adaptive"}}}
    ),
    "anthropic_output_config": ChatOptions(
        additional_properties={ANTHROPIC_EXTRAS: {"output_config": {"effort": "max"}}}
    ),
    "anthropic_context_management": ChatOptions(
        additional_properties={ANTHROPIC_EXTRAS: {"context_management": {"edits": []}}}
    ),
}


def test_every_field_that_changes_the_answer_still_splits_entries() -> None:
    base = cache_key("q", ChatOptions())
    keys = {name: cache_key("q", options) for name, options in SPLITTING.items()}
    assert base not in keys.values()
    assert len(set(keys.values())) == len(keys)
    # The system prompt and the conversation are the answer's too.
    assert cache_key([ChatMessage.system("be a pirate"), ChatMessage.user("q")]) != base
    assert cache_key([ChatMessage.system("be a poet"), ChatMessage.user("q")]) != cache_key(
        [ChatMessage.system("be a pirate"), ChatMessage.user("q")]
    )


async def test_requests_differing_in_ignored_fields_share_an_entry(streaming: bool) -> None:
    inner = ScriptedChatClient("ok")
    chat = cached(inner)
    for session in ("run-1", "run-2"):
        metadata = {"user_id": f"user_abc_account__session_{session}"}
        extras = {ANTHROPIC_EXTRAS: {"metadata": metadata}, "prompt_cache_key": session}
        await ask(chat, "q", ChatOptions(additional_properties=extras), streaming)
    assert inner.call_count == 1


def test_more_fields_can_be_left_out_and_the_defaults_stay() -> None:
    settings = CacheSettings(ignore_fields=frozenset({"x_trace"}))
    assert settings.ignore_fields == DEFAULT_IGNORE_FIELDS | {"x_trace"}
    one = ChatOptions(additional_properties={"x_trace": "a", "user": "u1"})
    two = ChatOptions(additional_properties={"x_trace": "b", "user": "u2"})
    assert cache_key("q", one) != cache_key("q", two)
    ignored = settings.ignore_fields
    assert cache_key("q", one, ignore_fields=ignored) == cache_key("q", two, ignore_fields=ignored)


@pytest.mark.parametrize("by", ["user", "session"])
async def test_a_partition_by_user_or_session(streaming: bool, by: str) -> None:
    inner = ScriptedChatClient("ok")
    chat = cached(inner, partition_by=frozenset({by}))

    def options(who: str) -> ChatOptions:
        if by == "session":
            return ChatOptions(session_id=who)
        return ChatOptions(additional_properties={"user": who})

    async def as_server(who: str, server_user: str | None) -> None:
        token = enter_cache_report(CacheReport("caller-1", server_user))
        try:
            await ask(chat, "q", options(who), streaming)
        finally:
            exit_cache_report(token)

    await as_server("alice", None)
    await as_server("bob", None)
    await as_server("alice", None)
    assert inner.call_count == 2  # alice's answer is hers
    if by == "user":
        # The user a server names wins over the request's own field.
        await as_server("carol", "alice")
        assert inner.call_count == 2


async def test_entries_never_cross_callers_whatever_their_fields(streaming: bool) -> None:
    inner = ScriptedChatClient("ok")
    chat = cached(inner)
    same = ChatOptions(additional_properties={"user": "u"})
    for caller in ("caller-1", "caller-2", "caller-1"):
        token = enter_cache_report(CacheReport(caller))
        try:
            await ask(chat, "q", same, streaming)
        finally:
            exit_cache_report(token)
    assert inner.call_count == 2
