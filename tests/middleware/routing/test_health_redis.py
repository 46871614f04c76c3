"""RedisHealthStore against a real redis-server: replicas share what they learn; a paused or
dead Redis never blocks or fails an attempt."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from middleware.routing import (
    BalancedFailoverChatClient,
    RedisHealthStore,
    Route,
    RouteHealth,
)
from pipeline.errors import RateLimitedError, TransientProviderError
from pipeline.testing import ScriptedChatClient, collect, reply
from tests.redis_server import RedisServer


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def replica(url: str, namespace: str, clock: Clock, **options: object) -> RouteHealth:
    # A sync that sees a healthy Redis must not fail for a slow moment of a loaded machine
    # (a first sync also connects and loads the script): the default 0.25 s bound is for
    # production, where a late sync is only skipped. Tests of the bound pass their own.
    options.setdefault("timeout", 10.0)
    return RouteHealth(clock=clock, store=RedisHealthStore(url, namespace=namespace, **options))


async def test_replicas_share_failures_latency_and_cooldowns(redis_url: str) -> None:
    namespace = f"test:{uuid.uuid4().hex}"
    clock = Clock()
    first, second = replica(redis_url, namespace, clock), replica(redis_url, namespace, clock)
    try:
        ticket = first.attempt_started("a")
        clock.now += 2.5
        ticket.first_update()
        ticket.ended("completed")
        for _ in range(4):
            first.attempt_started("a").ended("failed_before_output", TransientProviderError())
        first.attempt_started("b").ended(
            "failed_before_output", RateLimitedError(status_code=429, retry_after=5.0)
        )
        assert first.store is not None and second.store is not None
        assert isinstance(first.store, RedisHealthStore)
        assert await first.store.sync(first)
        assert isinstance(second.store, RedisHealthStore)
        second.stats("a")  # the routes second knows of are synced
        second.stats("b")
        assert await second.store.sync(second)
        stats = second.stats("a")
        assert stats.latency == pytest.approx(2.5)
        assert stats.failure_ratio == pytest.approx(4 / 6, rel=1e-3)  # 4 of 5, one more below
        assert second.cooling_down("b")
        assert second.stats("b").cooldown == pytest.approx(5.0, abs=0.1)
        assert second.stats("a").in_flight == 0  # in flight stays local
    finally:
        await first.aclose()
        await second.aclose()


async def test_a_balanced_router_on_another_replica_avoids_what_one_learnt(
    redis_url: str, streaming: bool
) -> None:
    namespace = f"test:{uuid.uuid4().hex}"
    clock = Clock()
    first = replica(redis_url, namespace, clock)
    first.attempt_started("a").ended(
        "failed_before_output", RateLimitedError(status_code=429, retry_after=30.0)
    )
    assert isinstance(first.store, RedisHealthStore)
    await first.store.sync(first)
    a, b = ScriptedChatClient(reply("a"), name="a"), ScriptedChatClient(reply("b"), name="b")
    store = RedisHealthStore(redis_url, namespace=namespace)
    second = RouteHealth(clock=clock, store=store)
    router = BalancedFailoverChatClient(
        [Route("a", a), Route("b", b)], health=second, strategy="round_robin"
    )
    try:
        second.stats("a")
        await store.sync(second)
        for _ in range(4):
            assert (await collect(router, "hi", streaming=streaming)).text == "b"
        assert a.call_count == 0
    finally:
        await router.aclose()
        await second.aclose()
        await first.aclose()


async def test_a_paused_redis_never_delays_an_attempt(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    store = RedisHealthStore(
        redis_server.url, namespace=f"test:{uuid.uuid4().hex}", timeout=0.2, sync_interval=0.01
    )
    health = RouteHealth(clock=clock, store=store)
    a = ScriptedChatClient(reply("a"), name="a")
    router = BalancedFailoverChatClient([Route("a", a)], health=health)
    try:
        assert (await router.get_response("hi")).text == "a"
        assert await store.sync(health)
        redis_server.pause()
        try:
            with caplog.at_level(logging.WARNING, "chat_pipeline.routing.health"):
                for _ in range(20):
                    clock.now += 1.0  # a sync is due at every request
                    # Each request answers while its sync waits on the paused Redis.
                    assert (await asyncio.wait_for(router.get_response("hi"), 0.15)).text == "a"
                assert not await store.sync(health)  # bounded, then skipped
        finally:
            redis_server.resume()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "route health store unavailable" in warnings[0].getMessage()
    finally:
        await router.aclose()
    assert a.call_count == 21


async def test_a_dead_redis_is_an_outage_not_an_error(streaming: bool) -> None:
    from tests.redis_server import free_port

    store = RedisHealthStore(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    health = RouteHealth(store=store)
    router = BalancedFailoverChatClient([ScriptedChatClient("ok", name="a")], health=health)
    try:
        for _ in range(3):
            assert (await collect(router, "hi", streaming=streaming)).text == "ok"
        assert not await store.sync(health)
    finally:
        await router.aclose()


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="sync_interval"):
        RedisHealthStore("redis://127.0.0.1:6379/0", sync_interval=0)
    with pytest.raises(ValueError, match="redis"):
        RedisHealthStore("http://example")
    assert "127.0.0.1" not in repr(RedisHealthStore("redis://127.0.0.1:6379/0"))


@pytest.mark.parametrize("lost", ["written while Redis was down", "lost with its restart"])
async def test_a_cooldown_reaches_the_other_replica_after_redis_restarts(
    redis_server: RedisServer, lost: str
) -> None:
    # A restarted Redis is empty: the cooldown key a replica wrote (or could not write,
    # while Redis was down) is gone, but the replica still cools the route down. Its next
    # sync must publish it again, or the other replicas never see it.
    namespace = f"test:{uuid.uuid4().hex}"
    clock = Clock()
    # A retry interval of a nanosecond: the first sync after the restart tries Redis.
    options = {"timeout": 5.0, "retry_interval": 1e-9}
    first = replica(redis_server.url, namespace, clock, **options)
    second = replica(redis_server.url, namespace, clock, **options)
    assert isinstance(first.store, RedisHealthStore)
    assert isinstance(second.store, RedisHealthStore)
    try:
        second.stats("b")  # a route second knows of
        assert await first.store.sync(first) and await second.store.sync(second)
        if lost == "written while Redis was down":
            redis_server.stop()
            first.cool_down("b", 30.0)
            await asyncio.gather(*first.store._tasks)  # its write failed
        else:
            first.cool_down("b", 30.0)
            await asyncio.gather(*first.store._tasks)  # written
            redis_server.stop()
        redis_server.start()  # empty, on the same port
        for health in (first, second):
            store = health.store
            assert isinstance(store, RedisHealthStore)
            # A pooled connection to the Redis that died fails once: the next sync connects.
            assert any([await store.sync(health) for _ in range(3)])
        assert second.cooling_down("b")
        assert second.stats("b").cooldown == pytest.approx(30.0, abs=1.0)
    finally:
        await first.aclose()
        await second.aclose()
