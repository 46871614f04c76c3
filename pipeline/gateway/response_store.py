"""Where the gateway keeps the responses clients ask it to store (the Responses API's
``store``): `MemoryResponseStore` in one process, `RedisResponseStore` shared by every worker
and replica.

A store keeps records (bytes the gateway encodes) by partition (the caller's key: a
partition never sees another's records) and response id, and which response each item id
of a record belongs to (so an ``item_reference`` finds its item). Both stores promise: at
most `max_count` records and `max_bytes` bytes (records, plus the item ids indexed), the
oldest out first; a record larger than `max_bytes` is not kept; each record and its items
forgotten `ttl` seconds after they were stored. A store of your own implements
`ResponseStore`; the gateway bounds each of its calls in time and answers "not found"
while it fails.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from pipeline import _redis

__all__ = ["MemoryResponseStore", "RedisResponseStore", "ResponseStore"]

_OVERHEAD = 64
"""Bytes counted per record, and per item id indexed, beyond the bytes themselves."""


def _checked_bounds(ttl: float, max_bytes: int, max_count: int, timeout: float = 1.0) -> None:
    for name, seconds in (("ttl", ttl), ("timeout", timeout)):
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ValueError(f"{name} must be a positive number of seconds")
        if not 0 < seconds < float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds")
    for name, value in (("max_bytes", max_bytes), ("max_count", max_count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer")


def record_size(record: bytes, items: Sequence[str]) -> int:
    """The bytes a record counts against `max_bytes`: itself and its indexed item ids."""
    return len(record) + _OVERHEAD + sum(len(item) + _OVERHEAD for item in items)


@runtime_checkable
class ResponseStore(Protocol):
    """Stored responses by partition and id (see the module docstring). A call that fails
    raises; the gateway then answers as if nothing were stored."""

    async def put(
        self, partition: str, response_id: str, record: bytes, items: Sequence[str]
    ) -> bool:
        """Keep `record` (replacing one of the same id), its `items` pointing to it; False
        when it is larger than the store's bound and was not kept."""
        ...

    async def get(self, partition: str, response_id: str) -> bytes | None:
        """The record, or None (never stored, expired, evicted, deleted, or another
        partition's)."""
        ...

    async def owners(self, partition: str, items: Sequence[str]) -> list[str | None]:
        """For each item id, the id of the latest response of `partition` holding it, or
        None."""
        ...

    async def delete(self, partition: str, response_id: str) -> bool:
        """Forget a record and its items; whether there was one."""
        ...

    async def aclose(self) -> None:
        """Release what the store holds open."""
        ...


class MemoryResponseStore:
    """Records in this process (a worker's own: with several workers or replicas, use
    `RedisResponseStore`). Never waits. `clock` is injectable."""

    def __init__(
        self,
        *,
        ttl: float = 86400.0,
        max_bytes: int = 64 << 20,
        max_count: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _checked_bounds(ttl, max_bytes, max_count)
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.max_count = max_count
        self._clock = clock
        # In the order stored (the oldest first, which with one ttl also expires first).
        self._records: OrderedDict[tuple[str, str], tuple[bytes, float, tuple[str, ...]]] = (
            OrderedDict()
        )
        self._owners: dict[tuple[str, str], str] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def _drop(self, key: tuple[str, str]) -> None:
        record, _, items = self._records.pop(key)
        partition, response_id = key
        self.bytes -= record_size(record, items)
        for item in items:
            if self._owners.get((partition, item)) == response_id:
                del self._owners[(partition, item)]

    def _expire(self) -> None:
        now = self._clock()
        while self._records:
            key, (_, expires, _) = next(iter(self._records.items()))
            if expires > now:
                return
            self._drop(key)

    async def put(
        self, partition: str, response_id: str, record: bytes, items: Sequence[str]
    ) -> bool:
        self._expire()
        key = (partition, response_id)
        if key in self._records:
            self._drop(key)
        size = record_size(record, items)
        if size > self.max_bytes:
            return False
        while self._records and (
            len(self._records) >= self.max_count or self.bytes + size > self.max_bytes
        ):
            self._drop(next(iter(self._records)))
        self._records[key] = (record, self._clock() + self.ttl, tuple(items))
        self.bytes += size
        for item in items:
            self._owners[(partition, item)] = response_id
        return True

    async def get(self, partition: str, response_id: str) -> bytes | None:
        self._expire()
        kept = self._records.get((partition, response_id))
        return None if kept is None else kept[0]

    async def owners(self, partition: str, items: Sequence[str]) -> list[str | None]:
        self._expire()
        return [self._owners.get((partition, item)) for item in items]

    async def delete(self, partition: str, response_id: str) -> bool:
        self._expire()
        key = (partition, response_id)
        if key not in self._records:
            return False
        self._drop(key)
        return True

    async def aclose(self) -> None:
        self._records.clear()
        self._owners.clear()
        self.bytes = 0

    def __repr__(self) -> str:
        return (
            f"MemoryResponseStore(records={len(self)}/{self.max_count}, "
            f"bytes={self.bytes}/{self.max_bytes})"
        )


# Forgetting one record (its member of the index: "partition:id"): the record, its
# accounting, and each of its items that still points to it.
_DROP = """
local function drop(ns, index, meta, total, member)
  local info = redis.call('HGET', meta, member)
  redis.call('ZREM', index, member)
  redis.call('DEL', ns .. ':r:' .. member)
  if not info then return end
  redis.call('HDEL', meta, member)
  local partition, id = string.match(member, '^([^:]*):(.*)$')
  local first = true
  for word in string.gmatch(info, '%S+') do
    if first then
      redis.call('DECRBY', total, tonumber(word))
      first = false
    else
      local owner = ns .. ':i:' .. partition .. ':' .. word
      if redis.call('GET', owner) == id then redis.call('DEL', owner) end
    end
  end
end
"""

# KEYS: index, meta, total. ARGV: namespace, partition, id, record, size, ttl (ms),
# max_bytes, max_count, item ids... The expired go first, then the oldest until the record
# fits; the index's score is when a record expires (Redis's own clock).
_PUT = (
    _DROP
    + """
local index, meta, total = KEYS[1], KEYS[2], KEYS[3]
local ns, partition, id, record = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local size, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local max_bytes, max_count = tonumber(ARGV[7]), tonumber(ARGV[8])
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', ms)) do
  drop(ns, index, meta, total, member)
end
local member = partition .. ':' .. id
drop(ns, index, meta, total, member)
if size > max_bytes then return 0 end
while true do
  local used = tonumber(redis.call('GET', total) or '0')
  if redis.call('ZCARD', index) < max_count and used + size <= max_bytes then break end
  local oldest = redis.call('ZRANGE', index, 0, 0)
  if #oldest == 0 then
    redis.call('SET', total, 0)
    break
  end
  drop(ns, index, meta, total, oldest[1])
end
redis.call('SET', ns .. ':r:' .. member, record, 'PX', ttl)
local info = {tostring(size)}
for i = 9, #ARGV do
  redis.call('SET', ns .. ':i:' .. partition .. ':' .. ARGV[i], id, 'PX', ttl)
  info[#info + 1] = ARGV[i]
end
redis.call('HSET', meta, member, table.concat(info, ' '))
redis.call('ZADD', index, ms + ttl, member)
redis.call('INCRBY', total, size)
return 1
"""
)

# KEYS: index, meta, total. ARGV: namespace, member.
_DELETE = (
    _DROP
    + """
local existed = redis.call('EXISTS', ARGV[1] .. ':r:' .. ARGV[2])
drop(ARGV[1], KEYS[1], KEYS[2], KEYS[3], ARGV[2])
return existed
"""
)


class RedisResponseStore:
    """Records shared by every worker and replica through Redis (a URL or a
    ``redis.asyncio`` client; see `pipeline._redis`), under `namespace`: one key per record
    and per item, expiring with the `ttl`, and an index of what is kept (a sorted set, a
    hash and a byte count) that one Lua script per write keeps within the bounds, as one
    atomic step. A partition is a hash of the caller's identity in the keys' names.

    Each call is one round trip (an item lookup two), bounded by `timeout` seconds; what
    goes wrong is raised (`TimeoutError`, a connection error) for the gateway to answer
    "not found". Needs a Redis of one node (the script names keys it finds, as Redis
    Cluster does not allow)."""

    def __init__(
        self,
        url: Any,
        *,
        ttl: float = 86400.0,
        max_bytes: int = 64 << 20,
        max_count: int = 10_000,
        namespace: str = "chat_pipeline:responses",
        timeout: float = 0.5,
    ) -> None:
        _checked_bounds(ttl, max_bytes, max_count, timeout)
        if not isinstance(namespace, str) or not namespace or " " in namespace:
            raise ValueError("namespace must be a non-empty string without spaces")
        try:
            self._redis = _redis.RedisClient(url, timeout=timeout)
        except ValueError as exc:
            raise ValueError(f"redis: {exc}") from None
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.namespace = namespace
        self.timeout = timeout
        self._index = [f"{namespace}:index", f"{namespace}:meta", f"{namespace}:bytes"]

    @staticmethod
    def _partition(partition: str) -> str:
        # The caller's identity never appears in a key's name; its hash keeps keys short.
        return hashlib.sha256(partition.encode()).hexdigest()[:32]

    def _record_key(self, partition: str, response_id: str) -> str:
        return f"{self.namespace}:r:{self._partition(partition)}:{response_id}"

    async def put(
        self, partition: str, response_id: str, record: bytes, items: Sequence[str]
    ) -> bool:
        arguments = [
            self.namespace,
            self._partition(partition),
            response_id,
            record,
            record_size(record, items),
            max(1, round(self.ttl * 1000)),
            self.max_bytes,
            self.max_count,
            *items,
        ]
        kept = await self._redis.script(_PUT, self._index, arguments)
        return bool(kept)

    async def get(self, partition: str, response_id: str) -> bytes | None:
        key = self._record_key(partition, response_id)
        value = await self._redis.call(lambda client: client.get(key))
        return _bytes(value)

    async def owners(self, partition: str, items: Sequence[str]) -> list[str | None]:
        if not items:
            return []
        hashed = self._partition(partition)
        keys = [f"{self.namespace}:i:{hashed}:{item}" for item in items]
        values = await self._redis.call(lambda client: client.mget(keys))
        found: list[str | None] = []
        for value in values:
            raw = _bytes(value)
            found.append(None if raw is None else raw.decode("utf-8", "replace"))
        return found

    async def delete(self, partition: str, response_id: str) -> bool:
        member = f"{self._partition(partition)}:{response_id}"
        existed = await self._redis.script(_DELETE, self._index, [self.namespace, member])
        return bool(existed)

    async def aclose(self) -> None:
        """Close the client made from a URL (a client of your own stays open)."""
        await self._redis.aclose()

    def __repr__(self) -> str:  # never the URL: it may hold a password
        return f"RedisResponseStore({self._redis!r})"


def _bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    # A client of the caller's own may decode replies (decode_responses=True).
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else None
