"""What every database offers (`Database`, `Connection`) and `open_database`."""

from __future__ import annotations

import abc
import functools
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Literal, Protocol, TypeVar

__all__ = [
    "DEFAULT_POOL_SIZE",
    "DEFAULT_TIMEOUT",
    "Connection",
    "Database",
    "Dialect",
    "placeholders",
]

Dialect = Literal["sqlite", "postgres"]
_T = TypeVar("_T")

DEFAULT_TIMEOUT = 5.0
"""Seconds a call may take, unless the database was opened with another bound."""
DEFAULT_POOL_SIZE = 4
"""Connections per process (and event loop) to a PostgreSQL database."""


class Connection(Protocol):
    """One connection inside a transaction (`Database.transaction`): the statements run in
    order, and commit together when the work returns (or roll back when it raises)."""

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Run one statement (``?`` placeholders)."""

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per row of parameters."""

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows a query returns."""

    async def script(self, sql: str) -> None:
        """Run several statements without parameters (a migration's file)."""


class Database(abc.ABC):
    """A database of one dialect; every call bounded by `timeout` seconds (see the package
    docstring). Statements outside `transaction` commit on their own."""

    dialect: ClassVar[Dialect]

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not timeout > 0:
            raise ValueError("timeout must be positive seconds")
        self.timeout = timeout

    @abc.abstractmethod
    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Run one statement."""

    @abc.abstractmethod
    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per row, in one transaction."""

    @abc.abstractmethod
    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows a query returns."""

    @abc.abstractmethod
    async def transaction(
        self, work: Callable[[Connection], Awaitable[_T]], *, exclusive: bool = False
    ) -> _T:
        """Run `work` on one connection in one transaction, bounded as one call; with
        `exclusive`, no other writer runs meanwhile (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL:
        the transaction holds the project's advisory lock)."""

    async def ping(self) -> str:
        """``ok``, or ``unavailable (<error type>)`` (a readiness answer: never raises)."""
        try:
            await self.fetch("SELECT 1")
        except Exception as exc:  # the answer, not an error of the caller
            return f"unavailable ({type(exc).__name__})"
        return "ok"

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the connections made here."""

    @abc.abstractmethod
    def describe(self) -> str:
        """What this database is, for logs and errors: never a password."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


_QUESTION = re.compile(r"'(?:[^']|'')*'|\?")


@functools.lru_cache(maxsize=256)
def placeholders(sql: str) -> str:
    """`sql` with each ``?`` placeholder (outside quoted strings) as ``$1``, ``$2``, ...:
    PostgreSQL's numbering. Made once per statement."""
    count = 0

    def number(match: re.Match[str]) -> str:
        nonlocal count
        if match.group(0) != "?":
            return match.group(0)
        count += 1
        return f"${count}"

    return _QUESTION.sub(number, sql)
