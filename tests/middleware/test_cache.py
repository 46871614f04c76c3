"""The response cache layer: hits, what is never stored, scopes, modes, single flight,
telemetry, semantic lookups (with a deterministic fake encoder)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from middleware.cache import (
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
    FunctionCallContent,
    ReasoningContent,
    UsageDetails,
)
from pipeline._cache_scope import CacheReport, enter_cache_report, exit_cache_report
from pipeline.errors import ResponseValidationError, TransientProviderError
from pipeline.testing import ScriptedChatClient, call_tools, fail, fail_after, hang, reply
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
    for _ in range(100):
        if inner.call_count:
            break
        await asyncio.sleep(0)
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
    assert otel.total("chat_pipeline.cache.lookups", **{"chat_pipeline.cache.result": "bypass"}) == 2


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
        assert otel.total("chat_pipeline.cache.lookups", **{"chat_pipeline.cache.result": result}) == 1


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
    assert [s.attributes.get("chat_pipeline.cache.result") for s in spans] == ["miss", "hit", "miss"]
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
