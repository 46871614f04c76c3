"""Idempotency for tool calls: where completed calls are recorded, and their keys.

Every tool call has a key made of the request's operation id, the tool name and the
canonical arguments (`idempotency_key`); a call whose key is recorded as completed is not
executed again. `MemoryIdempotencyStore` serves one process; `RedisIdempotencyStore`
shares the record between processes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "IdempotencyStore",
    "MemoryIdempotencyStore",
    "RedisIdempotencyStore",
    "idempotency_key",
]


@runtime_checkable
class IdempotencyStore(Protocol):
    """Where completed tool calls are recorded, by idempotency key."""

    async def get(self, key: str) -> tuple[bool, Any]:
        """``(True, result)`` when `key` is recorded as completed, else ``(False, None)``."""
        ...

    async def put(self, key: str, result: Any) -> None: ...


class MemoryIdempotencyStore:
    """An in-process store (the default). Bounded: the oldest keys are forgotten first."""

    def __init__(self, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._results: dict[str, Any] = {}

    async def get(self, key: str) -> tuple[bool, Any]:
        if key in self._results:
            return True, self._results[key]
        return False, None

    async def put(self, key: str, result: Any) -> None:
        self._results[key] = result
        while len(self._results) > self.max_entries:
            del self._results[next(iter(self._results))]

    def __len__(self) -> int:
        return len(self._results)


class RedisIdempotencyStore:
    """Shares completed tool calls between processes through Redis (``redis.asyncio``).

    Results are stored as JSON (tools used with it must return JSON-serializable values)
    under ``{namespace}:{key}`` for `ttl` seconds.
    """

    def __init__(
        self, redis: Any, *, namespace: str = "chat_pipeline:tool", ttl: float = 86_400
    ) -> None:
        if isinstance(redis, str):
            import redis.asyncio as redis_asyncio

            redis = redis_asyncio.Redis.from_url(redis)
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self._redis = redis
        self.namespace = namespace
        self.ttl = ttl

    async def get(self, key: str) -> tuple[bool, Any]:
        raw = await self._redis.get(f"{self.namespace}:{key}")
        if raw is None:
            return False, None
        return True, json.loads(raw)

    async def put(self, key: str, result: Any) -> None:
        await self._redis.set(
            f"{self.namespace}:{key}", json.dumps(result), px=int(self.ttl * 1000)
        )

    async def aclose(self) -> None:
        await self._redis.aclose()


def idempotency_key(operation_id: str, tool_name: str, arguments: Mapping[str, Any]) -> str:
    """A stable key for one tool call: operation id, tool name, canonical JSON arguments."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(f"{operation_id}\0{tool_name}\0{canonical}".encode())
    return digest.hexdigest()
