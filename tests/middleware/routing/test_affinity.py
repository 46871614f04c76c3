"""Session affinity for failover routers: both call shapes, memory and real Redis stores."""

from __future__ import annotations

import logging
import uuid
from collections import Counter

import pytest
import redis.asyncio as redis_asyncio

from middleware.routing import OrderedFailoverChatClient, Route
from middleware.routing.affinity import (
    MemoryAffinityStore,
    RedisAffinityStore,
    SessionAffinity,
)
from pipeline import ChatOptions, ChatPipeline
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, collect, fail, reply
from tests.middleware.affinity_replica import burst, router
from tests.middleware.remote_replica import remote

SESSION = ChatOptions(session_id="session-1")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ordered(
    a: ScriptedChatClient, b: ScriptedChatClient, affinity: SessionAffinity
) -> OrderedFailoverChatClient:
    return OrderedFailoverChatClient([Route("a", a), Route("b", b)], affinity=affinity)


async def test_a_session_keeps_the_route_that_served_it(streaming: bool) -> None:
    a = ScriptedChatClient([fail(TransientProviderError()), reply("from a")], name="a")
    b = ScriptedChatClient(reply("from b"), name="b")
    router = ordered(a, b, SessionAffinity())
    assert (await collect(router, "hi", SESSION, streaming=streaming)).text == "from b"
    # a is healthy again, but the session stays on b (its prompt cache lives there).
    assert (await collect(router, "again", SESSION, streaming=streaming)).text == "from b"
    assert (a.call_count, b.call_count) == (1, 2)
    # Another session and a request without one start at the top of the order.
    other = ChatOptions(session_id="session-2")
    assert (await collect(router, "hi", other, streaming=streaming)).text == "from a"
    assert (await collect(router, "hi", streaming=streaming)).text == "from a"


async def test_a_failover_moves_the_session(streaming: bool) -> None:
    a = ScriptedChatClient([fail(TransientProviderError()), reply("from a")], name="a")
    b = ScriptedChatClient([reply("from b"), fail(TransientProviderError())], name="b")
    router = ordered(a, b, SessionAffinity())
    assert (await collect(router, "1", SESSION, streaming=streaming)).text == "from b"
    # b fails before output: a serves, and the session moves to a.
    assert (await collect(router, "2", SESSION, streaming=streaming)).text == "from a"
    assert (await collect(router, "3", SESSION, streaming=streaming)).text == "from a"
    assert [c.call_count for c in (a, b)] == [3, 2]


async def test_a_session_expires_after_its_ttl(streaming: bool) -> None:
    clock = FakeClock()
    store = MemoryAffinityStore(ttl=60, clock=clock)
    a = ScriptedChatClient([fail(TransientProviderError()), reply("from a")], name="a")
    b = ScriptedChatClient(reply("from b"), name="b")
    router = ordered(a, b, SessionAffinity(store))
    await collect(router, "1", SESSION, streaming=streaming)
    clock.now += 59
    assert (await collect(router, "2", SESSION, streaming=streaming)).text == "from b"
    clock.now += 61  # 61 s after the last record
    assert (await collect(router, "3", SESSION, streaming=streaming)).text == "from a"


async def test_the_memory_store_is_bounded() -> None:
    store = MemoryAffinityStore(max_sessions=2)
    for session in ("s1", "s2", "s3"):
        await store.set(session, "r")
    assert len(store) == 2
    assert await store.get("s1") is None and await store.get("s3") == "r"
    with pytest.raises(ValueError, match="max_sessions must be at least 1"):
        MemoryAffinityStore(max_sessions=0)


async def test_an_open_breaker_moves_the_session(streaming: bool) -> None:
    a = ScriptedChatClient(reply("from a"), name="a")
    b_inner = ScriptedChatClient([reply("from b"), fail(TransientProviderError())], name="b")
    b = ChatPipeline.builder().use_circuit_breaker(fail_max=1, reset_timeout=60).build(b_inner)
    first = ScriptedChatClient(fail(TransientProviderError()), name="first")
    router = OrderedFailoverChatClient(
        [Route("first", first), Route("b", b), Route("a", a)], affinity=SessionAffinity()
    )
    assert (await collect(router, "1", SESSION, streaming=streaming)).text == "from b"
    # b fails once and its breaker opens; the request moves on (first fails, a serves).
    assert (await collect(router, "2", SESSION, streaming=streaming)).text == "from a"
    # The session is on a now; b's open breaker would have kept it off b anyway.
    assert (await collect(router, "3", SESSION, streaming=streaming)).text == "from a"
    assert b_inner.call_count == 2


async def test_the_tiered_router_uses_the_same_affinity(streaming: bool) -> None:
    from middleware.routing import TieredRoutingChatClient

    small = ScriptedChatClient([fail(TransientProviderError()), reply("small")], name="small")
    large = ScriptedChatClient(reply("large"), name="large")
    store = MemoryAffinityStore()
    router = TieredRoutingChatClient(
        [Route("small", small), Route("large", large)],
        default="small",
        fallback={"small": ["large"]},
        affinity=SessionAffinity(store),
    )
    assert (await collect(router, "1", SESSION, streaming=streaming)).text == "large"
    assert await store.get("session-1") == "large"
    assert (await collect(router, "2", SESSION, streaming=streaming)).text == "large"
    assert small.call_count == 1


@pytest.mark.redis
async def test_two_pipelines_share_affinity_through_redis(redis_url: str, streaming: bool) -> None:
    def pipeline() -> tuple[ChatPipeline, ScriptedChatClient, ScriptedChatClient]:
        a = ScriptedChatClient([fail(TransientProviderError()), reply("from a")], name="a")
        b = ScriptedChatClient(reply("from b"), name="b")
        store = RedisAffinityStore(redis_url, ttl=30, namespace=f"affinity-test-{streaming}")
        chat = (
            ChatPipeline.builder()
            .use_ordered_failover([Route("a", a), Route("b", b)], affinity=SessionAffinity(store))
            .build()
        )
        return chat, a, b

    first, first_a, _ = pipeline()
    second, second_a, second_b = pipeline()
    assert (await collect(first, "1", SESSION, streaming=streaming)).text == "from b"
    # The other replica has never seen this session, yet starts it on b.
    assert (await collect(second, "2", SESSION, streaming=streaming)).text == "from b"
    assert (second_a.call_count, second_b.call_count) == (0, 1)
    assert first_a.call_count == 1


async def test_a_store_that_is_down_never_fails_a_request(
    streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = RedisAffinityStore(f"redis://127.0.0.1:{port}/0", timeout=0.5)
    a = ScriptedChatClient(reply("from a"), name="a")
    router = ordered(a, ScriptedChatClient(reply("b"), name="b"), SessionAffinity(store))
    with caplog.at_level(logging.WARNING, logger="chat_pipeline.routing.affinity"):
        result = await collect(
            router, "hi", ChatOptions(session_id="SECRET-SESSION"), streaming=streaming
        )
    assert result.text == "from a"
    assert "session affinity store: Redis unavailable (ConnectionError)" in caplog.text
    assert "SECRET-SESSION" not in caplog.text
    await store.aclose()


IN_FLIGHT = 1000  # lookups in flight in each of two replicas (redis-py's default pool: 100)


async def test_two_replicas_answer_1000_concurrent_lookups_each(
    redis_url: str, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    namespace = f"affinity-many-{uuid.uuid4().hex[:8]}"
    keys = redis_asyncio.Redis.from_url(redis_url)
    # Every session was last served by b, the second route.
    await keys.mset({f"{namespace}:s-{i}": "b" for i in range(IN_FLIGHT)})
    async with remote("tests.middleware.affinity_replica", redis_url, namespace) as other:
        chat, store = router(redis_url, namespace)
        await other.send(f"burst {IN_FLIGHT} s {int(streaming)}")  # both bursts race
        here = await burst(chat, IN_FLIGHT, "s", streaming)
        there = await other.read()
        await store.aclose()
    # Every lookup of both replicas was answered: every session stayed on b.
    assert here == Counter({"b": IN_FLIGHT})
    assert there == ["a", "0", "b", str(IN_FLIGHT), "failed", "0", "warnings", "0"]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    print(f"\naffinity: 2 replicas x {IN_FLIGHT} lookups in flight: all answered, 0 warnings")
    await keys.aclose()
