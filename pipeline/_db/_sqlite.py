"""SQLite, embedded: one file, every call on one thread of its own (in order), WAL journaling."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pipeline._db._base import Connection, Database

__all__ = ["SQLiteDatabase"]

_T = TypeVar("_T")


class _Connection:
    """The statements of one transaction, run on the database's thread (a `Connection`)."""

    __slots__ = ("_database", "_raw")

    def __init__(self, database: SQLiteDatabase, raw: sqlite3.Connection) -> None:
        self._database = database
        self._raw = raw

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        await self._database._on_thread(lambda: self._raw.execute(sql, tuple(params)))

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        await self._database._on_thread(lambda: self._raw.executemany(sql, rows))

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self._database._on_thread(
            lambda: self._raw.execute(sql, tuple(params)).fetchall()
        )

    async def script(self, sql: str) -> None:
        # Statement by statement: executescript() would commit the open transaction first.
        def run() -> None:
            for statement in _statements(sql):
                self._raw.execute(statement)

        await self._database._on_thread(run)


def _statements(sql: str) -> list[str]:
    """The complete statements of a script, in order (sqlite3.complete_statement decides)."""
    found: list[str] = []
    pending = ""
    for line in sql.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            if pending.strip():
                found.append(pending.strip())
            pending = ""
    if pending.strip() and not all(
        part.strip().startswith("--") or not part.strip() for part in pending.splitlines()
    ):
        raise ValueError("the SQL script ends inside a statement")
    return found


_WAL_RETRY_PAUSE = 0.01


def _switch_to_wal(raw: sqlite3.Connection, timeout: float) -> None:
    """Put the file in WAL mode, waiting up to `timeout` seconds for other connections
    switching it at the same moment: SQLite answers "database is locked" at once there,
    without its busy handler (which could deadlock), so replicas opening one new file
    together would fail."""
    for attempt in range(max(1, int(timeout / _WAL_RETRY_PAUSE))):  # bounded by `timeout`
        try:
            raw.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or (attempt + 1) * _WAL_RETRY_PAUSE >= timeout:
                raise
        time.sleep(_WAL_RETRY_PAUSE)  # on the database's own thread, never the loop's


class SQLiteDatabase(Database):
    """A SQLite file (made with its folder when missing). One connection, used only by this
    database's own thread; calls run one at a time, in order (a transaction's statements
    together), each bounded by `timeout` (which also bounds waiting for another process's
    write lock)."""

    dialect = "sqlite"

    def __init__(self, path: Path, *, timeout: float = 5.0) -> None:
        super().__init__(timeout=timeout)
        self.path = path
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._raw: sqlite3.Connection | None = None
        self._turn = asyncio.Lock()

    def describe(self) -> str:
        return f"sqlite {self.path}"

    def _connection(self) -> sqlite3.Connection:
        """The connection (made at the first call, on the database's thread)."""
        raw = self._raw
        if raw is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: autocommit, transactions only where BEGIN says so.
            raw = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
            _switch_to_wal(raw, self.timeout)
            raw.execute("PRAGMA synchronous=NORMAL")
            self._raw = raw
        return raw

    async def _on_thread(self, call: Callable[[], _T]) -> _T:
        """Run `call` on the database's thread (the caller holds the turn and the bound)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="chat-pipeline-sqlite"
            )
        future = self._executor.submit(call)
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            future.cancel()  # not started yet: never runs; running: finishes on its own
            raise

    async def _call(self, call: Callable[[sqlite3.Connection], _T]) -> _T:
        async with asyncio.timeout(self.timeout), self._turn:
            return await self._on_thread(lambda: call(self._connection()))

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        await self._call(lambda raw: raw.execute(sql, tuple(params)))

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        def run(raw: sqlite3.Connection) -> None:
            raw.execute("BEGIN")
            try:
                raw.executemany(sql, rows)
            except BaseException:
                raw.execute("ROLLBACK")
                raise
            raw.execute("COMMIT")

        await self._call(run)

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self._call(lambda raw: raw.execute(sql, tuple(params)).fetchall())

    async def transaction(
        self, work: Callable[[Connection], Awaitable[_T]], *, exclusive: bool = False
    ) -> _T:
        begin = "BEGIN IMMEDIATE" if exclusive else "BEGIN"
        async with asyncio.timeout(self.timeout), self._turn:
            raw = await self._on_thread(self._connection)
            await self._on_thread(lambda: raw.execute(begin))
            try:
                result = await work(_Connection(self, raw))
            except BaseException:
                await asyncio.shield(self._on_thread(lambda: raw.execute("ROLLBACK")))
                raise
            await self._on_thread(lambda: raw.execute("COMMIT"))
            return result

    async def aclose(self) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return

        def close() -> None:
            raw, self._raw = self._raw, None
            if raw is not None:
                raw.close()

        await asyncio.wrap_future(executor.submit(close))
        executor.shutdown(wait=False)
