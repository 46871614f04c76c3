"""Virtual keys: keys a gateway hands out, scopes to models, limits, budgets and takes
back (`chat-pipeline keys`, ``/admin/keys``), and the `Budget` keys, teams and users have.

A key's secret is shown once, when it is created or rotated (`IssuedKey`); only its SHA-256
is stored. `KeyStore` backends: `MemoryKeyStore`, `SQLiteKeyStore`, `PostgresKeyStore`; a
gateway replica reads the keys through a `KeyRing`, never the database on a request's path.
"""

from __future__ import annotations

from pipeline.keys._model import (
    SECRET_PREFIX,
    Budget,
    IssuedKey,
    VirtualKey,
    hash_secret,
    model_allowed,
    period_bounds,
)
from pipeline.keys._ring import KeyRing, Lookup
from pipeline.keys._store import (
    DatabaseKeyStore,
    KeyNotFoundError,
    KeyRecord,
    KeyStore,
    MemoryKeyStore,
    PostgresKeyStore,
    SQLiteKeyStore,
)

__all__ = [
    "SECRET_PREFIX",
    "Budget",
    "DatabaseKeyStore",
    "IssuedKey",
    "KeyNotFoundError",
    "KeyRecord",
    "KeyRing",
    "KeyStore",
    "Lookup",
    "MemoryKeyStore",
    "PostgresKeyStore",
    "SQLiteKeyStore",
    "VirtualKey",
    "hash_secret",
    "model_allowed",
    "period_bounds",
]
