"""PostgreSQL through asyncpg: a pool per event loop, made at the first call, every call
bounded as a whole."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pipeline._db._base import DEFAULT_POOL_SIZE, Connection, Database, placeholders

__all__ = ["ADVISORY_LOCK", "PostgresDatabase"]

_T = TypeVar("_T")

ADVISORY_LOCK = 0x63_68_61_74_70_69_70_65  # "chatpipe": the project's advisory lock key
"""The ``pg_advisory_xact_lock`` an exclusive transaction holds (migrations take it)."""


def _asyncpg() -> Any:
    try:
        import asyncpg
    except ImportError as exc:  # pragma: no cover - only without the postgres extra
        raise ValueError(
            "PostgreSQL needs the asyncpg package: pip install 'chat-pipeline[postgres]'"
        ) from exc
    return asyncpg


class _Connection:
    """The statements of one transaction (a `Connection`)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        await self._raw.execute(placeholders(sql), *params)

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        await self._raw.executemany(placeholders(sql), rows)

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in await self._raw.fetch(placeholders(sql), *params)]

    async def script(self, sql: str) -> None:
        await self._raw.execute(sql)  # no parameters: the simple protocol runs them all


class PostgresDatabase(Database):
    """A PostgreSQL database (asyncpg). Connections are made in the running event loop at
    the first call (``min_size=0``: a pool never connects on its own), at most `pool_size`
    of them; a call waiting for one waits within its own bound."""

    dialect = "postgres"

    def __init__(
        self, dsn: str, *, timeout: float = 5.0, pool_size: int = DEFAULT_POOL_SIZE
    ) -> None:
        super().__init__(timeout=timeout)
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        parts = urlsplit(dsn)
        if parts.scheme not in ("postgresql", "postgres") or not (parts.hostname or parts.path):
            raise ValueError("expected a postgresql:// URL with a host or a database")
        self._asyncpg = _asyncpg()  # imported while building, not inside a request's call
        self._dsn = dsn
        self._where = f"{parts.hostname or 'local'}:{parts.port or 5432}{parts.path or ''}"
        self.pool_size = pool_size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[Any] | None = None

    def describe(self) -> str:
        return f"postgres {self._where}"  # never the user or password

    def _pool_now(self) -> asyncio.Future[Any]:
        """The pool of the running event loop, once initialized (with ``min_size=0`` that
        connects nothing, so it cannot fail)."""
        loop = asyncio.get_running_loop()
        ready = self._ready
        if self._loop is not loop or ready is None:
            pool = self._asyncpg.create_pool(
                self._dsn,
                min_size=0,
                max_size=self.pool_size,
                timeout=self.timeout,  # connecting
                command_timeout=self.timeout,
                # A pooled connection idle for a minute is closed: a database restarted
                # meanwhile costs no failed call on a dead connection later.
                max_inactive_connection_lifetime=60.0,
            )

            async def initialized() -> Any:
                await pool
                return pool

            ready = self._ready = asyncio.ensure_future(initialized())
            self._loop = loop
        return ready

    async def _call(self, call: Callable[[Any], Awaitable[_T]]) -> _T:
        async with asyncio.timeout(self.timeout):
            pool = await asyncio.shield(self._pool_now())
            async with pool.acquire() as raw:
                return await call(raw)

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        await self._call(lambda raw: raw.execute(placeholders(sql), *params))

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        # asyncpg's executemany is one transaction, its statements pipelined.
        await self._call(lambda raw: raw.executemany(placeholders(sql), rows))

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        rows = await self._call(lambda raw: raw.fetch(placeholders(sql), *params))
        return [tuple(row) for row in rows]

    async def transaction(
        self, work: Callable[[Connection], Awaitable[_T]], *, exclusive: bool = False
    ) -> _T:
        async def run(raw: Any) -> _T:
            async with raw.transaction():
                if exclusive:
                    await raw.execute("SELECT pg_advisory_xact_lock($1)", ADVISORY_LOCK)
                return await work(_Connection(raw))

        return await self._call(run)

    async def aclose(self) -> None:
        ready, loop = self._ready, self._loop
        self._ready = self._loop = None
        if ready is None or loop is not asyncio.get_running_loop():
            return  # a pool of another event loop goes with that loop
        pool = await ready
        try:
            async with asyncio.timeout(self.timeout):
                await pool.close()
        except (TimeoutError, OSError):
            pool.terminate()
