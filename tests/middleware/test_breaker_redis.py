"""The shared state behind a breaker with ``redis=``: calls of one process share round trips,
and every failure still counts once; against a real redis-server."""

from __future__ import annotations

import asyncio
import uuid

from middleware._breaker_redis import Facts, RedisBreakerState
from tests.redis_server import counting_client


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
