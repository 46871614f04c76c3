"""Versioned migrations: numbered SQL files per dialect, applied in order, each once."""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from importlib import resources

from pipeline._db._base import Connection, Database, Dialect
from pipeline.errors import SchemaVersionError

__all__ = [
    "MIGRATIONS_TABLE",
    "Migration",
    "latest_version",
    "migrations",
    "require_schema",
    "schema_version",
    "upgrade",
]

MIGRATIONS_TABLE = "chat_pipeline_migrations"
"""The table that lists the migrations applied (version, name, when)."""

_FILE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")

_CREATE = (
    f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} "
    "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at_us BIGINT NOT NULL)"
)


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered step of the schema, for one dialect."""

    version: int
    name: str
    sql: str


@functools.cache
def migrations(dialect: Dialect) -> tuple[Migration, ...]:
    """The dialect's migrations in order (``migrations/<dialect>/NNNN_name.sql``); numbered
    from 1 without gaps, or `RuntimeError` (a packaging mistake)."""
    folder = resources.files("pipeline._db").joinpath("migrations", dialect)
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _FILE.fullmatch(entry.name)
        if match is None:
            continue
        found.append(Migration(int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda migration: migration.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"the {dialect} migrations are not numbered 1, 2, 3 ...: {found!r}")
    return tuple(found)


def latest_version(dialect: Dialect) -> int:
    """The version this code's schema has."""
    return len(migrations(dialect))


async def _applied(connection: Connection | Database) -> int:
    rows = await connection.fetch(f"SELECT MAX(version) FROM {MIGRATIONS_TABLE}")
    return int(rows[0][0] or 0) if rows else 0


async def schema_version(database: Database) -> int:
    """The version of `database`'s schema (0: none applied yet)."""
    rows = await database.fetch(_TABLE_EXISTS[database.dialect], (MIGRATIONS_TABLE,))
    if not rows or not rows[0][0]:
        return 0
    return await _applied(database)


_TABLE_EXISTS: dict[Dialect, str] = {
    "sqlite": "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
    "postgres": (
        "SELECT COUNT(*) FROM information_schema.tables "
        "WHERE table_name = ? AND table_schema = current_schema()"
    ),
}


async def upgrade(database: Database, *, target: int | None = None) -> list[Migration]:
    """Apply the migrations `database` lacks, up to `target` (default: the latest), each in
    a transaction of its own with its version row, under the exclusive lock (so replicas
    upgrading together apply each once). Returns those applied here."""
    known = migrations(database.dialect)
    target = len(known) if target is None else target
    if not 0 <= target <= len(known):
        raise ValueError(f"no migration {target}: this code knows 1 to {len(known)}")

    async def create(connection: Connection) -> None:
        # Under the lock: PostgreSQL's CREATE TABLE IF NOT EXISTS races with another one.
        await connection.execute(_CREATE)

    await database.transaction(create, exclusive=True)
    applied: list[Migration] = []
    for migration in known[:target]:

        async def step(connection: Connection, migration: Migration = migration) -> bool:
            if await _applied(connection) >= migration.version:
                return False  # another process applied it meanwhile
            await connection.script(migration.sql)
            await connection.execute(
                f"INSERT INTO {MIGRATIONS_TABLE} (version, name, applied_at_us) VALUES (?, ?, ?)",
                (migration.version, migration.name, int(time.time() * 1e6)),
            )
            return True

        if await _applied(database) >= migration.version:
            continue
        if await database.transaction(step, exclusive=True):
            applied.append(migration)
    return applied


async def require_schema(database: Database) -> int:
    """The schema's version when it is this code's; `SchemaVersionError` when it is behind
    (saying to run ``chat-pipeline db upgrade``) or ahead (newer code wrote it)."""
    found = await schema_version(database)
    latest = latest_version(database.dialect)
    if found < latest:
        raise SchemaVersionError(
            f"the {database.describe()} database's schema is at version {found}, this code "
            f"needs {latest}: run `chat-pipeline db upgrade`",
            found=found,
            expected=latest,
        )
    if found > latest:
        raise SchemaVersionError(
            f"the {database.describe()} database's schema is at version {found}, newer than "
            f"this code's {latest}: upgrade chat-pipeline",
            found=found,
            expected=latest,
        )
    return found
