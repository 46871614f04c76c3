"""The response stores' promises, the same for both (the Redis one on a real redis-server):
partitions apart, items found through their response, bounds in count and bytes (the
oldest out first), a time to live, deletes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from pipeline.gateway.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    record_size,
)

RECORD = b"x" * 1000
SIZE = record_size(RECORD, ["a", "b"])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def make_store(
    request: pytest.FixtureRequest,
) -> Callable[..., ResponseStore]:
    """A factory of stores of one kind (Redis: a namespace of each test's own)."""
    if request.param == "memory":
        return lambda **bounds: MemoryResponseStore(**bounds)
    url = request.getfixturevalue("redis_url")
    namespace = f"test:{uuid.uuid4().hex}"
    return lambda **bounds: RedisResponseStore(url, namespace=namespace, timeout=5.0, **bounds)


@pytest.fixture
async def store(make_store: Callable[..., ResponseStore]) -> AsyncIterator[ResponseStore]:
    made = make_store()
    yield made
    await made.aclose()


async def test_records_and_items_by_partition(store: ResponseStore) -> None:
    assert await store.put("key-a", "resp_1", RECORD, ["msg_1", "fc_1"]) is True
    assert await store.get("key-a", "resp_1") == RECORD
    assert await store.get("key-b", "resp_1") is None  # another caller's: not found
    assert await store.owners("key-a", ["fc_1", "msg_9", "msg_1"]) == ["resp_1", None, "resp_1"]
    assert await store.owners("key-b", ["fc_1"]) == [None]
    # An item in a newer response (the input of a continuation) points to the newer one.
    await store.put("key-a", "resp_2", RECORD, ["msg_1", "msg_2"])
    assert await store.owners("key-a", ["msg_1", "fc_1"]) == ["resp_2", "resp_1"]
    assert await store.delete("key-b", "resp_2") is False
    assert await store.delete("key-a", "resp_2") is True
    assert await store.get("key-a", "resp_2") is None
    # Its items are gone; the ones another response holds stay.
    assert await store.owners("key-a", ["msg_2", "msg_1", "fc_1"]) == [None, None, "resp_1"]
    assert await store.delete("key-a", "resp_2") is False


async def test_at_most_max_count_records_the_oldest_out_first(
    make_store: Callable[..., ResponseStore],
) -> None:
    store = make_store(max_count=3)
    for number in range(5):
        await store.put("key", f"resp_{number}", RECORD, [f"msg_{number}"])
    found = [await store.get("key", f"resp_{number}") for number in range(5)]
    assert found == [None, None, RECORD, RECORD, RECORD]
    assert await store.owners("key", ["msg_0", "msg_4"]) == [None, "resp_4"]
    await store.aclose()


async def test_at_most_max_bytes_and_a_record_too_large_is_not_kept(
    make_store: Callable[..., ResponseStore],
) -> None:
    store = make_store(max_bytes=2 * SIZE + SIZE // 2)
    for number in range(3):
        assert await store.put("key", f"resp_{number}", RECORD, ["a", "b"]) is True
    found = [await store.get("key", f"resp_{number}") for number in range(3)]
    assert found == [None, RECORD, RECORD]
    assert await store.put("key", "resp_big", b"y" * (3 * SIZE), []) is False
    assert await store.get("key", "resp_big") is None
    assert await store.get("key", "resp_2") == RECORD  # nothing evicted for it
    # Replacing a record counts it once.
    for _ in range(3):
        await store.put("key", "resp_2", RECORD, ["a", "b"])
    assert await store.get("key", "resp_1") == RECORD
    await store.aclose()


async def test_the_memory_store_forgets_a_record_after_its_ttl() -> None:
    clock = Clock()
    store = MemoryResponseStore(ttl=60.0, clock=clock)
    await store.put("key", "resp_1", RECORD, ["msg_1"])
    clock.now += 30
    await store.put("key", "resp_2", RECORD, ["msg_2"])
    clock.now += 29.9
    assert await store.get("key", "resp_1") == RECORD
    clock.now += 0.1
    assert await store.get("key", "resp_1") is None
    assert await store.owners("key", ["msg_1", "msg_2"]) == [None, "resp_2"]
    assert (len(store), store.bytes) == (1, record_size(RECORD, ["msg_2"]))


async def test_the_redis_store_sets_its_ttl_and_forgets_what_expired(redis_url: str) -> None:
    """Redis expires the keys (their time to live is set); the index forgets an expired
    record at the next write, so it no longer counts against the bounds."""
    namespace = f"test:{uuid.uuid4().hex}"
    store = RedisResponseStore(redis_url, namespace=namespace, ttl=120.0, max_count=2, timeout=5.0)
    await store.put("key", "resp_1", RECORD, ["msg_1"])
    client: Any = redis_asyncio.Redis.from_url(redis_url)
    keys = [key async for key in client.scan_iter(f"{namespace}:*")]
    expiring = [key for key in keys if b":r:" in key or b":i:" in key]
    assert len(expiring) == 2
    for key in expiring:
        assert 110_000 < await client.pttl(key) <= 120_000
    # resp_1 expires (as far as the index knows: Redis drops its keys itself).
    member = (await client.zrange(f"{namespace}:index", 0, -1))[0]
    await client.zadd(f"{namespace}:index", {member: 0})
    await store.put("key", "resp_2", RECORD, [])
    await store.put("key", "resp_3", RECORD, [])
    assert await store.get("key", "resp_1") is None
    assert [await store.get("key", r) for r in ("resp_2", "resp_3")] == [RECORD, RECORD]
    assert int(await client.get(f"{namespace}:bytes")) == 2 * record_size(RECORD, [])
    await client.aclose()
    await store.aclose()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ttl": 0}, "ttl"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"max_count": True}, "max_count"),
    ],
)
def test_bounds_are_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryResponseStore(**options)
    with pytest.raises(ValueError, match=message):
        RedisResponseStore("redis://127.0.0.1:1/0", **options)
