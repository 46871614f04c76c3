"""The database a deployment keeps its records in: SQLite (embedded, one file, no server) or
PostgreSQL (shared by replicas), behind one small API, with versioned migrations.

Opening never connects; every call is bounded by the database's `timeout`; migrations are
applied in order, each once, even by replicas upgrading at once; a URL is never echoed.

The details and the reasons: the design notes (docs/internals.md).
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
