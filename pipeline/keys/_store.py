"""Where virtual keys live: `KeyStore` (the operations, checked once here) over three
backends: `MemoryKeyStore` (tests, one process), and a `pipeline._db` database (the spend ledger's:
`SQLiteKeyStore` for one host, `PostgresKeyStore` for replicas).

Every change (create, update, rotate, revoke) gets the next number of one counter, taken
in the change's own transaction (a row lock in PostgreSQL, the single writer in SQLite), so
changes commit in the order of their numbers and a replica asking for the changes after
the last number it saw (`KeyStore.changes`) never misses one.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pipeline import _db
from pipeline.errors import KeyNotFoundError
from pipeline.keys._model import (
    SHOWN,
    Budget,
    IssuedKey,
    VirtualKey,
    check_limit,
    check_metadata,
    check_models,
    check_name,
    hash_secret,
    new_key_id,
    new_secret,
)

__all__ = [
    "DatabaseKeyStore",
    "KeyNotFoundError",
    "KeyRecord",
    "KeyStore",
    "MemoryKeyStore",
    "PostgresKeyStore",
    "SQLiteKeyStore",
]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A key as replicas cache it: the key, and each secret's hash with the time it stops
    working (None: while the key does)."""

    key: VirtualKey
    secrets: tuple[tuple[str, datetime | None], ...]
    version: int = 0


_UPDATABLE = frozenset(
    {"name", "team", "user", "models", "rpm", "tpm", "budget", "expires_at", "metadata"}
)


def _now() -> datetime:
    return datetime.now(UTC)


def _checked(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Validated key fields (`ValueError` naming the field, never echoing a value)."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name not in _UPDATABLE:
            raise ValueError(f"{name}: not a key setting")
        if name == "name":
            out[name] = check_name(value)
        elif name in ("team", "user"):
            out[name] = None if value is None else check_name(value, name)
        elif name == "models":
            out[name] = check_models(value or ())
        elif name in ("rpm", "tpm"):
            out[name] = check_limit(value, name)
        elif name == "budget":
            if value is not None and not isinstance(value, Budget):
                value = Budget(**value) if isinstance(value, Mapping) else Budget(value)
            out[name] = value
        elif name == "expires_at":
            if value is not None and not (isinstance(value, datetime) and value.tzinfo):
                raise ValueError("expires_at: expected a time with its zone")
            out[name] = value.astimezone(UTC) if value is not None else None
        elif name == "metadata":
            out[name] = check_metadata(value or {})
    return out


class KeyStore:
    """The operations on virtual keys, over a backend's five primitives. A key is named by
    its id or its name (`ref`); an unknown one is `KeyNotFoundError`; a bad field is a
    `ValueError` naming it; a name taken is a `ValueError`."""

    async def create(self, name: str, **fields: Any) -> IssuedKey:
        """A new key and its secret (shown once: only its hash is kept)."""
        checked = _checked({"name": name, **fields})
        secret = new_secret()
        key = VirtualKey(id=new_key_id(), prefix=secret[:SHOWN], created_at=_now(), **checked)
        await self._insert(key, hash_secret(secret))
        return IssuedKey(key, secret)

    async def get(self, ref: str) -> VirtualKey:
        return (await self.record(ref)).key

    async def record(self, ref: str) -> KeyRecord:
        found = await self._load(ref)
        if found is None:
            raise KeyNotFoundError(f"no key {ref!r}" if _printable(ref) else "no such key")
        return found

    async def list(self) -> builtins.list[VirtualKey]:
        _, records = await self.changes(0)
        return sorted((r.key for r in records), key=lambda k: (k.created_at or _now(), k.id))

    async def update(self, ref: str, **changes: Any) -> VirtualKey:
        checked = _checked(changes)
        record = await self.record(ref)
        key = replace(record.key, **checked)
        await self._write(key, list(record.secrets))
        return key

    async def rotate(self, ref: str, *, grace: float = 0.0) -> IssuedKey:
        """A new secret for the key; its current secrets keep working `grace` seconds."""
        if isinstance(grace, bool) or not isinstance(grace, int | float) or grace < 0:
            raise ValueError("grace: expected seconds, not negative")
        record = await self.record(ref)
        now = _now()
        ends = now + timedelta(seconds=grace)
        secret = new_secret()
        kept = [
            (digest, ends if until is None or until > ends else until)
            for digest, until in record.secrets
            if until is None or until > now
        ]
        key = replace(record.key, prefix=secret[:SHOWN])
        await self._write(key, [(hash_secret(secret), None), *kept])
        return IssuedKey(key, secret)

    async def revoke(self, ref: str) -> VirtualKey:
        record = await self.record(ref)
        key = record.key if record.key.revoked_at else replace(record.key, revoked_at=_now())
        await self._write(key, list(record.secrets))
        return key

    async def changes(self, since: int) -> tuple[int, builtins.list[KeyRecord]]:
        """The keys changed after change number `since` (every key for 0), and the number
        of the last change."""
        raise NotImplementedError

    async def aclose(self) -> None:
        return None

    # -- a backend's primitives ----------------------------------------------------------

    async def _insert(self, key: VirtualKey, digest: str) -> None:
        raise NotImplementedError

    async def _write(
        self, key: VirtualKey, secrets: builtins.list[tuple[str, datetime | None]]
    ) -> None:
        raise NotImplementedError

    async def _load(self, ref: str) -> KeyRecord | None:
        raise NotImplementedError


def _printable(text: str) -> bool:
    return isinstance(text, str) and len(text) <= 80 and text.isprintable()


class MemoryKeyStore(KeyStore):
    """Keys in this process (tests, a single worker)."""

    def __init__(self) -> None:
        self._records: dict[str, KeyRecord] = {}
        self._version = 0

    async def _insert(self, key: VirtualKey, digest: str) -> None:
        if any(r.key.name == key.name for r in self._records.values()):
            raise ValueError("name: another key has it")
        self._version += 1
        self._records[key.id] = KeyRecord(key, ((digest, None),), self._version)

    async def _write(
        self, key: VirtualKey, secrets: builtins.list[tuple[str, datetime | None]]
    ) -> None:
        if any(r.key.name == key.name and r.key.id != key.id for r in self._records.values()):
            raise ValueError("name: another key has it")
        self._version += 1
        self._records[key.id] = KeyRecord(key, tuple(secrets), self._version)

    async def _load(self, ref: str) -> KeyRecord | None:
        found = self._records.get(ref)
        if found is None:
            found = next((r for r in self._records.values() if r.key.name == ref), None)
        return found

    async def changes(self, since: int) -> tuple[int, builtins.list[KeyRecord]]:
        return self._version, [r for r in self._records.values() if r.version > since]


# -- SQL -------------------------------------------------------------------------------------


def _encode(key: VirtualKey, secrets: Sequence[tuple[str, datetime | None]]) -> tuple[str, str]:
    body = key.as_dict()
    listed = [[digest, until.isoformat() if until else None] for digest, until in secrets]
    return json.dumps(body, sort_keys=True), json.dumps(listed)


def _time(value: str | None) -> datetime | None:
    if value is None:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _decode(body: str, secrets: str, version: int) -> KeyRecord:
    data = json.loads(body)
    budget = data.get("budget")
    key = VirtualKey(
        id=data["id"],
        name=data["name"],
        prefix=data["prefix"],
        team=data.get("team"),
        user=data.get("user"),
        models=tuple(data.get("models") or ()),
        rpm=data.get("rpm"),
        tpm=data.get("tpm"),
        budget=Budget(**budget) if budget else None,
        expires_at=_time(data.get("expires_at")),
        revoked_at=_time(data.get("revoked_at")),
        metadata=data.get("metadata") or {},
        created_at=_time(data.get("created_at")),
    )
    listed = tuple((digest, _time(until)) for digest, until in json.loads(secrets))
    return KeyRecord(key, listed, int(version))


_BUMP = "UPDATE chat_pipeline_key_changes SET last = last + 1 WHERE id = 1 RETURNING last"
_INSERT = "INSERT INTO chat_pipeline_keys (id, name, body, secrets, version) VALUES (?, ?, ?, ?, ?)"
_UPDATE = "UPDATE chat_pipeline_keys SET name = ?, body = ?, secrets = ?, version = ? WHERE id = ?"
_SELECT = "SELECT body, secrets, version FROM chat_pipeline_keys"


class DatabaseKeyStore(KeyStore):
    """Keys in a `pipeline._db` database (the spend ledger's: migration ``0002_keys``). The
    schema is checked at the first call: applied when missing or behind with
    `auto_upgrade`, else refused (`SchemaVersionError`: run ``chat-pipeline db upgrade``)."""

    def __init__(self, database: _db.Database, *, auto_upgrade: bool) -> None:
        self.database = database
        self.auto_upgrade = auto_upgrade
        self._ready = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.database.describe()})"

    async def _prepare(self) -> None:
        if self._ready:
            return
        if self.auto_upgrade:
            await _db.upgrade(self.database)
        else:
            await _db.require_schema(self.database)
        self._ready = True

    async def _insert(self, key: VirtualKey, digest: str) -> None:
        await self._save(key, [(digest, None)], new=True)

    async def _write(
        self, key: VirtualKey, secrets: builtins.list[tuple[str, datetime | None]]
    ) -> None:
        await self._save(key, secrets, new=False)

    async def _save(
        self, key: VirtualKey, secrets: builtins.list[tuple[str, datetime | None]], *, new: bool
    ) -> None:
        await self._prepare()
        body, listed = _encode(key, secrets)

        async def write(connection: _db.Connection) -> None:
            # The counter's row lock (PostgreSQL) or the single writer (SQLite) holds every
            # other change back until this one commits: numbers commit in order.
            (version,) = (await connection.fetch(_BUMP))[0]
            if new:
                taken = await connection.fetch(
                    "SELECT 1 FROM chat_pipeline_keys WHERE name = ?", (key.name,)
                )
                if taken:
                    raise ValueError("name: another key has it")
                await connection.execute(_INSERT, (key.id, key.name, body, listed, version))
            else:
                taken = await connection.fetch(
                    "SELECT 1 FROM chat_pipeline_keys WHERE name = ? AND id <> ?",
                    (key.name, key.id),
                )
                if taken:
                    raise ValueError("name: another key has it")
                await connection.execute(_UPDATE, (key.name, body, listed, version, key.id))

        await self.database.transaction(write)

    async def _load(self, ref: str) -> KeyRecord | None:
        await self._prepare()
        rows = await self.database.fetch(f"{_SELECT} WHERE id = ? OR name = ?", (ref, ref))
        return _decode(*rows[0]) if rows else None

    async def changes(self, since: int) -> tuple[int, builtins.list[KeyRecord]]:
        await self._prepare()
        rows = await self.database.fetch(f"{_SELECT} WHERE version > ? ORDER BY version", (since,))
        records = [_decode(*row) for row in rows]
        return max([since, *(record.version for record in records)]), records

    async def aclose(self) -> None:
        await self.database.aclose()


class SQLiteKeyStore(DatabaseKeyStore):
    """Keys in a SQLite file (one host; the spend ledger's file may hold them too). Its
    schema is brought up to date at the first call."""

    def __init__(
        self, path: str | Path, *, timeout: float = 5.0, auto_upgrade: bool = True
    ) -> None:
        super().__init__(_db.open_database(Path(path), timeout=timeout), auto_upgrade=auto_upgrade)


class PostgresKeyStore(DatabaseKeyStore):
    """Keys in PostgreSQL (`dsn`: a ``postgresql://`` URL), shared by replicas. Its schema
    is ``chat-pipeline db upgrade``'s to apply (`auto_upgrade` to apply it at the first
    call instead)."""

    def __init__(
        self, dsn: str, *, timeout: float = 5.0, pool_size: int = 2, auto_upgrade: bool = False
    ) -> None:
        if not dsn.startswith(("postgresql://", "postgres://")):
            raise ValueError("PostgresKeyStore needs a postgresql:// URL")
        super().__init__(
            _db.open_database(dsn, timeout=timeout, pool_size=pool_size),
            auto_upgrade=auto_upgrade,
        )
