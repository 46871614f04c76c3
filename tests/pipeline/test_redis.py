"""The one Redis module: checks, the connection pool, bounded calls, scripts, outages, ping;
against a real redis-server."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis
import redis.asyncio as redis_asyncio

from pipeline import _redis
from pipeline.errors import RedisUnavailable
from tests.redis_server import RedisServer, counting_client, free_port


@pytest.mark.parametrize(
    "url", ["redis://h:1/0", "rediss://user:pw@h", "redis://h?db=3", "unix:///tmp/redis.sock"]
)
def test_a_redis_url_is_accepted(url: str) -> None:
    _redis.check_url(url)
    assert _redis.check(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "nonsense",
        "http://user:s3cret@127.0.0.1:6379",
        "redis://:s3cret@[::1",
        "redis://h:99999",
        "redis://:s3cret@h:notaport",
        "redis://",
        "unix://",
        "redis://:s3cret@h?db=x",
    ],
)
def test_a_malformed_url_is_a_value_error_that_never_echoes_it(url: str) -> None:
    with pytest.raises(ValueError, match=r"must be a redis://, rediss:// or unix:// URL") as raised:
        _redis.check(url)
    assert "s3cret" not in str(raised.value)


def test_only_an_asyncio_client_is_accepted() -> None:
    client = redis_asyncio.Redis()
    assert _redis.check(client) is client
    with pytest.raises(TypeError, match="synchronous Redis client would block the event loop"):
        _redis.check(redis.Redis())
    with pytest.raises(TypeError, match=r"must be a URL or a redis\.asyncio client, not int"):
        _redis.check(3)


async def test_a_client_made_here_has_a_pool_of_its_size_and_never_retries() -> None:
    client = _redis.RedisClient("redis://127.0.0.1:1/0", timeout=0.7).client()
    pool = client.connection_pool
    assert pool.max_connections == _redis.POOL_SIZE
    options = pool.connection_kwargs
    assert (options["socket_timeout"], options["socket_connect_timeout"]) == (0.7, 0.7)
    assert options["retry"].get_retries() == 0
    await client.aclose()


@pytest.mark.parametrize("given", ["url", "own client"])
async def test_ten_times_more_calls_than_connections_wait_their_turn(
    redis_url: str, given: str
) -> None:
    n = 10 * _redis.POOL_SIZE
    own = redis_asyncio.Redis.from_url(redis_url) if given == "own client" else None
    client = _redis.RedisClient(own or redis_url, timeout=30)
    lists = [f"pool-test:{given}:{i}" for i in range(n)]
    # Each call holds its connection until its list gets an item (BLPOP), so calls pile
    # up: redis-py's default pool would raise MaxConnectionsError past 100.
    observer = redis_asyncio.Redis.from_url(redis_url)
    # The server tells a MONITOR connection of every command it runs: a BLPOP it has run
    # blocks its connection, so the pool's connections are all held once it told of as many.
    async with observer.monitor() as monitor:
        calls = [asyncio.create_task(client.call(lambda c, k=k: c.blpop([k], 30))) for k in lists]
        async with asyncio.timeout(30):  # bounded: the calls never reaching Redis fails here
            blocked = 0
            while blocked < _redis.POOL_SIZE:
                command = await monitor.next_command()
                blocked += command["command"].upper().startswith("BLPOP")
    pool = client.client().connection_pool
    assert len(pool._in_use_connections) == _redis.POOL_SIZE
    assert not any(call.done() for call in calls)  # the others wait for their turn
    for key in lists:
        await observer.lpush(key, "item")
    results = await asyncio.gather(*calls)
    assert [key.decode() for key, _ in results] == lists
    assert len(pool._in_use_connections) + len(pool._available_connections) == _redis.POOL_SIZE
    await client.aclose()
    for each in (observer, own):
        if each is not None:
            await each.aclose()


async def test_building_never_connects_and_each_loop_gets_its_own_client() -> None:
    dead = _redis.RedisClient(f"redis://127.0.0.1:{free_port()}/0", timeout=1)
    assert dead.owned and repr(dead) == "RedisClient(url)"
    with pytest.raises(redis.ConnectionError):
        await dead.call(lambda client: client.ping())
    first = dead.client()
    other_loop_client = await asyncio.to_thread(asyncio.run, _client_of(dead))
    assert other_loop_client is not first and dead.client() is not first
    await dead.aclose()


async def _client_of(handle: _redis.RedisClient) -> Any:
    return handle.client()


async def test_a_callers_own_client_is_used_as_it_is_and_left_open(redis_url: str) -> None:
    own = redis_asyncio.Redis.from_url(redis_url)
    handle = _redis.RedisClient(own, timeout=1)
    assert not handle.owned and handle.client() is own
    await handle.aclose()
    assert await own.ping() is True  # still open: the caller closes it
    await own.aclose()


async def test_a_script_is_loaded_once_and_again_after_noscript(redis_url: str) -> None:
    own = counting_client(redis_url)
    handle = _redis.RedisClient(own, timeout=5)
    source = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
    await own.delete("script-test")
    assert await handle.script(source, ["script-test"], [2]) == 2
    own.sent.clear()
    assert await handle.script(source, ["script-test"], [3]) == 5
    assert own.sent == ["EVALSHA"]  # registered: only its hash travels
    await own.script_flush()  # a restarted Redis forgot it
    own.sent.clear()
    assert await handle.script(source, ["script-test"], [4]) == 9
    assert own.sent == ["EVALSHA", "SCRIPT LOAD", "EVALSHA"]
    await own.aclose()


async def test_a_call_to_a_paused_redis_ends_at_its_bound(redis_server: RedisServer) -> None:
    handle = _redis.RedisClient(redis_server.url, timeout=0.2)
    assert await handle.ping() == "ok"
    redis_server.pause()
    try:
        async with asyncio.timeout(30):  # only the bound can end it
            with pytest.raises(TimeoutError):
                await handle.call(lambda client: client.get("k"))
            assert await handle.ping() == "unavailable (TimeoutError)"
    finally:
        redis_server.resume()
    assert await handle.ping() == "ok"  # the connection a cut call used was not reused
    await handle.aclose()


async def test_ping_names_the_error_type_only() -> None:
    handle = _redis.RedisClient(f"redis://:s3cret@127.0.0.1:{free_port()}/0", timeout=1)
    assert await handle.ping() == "unavailable (ConnectionError)"
    await handle.aclose()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_an_outage_is_skipped_then_retried_and_warned_about_sparingly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="test.outage")
    clock = FakeClock()
    outage = _redis.Outage(
        logging.getLogger("test.outage"), "thing: Redis", "going on alone", 5.0, clock=clock
    )
    handle = _redis.RedisClient(redis_asyncio.Redis(), timeout=1)
    tried: list[float] = []

    async def failing(client: Any) -> None:
        tried.append(clock.now)
        raise redis.ConnectionError("CANARY host detail")

    async def working(client: Any) -> str:
        tried.append(clock.now)
        return "answer"

    async def attempt(operation: Any) -> Any:
        try:
            return await handle.attempt(outage, operation)
        except RedisUnavailable:
            return "unavailable"

    assert await attempt(failing) == "unavailable"
    clock.now += 4.9
    assert await attempt(working) == "unavailable"  # skipped: no call
    clock.now += 0.2
    assert await attempt(failing) == "unavailable"  # tried again, same outage: no warning
    clock.now += 60
    assert await attempt(failing) == "unavailable"  # a minute on: warned again
    assert tried == pytest.approx([100.0, 105.1, 165.1])
    clock.now += 5
    assert await attempt(working) == "answer"  # reachable again
    # Flapping: a new outage within a minute of the last warning is not warned about at
    # once, and its end is not announced unless it was; after a minute, it is.
    assert await attempt(failing) == "unavailable"
    clock.now += 5
    assert await attempt(working) == "answer"
    assert await attempt(failing) == "unavailable"
    clock.now += 60
    assert await attempt(failing) == "unavailable"
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    warning = (
        "WARNING",
        "thing: Redis unavailable (ConnectionError); going on alone; trying again in 5 s",
    )
    back = ("INFO", "thing: Redis is reachable again")
    assert messages == [warning, warning, back, warning]
    assert "CANARY" not in caplog.text


async def test_a_guarded_call_fails_open_and_counts_only_the_stores_failures() -> None:
    """`Outage.guard`: the one fail-open path of stores of a caller's own (cache, session
    affinity) and of the semantic cache's embedder."""
    clock = FakeClock()
    outage = _redis.Outage(logging.getLogger("test.guard"), "store", "going on", 5.0, clock=clock)
    calls: list[str] = []
    never = asyncio.Event()

    async def answer() -> str:
        calls.append("answer")
        return "value"

    async def broken() -> str:
        calls.append("broken")
        raise ValueError("CANARY")

    async def stuck() -> str:
        calls.append("stuck")
        await never.wait()
        return "never"

    assert await outage.guard(answer, 1.0) == "value"
    # The request's deadline ran out, not the store: no failure counted.
    assert await outage.guard(stuck, 0.001, bound_by_request=True) is None
    assert not outage.down
    assert await outage.guard(broken, 1.0) is None
    assert outage.down and outage.skipping()
    assert await outage.guard(answer, 1.0) is None  # skipped: not called
    clock.now += 5.0
    assert await outage.guard(stuck, 0.001) is None  # the store's own bound: its failure
    assert outage.skipping()
    clock.now += 5.0
    assert await outage.guard(answer, 1.0) == "value" and not outage.down
    assert calls == ["answer", "stuck", "broken", "stuck", "answer"]
    # The caller's own cancellation is raised, never swallowed.
    started = asyncio.Event()

    async def waiting() -> str:
        started.set()
        await never.wait()
        return "never"

    task = asyncio.create_task(outage.guard(waiting, None))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not outage.down


async def test_the_items_of_one_loop_turn_are_sent_together() -> None:
    sent: list[list[int]] = []
    release = asyncio.Event()

    async def send(items: list[int]) -> int:
        sent.append(list(items))
        await release.wait()
        return sum(items)

    batched: _redis.Batched[int, int] = _redis.Batched(send)
    first = [asyncio.create_task(batched.add(i)) for i in range(5)]
    await asyncio.sleep(0)  # one turn: the five are sent together
    later = asyncio.create_task(batched.add(10))  # the next batch
    first[0].cancel()  # a caller giving up leaves the call to the others
    release.set()
    assert await asyncio.gather(*first[1:]) == [(10, i, 5) for i in range(1, 5)]
    assert await later == (10, 0, 1)
    assert sent == [[0, 1, 2, 3, 4], [10]]
    await batched.aclose()
