"""The database a deployment keeps its records in: SQLite (embedded, one file, no server) or
PostgreSQL (shared by replicas), behind one small API, with versioned migrations.

Promises, to every component built on it (the spend ledger, the virtual keys):

* `open_database(url)` takes ``sqlite:///path/to/file.db`` (or a plain path) or a
  ``postgresql://`` / ``postgres://`` URL. Opening never connects: a connection is made in the
  running event loop at the first call (a new loop gets its own), so building a pipeline
  or a gateway never waits on a database. A URL is never echoed (it may hold a password);
* every call (`Database.execute`, `executemany`, `fetch`, `transaction`) is bounded by the
  database's `timeout` as a whole (waiting for a connection, connecting, the statement); a
  call cut short raises `TimeoutError`, and its connection is not reused;
* at most `pool_size` connections per process and event loop (PostgreSQL: an asyncpg pool
  made lazily, ``min_size=0``); SQLite runs every call on one thread of its own, in order,
  with WAL journaling, so a reader never blocks the writer;
* SQL is written once with ``?`` placeholders; the PostgreSQL side numbers them (``$1``,
  ``$2``, ...). Dialect-specific SQL (arrays, JSON) is the caller's, by `Database.dialect`;
* migrations (`upgrade`, `schema_version`; numbered ``NNNN_name.sql`` files per dialect under
  ``pipeline/_db/migrations/<dialect>/``) are applied in order, each in a transaction with
  its version row, under a lock (PostgreSQL: an advisory lock; SQLite: ``BEGIN IMMEDIATE``),
  so replicas upgrading at once apply each migration once. `chat-pipeline db upgrade` runs
  them; `require_schema` refuses a database behind (or ahead of) this code with
  `SchemaVersionError`.

A new table is a new migration file for each dialect, numbered after the last: never an edit
of an applied one.
"""

from __future__ import annotations

from pipeline._db._base import Connection, Database, placeholders
from pipeline._db._migrations import (
    MIGRATIONS_TABLE,
    Migration,
    latest_version,
    migrations,
    require_schema,
    schema_version,
    upgrade,
)
from pipeline._db._open import open_database

__all__ = [
    "MIGRATIONS_TABLE",
    "Connection",
    "Database",
    "Migration",
    "latest_version",
    "migrations",
    "open_database",
    "placeholders",
    "require_schema",
    "schema_version",
    "upgrade",
]
