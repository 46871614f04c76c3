"""The shared state behind a breaker with ``redis=``: calls of one process share round trips,
and every failure still counts once; against a real redis-server."""

from __future__ import annotations

import asyncio
import uuid

from middleware._breaker_redis import Facts, RedisBreakerState
from middleware._breaker_window import Counts
from tests.redis_server import RedisServer, counting_client


def state(client: object) -> RedisBreakerState:
    return RedisBreakerState(
        client, f"b-{uuid.uuid4().hex[:8]}", timeout=5, retry_interval=1, probe_claim_ttl=5
    )


async def test_concurrent_reads_share_one_mget_even_when_one_caller_gives_up(
    redis_url: str,
) -> None:
    client = counting_client(redis_url)
    shared = state(client)
    readers = [asyncio.create_task(shared.read()) for _ in range(100)]
    await asyncio.sleep(0)  # every reader has joined the read on the wire
    readers[0].cancel()
    answers = await asyncio.gather(*readers[1:])
    assert answers == [Facts(None, 0)] * 99
    assert client.sent == ["MGET"]
    await shared.aclose()
    await client.aclose()


async def test_a_burst_of_failures_is_one_incrby_and_each_gets_its_own_count(
    redis_url: str,
) -> None:
    client = counting_client(redis_url)
    shared = state(client)
    await client.set(shared.failures_key, 7)
    client.sent.clear()
    counts = await asyncio.gather(*(shared.count_failure() for _ in range(100)))
    assert sorted(c for c in counts if c is not None) == list(range(8, 108))
    assert client.sent == ["INCRBY"]
    assert int(await client.get(shared.failures_key)) == 107
    # Successes reset it, once for the burst; a failure after them counts from zero.
    client.sent.clear()
    await asyncio.gather(*(shared.count_success() for _ in range(100)))
    assert client.sent == ["SET"]
    assert await shared.count_failure() == 1
    await shared.aclose()
    await client.aclose()


# -- the window of a ratio policy ------------------------------------------------------------


def windowed(client: object, name: str, bucket: list[int]) -> RedisBreakerState:
    """A breaker's shared state with a 10 s window (buckets of 1 s), whose current bucket is
    `bucket[0]`."""
    return RedisBreakerState(
        client,
        name,
        timeout=5,
        retry_interval=0,
        probe_claim_ttl=5,
        window=10.0,
        bucket=lambda: bucket[0],
        shared_bucket=lambda: bucket[0],
    )


async def test_outcomes_ride_on_the_read_and_every_replica_sees_them(redis_url: str) -> None:
    name = f"w-{uuid.uuid4().hex[:8]}"
    now = [1_000]
    client = counting_client(redis_url)
    shared = windowed(client, name, now)
    assert shared.window is not None
    await shared.read()  # registers the script
    client.sent.clear()
    shared.window.add(1_000, 3, 1, 2)
    shared.window.add(995, 1, 0, 0)
    shared.window.add(990, 5, 5, 5)  # already out of the window
    readers = [asyncio.create_task(shared.read()) for _ in range(100)]
    assert await asyncio.gather(*readers) == [Facts(None, 0)] * 100
    # One script for a hundred readers, carrying the outcomes and bringing the buckets back.
    assert client.sent == ["EVALSHA"]
    assert shared.window.counts(1_000) == Counts(4, 1, 2)
    assert shared.window.unsent.calls == 0
    # One hash, a field per slot of the ring of buckets (bucket % 10).
    key = f"chat_pipeline:breaker:{{{name}}}:window"
    assert await client.hgetall(key) == {b"0": b"1000 3 1 2", b"5": b"995 1 0 0"}
    assert 0 < await client.pttl(key) <= 20_000  # two windows after the last write
    # Another replica sees them; a window later, nobody does.
    other = windowed(redis_url, name, now)
    assert other.window is not None
    await other.read()
    assert other.window.counts(1_000) == Counts(4, 1, 2)
    now[0] = 1_006
    await other.read()
    assert other.window.counts(1_006) == Counts(3, 1, 2)  # bucket 995 left, 1000 is in
    now[0] = 1_010
    await other.read()
    assert other.window.counts(1_010) == Counts(0, 0, 0)
    # A bucket written to a slot holding an older one starts afresh.
    other.window.add(1_010, 1, 0, 0)
    await other.read()
    assert await client.hget(key, "0") == b"1010 1 0 0"
    assert other.window.counts(1_010) == Counts(1, 0, 0)
    for each in (shared, other):
        await each.aclose()
    await client.aclose()


async def test_failures_carry_the_window_in_one_script_each_with_its_own_count(
    redis_url: str,
) -> None:
    now = [50]
    client = counting_client(redis_url)
    shared = windowed(client, f"w-{uuid.uuid4().hex[:8]}", now)
    assert shared.window is not None
    await shared.read()
    client.sent.clear()
    shared.window.add(50, 100, 100, 0)  # what the hundred failures' callers counted
    counts = await asyncio.gather(*(shared.count_failure() for _ in range(100)))
    assert sorted(c for c in counts if c is not None) == list(range(1, 101))
    assert client.sent == ["EVALSHA"]
    assert shared.window.counts(50) == Counts(100, 100, 0)
    # Closing the circuit empties the shared window (and the failures), as it does locally.
    opening = "1767225600900.000"
    assert await shared.transition(None, opening) == (True, opening)
    assert await shared.transition(opening, None) == (True, None)
    assert await client.exists(shared.window_key) == 0
    assert await shared.read() == Facts(None, 0)
    assert shared.window.counts(50) == Counts(0, 0, 0)
    await shared.aclose()
    await client.aclose()


async def test_outcomes_wait_out_an_outage_and_an_open_circuit_counts_nothing(
    redis_server: RedisServer,
) -> None:
    now = [7]
    name = f"w-{uuid.uuid4().hex[:8]}"
    shared = windowed(redis_server.url, name, now)
    assert shared.window is not None
    assert await shared.read() == Facts(None, 0)
    redis_server.stop()
    shared.window.add(7, 2, 1, 0)
    assert await shared.read() is None
    assert await shared.count_failure() is None
    # Kept, and counted in this process's view meanwhile.
    assert shared.window.unsent.calls == 2
    assert shared.window.counts(7) == Counts(2, 1, 0)
    redis_server.start()  # empty, on the same port
    assert await shared.read() == Facts(None, 0)
    assert shared.window.unsent.calls == 0
    assert shared.window.seen.calls == 2  # sent, and back from Redis
    # While the circuit is open in Redis, outcomes sent are not added up.
    assert await shared.transition(None, "1767225600900.000") == (True, "1767225600900.000")
    shared.window.add(7, 1, 1, 1)
    await shared.read()
    assert shared.window.counts(7) == Counts(2, 1, 0)
    await shared.aclose()


async def test_processes_whose_clocks_disagree_meet_on_redis_time(redis_url: str) -> None:
    # Each numbers buckets by its own (monotonic) clock: 1,000 and 777,000 buckets apart.
    # Redis' TIME is the shared clock: each sees the other's outcomes, on its own numbering.
    name = f"w-{uuid.uuid4().hex[:8]}"
    mine, theirs = [1_000], [778_000]

    def on_redis_time(bucket: list[int]) -> RedisBreakerState:
        return RedisBreakerState(
            redis_url, name, timeout=5, retry_interval=0, probe_claim_ttl=5,
            window=3600.0, bucket=lambda: bucket[0],
        )  # fmt: skip

    one, other = on_redis_time(mine), on_redis_time(theirs)
    assert one.window is not None and other.window is not None
    one.window.add(1_000, 3, 2, 1)
    one.window.add(999, 1, 1, 0)
    await one.read()
    await other.read()
    assert other.window.counts(778_000) == Counts(4, 3, 1)
    assert sorted(other.window.seen.buckets()) == [(777_999, 1, 1, 0), (778_000, 3, 2, 1)]
    other.window.add(778_000, 5, 0, 0)
    await other.read()
    await one.read()
    assert one.window.counts(1_000) == Counts(9, 3, 1)
    for each in (one, other):
        await each.aclose()
