"""Session affinity for failover routers: both call shapes, memory and real Redis stores."""

from __future__ import annotations

import asyncio
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
from tests.redis_server import RedisServer, counting_client

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
        store = RedisAffinityStore(
            redis_url, ttl=30, namespace=f"affinity-test-{streaming}", timeout=5.0
        )
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


class UnreliableStore:
    """A store of a user's own whose `get` and `set` work, raise or hang, as told."""

    def __init__(self, get: str = "work", set: str = "work") -> None:
        self.modes = {"get": get, "set": set}
        self.routes: dict[str, str] = {}
        self.calls: Counter[str] = Counter()

    async def _call(self, what: str) -> None:
        self.calls[what] += 1
        if self.modes[what] == "raise":
            raise RuntimeError("CANARY-store-internals")
        if self.modes[what] == "hang":
            await asyncio.Event().wait()

    async def get(self, session_id: str) -> str | None:
        await self._call("get")
        return self.routes.get(session_id)

    async def set(self, session_id: str, route_name: str) -> None:
        await self._call("set")
        self.routes[session_id] = route_name


def affinity_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "chat_pipeline.routing.affinity" and r.levelno == logging.WARNING
    ]


@pytest.mark.parametrize("failure", ["raise", "hang"])
async def test_a_custom_store_whose_lookup_fails_or_hangs_never_fails_a_request(
    streaming: bool, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = UnreliableStore(get=failure)
    store.routes["SECRET-SESSION"] = "b"
    a = ScriptedChatClient(lambda m, o: reply("from a"), name="a")
    b = ScriptedChatClient(lambda m, o: reply("from b"), name="b")
    router = ordered(a, b, SessionAffinity(store, timeout=0.05, retry_interval=60))
    options = ChatOptions(session_id="SECRET-SESSION")
    async with asyncio.timeout(30):  # only the store's bound can end a hanging lookup
        results = [await collect(router, "hi", options, streaming=streaming) for _ in range(3)]
    # Routed as a new session, each time; the store is skipped after its failure.
    assert [(r.text, r.error) for r in results] == [("from a", None)] * 3
    assert store.calls["get"] == 1 and b.call_count == 0
    (warning,) = affinity_warnings(caplog)
    assert ("RuntimeError" if failure == "raise" else "TimeoutError") in warning
    assert "SECRET-SESSION" not in caplog.text and "CANARY" not in caplog.text


@pytest.mark.parametrize("failure", ["raise", "hang"])
async def test_a_custom_store_whose_record_fails_or_hangs_never_loses_the_answer(
    streaming: bool, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = UnreliableStore(set=failure)
    a = ScriptedChatClient(lambda m, o: reply("from a"), name="a")
    router = ordered(
        a, ScriptedChatClient(reply("b"), name="b"), SessionAffinity(store, timeout=0.05)
    )
    async with asyncio.timeout(30):  # only the store's bound can end a hanging record
        result = await collect(router, "hi", SESSION, streaming=streaming)
        again = await collect(router, "hi", SESSION, streaming=streaming)
    # The answer stands (the record came after it); the next request skips the store.
    assert (result.text, result.error) == ("from a", None)
    assert (again.text, again.error) == ("from a", None)
    assert store.calls == Counter({"get": 1, "set": 1})
    assert len(affinity_warnings(caplog)) == 1 and "CANARY" not in caplog.text


async def test_a_store_call_never_outlasts_the_request(caplog: pytest.LogCaptureFixture) -> None:
    from pipeline import _scope

    store = UnreliableStore(get="hang", set="hang")
    affinity = SessionAffinity(store, timeout=600)  # a store timeout longer than the request
    clock = asyncio.get_running_loop().time
    async with asyncio.timeout(30):
        budget = _scope.RequestBudget(None, clock() + 0.05, clock)
        assert await affinity.preferred("s", budget) is None
        # The request's budget, also when it is the current one.
        token = _scope.enter_budget(_scope.RequestBudget(None, clock() + 0.05, clock))
        try:
            await affinity.record("s", "a")
        finally:
            _scope.exit_budget(token)
    # The request ran out of time, the store did not fail: no warning, no back-off.
    assert affinity_warnings(caplog) == []
    assert store.calls == Counter({"get": 1, "set": 1})
    store.modes["get"] = "work"
    store.routes["s"] = "b"
    assert await affinity.preferred("s") == "b"


async def test_a_paused_redis_store_is_skipped_for_its_retry_interval(
    redis_server: RedisServer, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    client = counting_client(redis_server.url)
    store = RedisAffinityStore(client, ttl=60, timeout=0.2, retry_interval=600)
    a = ScriptedChatClient(lambda m, o: reply("from a"), name="a")
    router = ordered(a, ScriptedChatClient(reply("b"), name="b"), SessionAffinity(store))
    assert (await collect(router, "hi", SESSION, streaming=streaming)).text == "from a"
    sent = len(client.sent)  # a lookup and a record
    redis_server.pause()
    try:
        async with asyncio.timeout(30):
            results = [await collect(router, "hi", SESSION, streaming=streaming) for _ in range(5)]
    finally:
        redis_server.resume()
    # The first request paid the timeout once; the others routed without Redis.
    assert [r.text for r in results] == ["from a"] * 5
    assert len(client.sent) == sent + 1
    (warning,) = affinity_warnings(caplog)
    assert "Redis unavailable (TimeoutError)" in warning
    await store.aclose()
    await client.aclose()


async def test_the_lookups_and_records_of_one_moment_are_one_call_each(redis_url: str) -> None:
    client = counting_client(redis_url)
    namespace = f"affinity-batch-{uuid.uuid4().hex[:8]}"
    store = RedisAffinityStore(client, ttl=60, namespace=namespace, timeout=5.0)
    await client.mset({f"{namespace}:s-{i}": "b" for i in range(0, 100, 2)})
    client.sent.clear()
    found = await asyncio.gather(*(store.get(f"s-{i}") for i in range(100)))
    assert found == ["b", None] * 50
    assert client.sent == ["MGET"]
    await asyncio.gather(*(store.set(f"s-{i}", "c") for i in range(100)))  # one pipeline
    assert await client.mget([f"{namespace}:s-{i}" for i in range(100)]) == [b"c"] * 100
    assert 0 < await client.pttl(f"{namespace}:s-99") <= 60_000
    await store.aclose()
    await client.aclose()
