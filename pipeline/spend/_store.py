"""Where spend records are kept: `SQLiteSpendStore` (a file, the default) and
`PostgresSpendStore` (shared by replicas), one schema (``pipeline/_db/migrations``), inserts
idempotent by record id, summaries added up by the database."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pipeline import _db
from pipeline.spend._record import SpendRecord, SpendSummary, utc

__all__ = [
    "GROUPS",
    "PostgresSpendStore",
    "SQLiteSpendStore",
    "SpendStore",
    "SqlSpendStore",
]

_logger = logging.getLogger("chat_pipeline.spend")

TABLE = "chat_pipeline_spend"
_COLUMNS = (
    "id",
    "time_us",
    "request_id",
    "attempt",
    "route",
    "provider",
    "model_requested",
    "model_served",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
    "cost_nanos",
    "currency",
    "estimated",
    "outcome",
    "cache",
    "saved_nanos",
    "duration_ms",
    "time_to_first_update_ms",
    "key_id",
    "key_name",
    "user_id",
    "team",
    "tags",
    "endpoint",
    "session",
)
_INSERT = (
    f"INSERT INTO {TABLE} ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)}) "
    "ON CONFLICT (id) DO NOTHING"
)

# A record field (or a grouping) -> its column. ``tag`` groups and filters by each tag.
_FIELD_COLUMNS = {
    "key": "key_id",
    "key_name": "key_name",
    "user": "user_id",
    "team": "team",
    "endpoint": "endpoint",
    "session": "session",
    "route": "route",
    "provider": "provider",
    "model_requested": "model_requested",
    "model_served": "model_served",
    "outcome": "outcome",
    "cache": "cache",
    "currency": "currency",
    "request_id": "request_id",
}
_TIME_GROUPS = ("day", "hour")
GROUPS = (*_FIELD_COLUMNS, "tag", *_TIME_GROUPS)
"""What a summary may group by and filter on (``day`` and ``hour`` group only, in UTC)."""

_NANOS = Decimal(1_000_000_000)
_ONE = Decimal(1)


def _nanos(amount: Decimal | None) -> int | None:
    """An amount in billionths of its currency unit (rounded half to even)."""
    if amount is None:
        return None
    if not amount:
        return 0
    return int(amount.scaleb(9).to_integral_value(rounding=ROUND_HALF_EVEN))


def _amount(nanos: int | None) -> Decimal | None:
    """An amount of billionths as a `Decimal` without trailing zeros (``0.003``, ``12``)."""
    if nanos is None:
        return None
    value = Decimal(int(nanos)).scaleb(-9).normalize()
    exponent = value.as_tuple().exponent
    return value.quantize(_ONE) if isinstance(exponent, int) and exponent > 0 else value


def _micros(moment: datetime) -> int:
    if moment.tzinfo is not UTC:
        moment = utc(moment)
    return int(moment.timestamp() * 1_000_000)


@runtime_checkable
class SpendStore(Protocol):
    """Keeps spend records: `write` is idempotent by record id (a record written twice is
    one row), `summary` adds them up (see `SpendLedger.summary`)."""

    async def write(self, records: Sequence[SpendRecord]) -> None:
        """Write `records` (all or none); raises when the database did not take them."""

    async def summary(
        self,
        group_by: Sequence[str] = (),
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> list[SpendSummary]:
        """The records in [`since`, `until`) matching `where`, added up per group."""

    async def records(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        where: Mapping[str, Any] | None = None,
        limit: int = 1000,
    ) -> list[SpendRecord]:
        """The records themselves, oldest first (at most `limit`)."""

    async def aclose(self) -> None:
        """Close the connections."""


class SqlSpendStore:
    """A `SpendStore` over a `pipeline._db.Database` of either dialect. The schema is checked
    at the first call: applied when missing or behind with `auto_upgrade`, else refused
    (`SchemaVersionError`, saying to run ``chat-pipeline db upgrade``)."""

    def __init__(self, database: _db.Database, *, auto_upgrade: bool) -> None:
        self.database = database
        self.auto_upgrade = auto_upgrade
        self._ready = False

    def describe(self) -> str:
        return self.database.describe()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    async def prepare(self) -> None:
        """Check (or, with `auto_upgrade`, bring up to date) the schema, once."""
        if self._ready:
            return
        if self.auto_upgrade:
            applied = await _db.upgrade(self.database)
            for migration in applied:
                _logger.info(
                    "%s: applied migration %04d_%s",
                    self.describe(),
                    migration.version,
                    migration.name,
                )
        else:
            await _db.require_schema(self.database)
        self._ready = True

    def _row(self, record: SpendRecord) -> tuple[Any, ...]:
        postgres = self.database.dialect == "postgres"
        return (
            record.id,
            _micros(record.time),
            record.request_id,
            record.attempt,
            record.route,
            record.provider,
            record.model_requested,
            record.model_served,
            record.input_tokens,
            record.output_tokens,
            record.cache_read_tokens,
            record.cache_write_tokens,
            record.reasoning_tokens,
            _nanos(record.cost),
            record.currency,
            record.estimated if postgres else int(record.estimated),
            record.outcome,
            record.cache,
            _nanos(record.saved_cost),
            record.duration_ms,
            record.time_to_first_update_ms,
            record.key,
            record.key_name,
            record.user,
            record.team,
            list(record.tags) if postgres else json.dumps(list(record.tags)),
            record.endpoint,
            record.session,
        )

    async def write(self, records: Sequence[SpendRecord]) -> None:
        if not records:
            return
        await self.prepare()
        await self.database.executemany(_INSERT, [self._row(record) for record in records])

    # -- reading ------------------------------------------------------------------------------

    def _where(
        self,
        since: datetime | None,
        until: datetime | None,
        where: Mapping[str, Any] | None,
    ) -> tuple[list[str], list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        if since is not None:
            clauses.append("s.time_us >= ?")
            params.append(_micros(since))
        if until is not None:
            clauses.append("s.time_us < ?")
            params.append(_micros(until))
        for name, wanted in (where or {}).items():
            values = (
                list(wanted) if isinstance(wanted, list | tuple | set | frozenset) else [wanted]
            )
            if not values:
                clauses.append("1 = 0")
                continue
            if name == "tag":
                if self.database.dialect == "postgres":
                    clauses.append("s.tags && ?::text[]")
                    params.append([str(v) for v in values])
                else:
                    marks = ", ".join("?" for _ in values)
                    clauses.append(
                        f"EXISTS (SELECT 1 FROM json_each(s.tags) WHERE value IN ({marks}))"
                    )
                    params.extend(str(v) for v in values)
                continue
            column = _FIELD_COLUMNS.get(name)
            if column is None:
                raise ValueError(
                    f"cannot filter on {name!r}; expected one of "
                    f"{', '.join(sorted({*_FIELD_COLUMNS, 'tag'}))}"
                )
            present = [v for v in values if v is not None]
            parts = []
            if present:
                parts.append(f"s.{column} IN ({', '.join('?' for _ in present)})")
                params.extend(str(v) for v in present)
            if len(present) < len(values):
                parts.append(f"s.{column} IS NULL")
            clauses.append(f"({' OR '.join(parts)})")
        return clauses, params

    def _group_expression(self, name: str) -> str:
        postgres = self.database.dialect == "postgres"
        if name == "tag":
            return "t.tag" if postgres else "t.value"
        if name in _TIME_GROUPS:
            pattern = "YYYY-MM-DD" if name == "day" else 'YYYY-MM-DD"T"HH24":00Z"'
            if postgres:
                return (
                    f"to_char(to_timestamp(s.time_us / 1000000.0) AT TIME ZONE 'UTC', '{pattern}')"
                )
            strf = "%Y-%m-%d" if name == "day" else "%Y-%m-%dT%H:00Z"
            return f"strftime('{strf}', s.time_us / 1000000, 'unixepoch')"
        column = _FIELD_COLUMNS.get(name)
        if column is None:
            raise ValueError(
                f"cannot group by {name!r}; expected some of {', '.join(sorted(GROUPS))}"
            )
        return f"s.{column}"

    async def summary(
        self,
        group_by: Sequence[str] = (),
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> list[SpendSummary]:
        await self.prepare()
        names = list(dict.fromkeys(group_by))
        if "currency" not in names:
            names.append("currency")  # amounts are never added across currencies
        expressions = [self._group_expression(name) for name in names]
        clauses, params = self._where(since, until, where)
        source = f"{TABLE} s"
        if "tag" in names:
            source += (
                " LEFT JOIN LATERAL unnest(s.tags) AS t(tag) ON true"
                if self.database.dialect == "postgres"
                else " LEFT JOIN json_each(s.tags) AS t"
            )
        hit = "COALESCE(s.cache, '') = 'hit'"
        select = ", ".join(
            [
                *expressions,
                "COUNT(DISTINCT s.request_id)",
                f"SUM(CASE WHEN {hit} THEN 0 ELSE 1 END)",
                f"SUM(CASE WHEN {hit} THEN 1 ELSE 0 END)",
                "SUM(s.input_tokens)",
                "SUM(s.output_tokens)",
                "SUM(s.cache_read_tokens)",
                "SUM(s.cache_write_tokens)",
                "SUM(s.reasoning_tokens)",
                "SUM(s.cost_nanos)",
                f"SUM(CASE WHEN s.cost_nanos IS NULL AND NOT ({hit}) THEN 1 ELSE 0 END)",
                f"SUM(CASE WHEN {self._true('s.estimated')} THEN 1 ELSE 0 END)",
                "SUM(s.saved_nanos)",
            ]
        )
        sql = f"SELECT {select} FROM {source}"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        positions = ", ".join(str(i + 1) for i in range(len(expressions)))
        # The same order in both dialects: groups without a value last.
        order = ", ".join(f"{i + 1} NULLS LAST" for i in range(len(expressions)))
        sql += f" GROUP BY {positions} ORDER BY {order}"
        rows = await self.database.fetch(sql, params)
        summaries = []
        for row in rows:
            group = dict(zip(names, row[: len(names)], strict=True))
            totals = row[len(names) :]
            summaries.append(
                SpendSummary(
                    group={name: group[name] for name in names},
                    requests=int(totals[0] or 0),
                    attempts=int(totals[1] or 0),
                    cache_hits=int(totals[2] or 0),
                    input_tokens=int(totals[3] or 0),
                    output_tokens=int(totals[4] or 0),
                    cache_read_tokens=int(totals[5] or 0),
                    cache_write_tokens=int(totals[6] or 0),
                    reasoning_tokens=int(totals[7] or 0),
                    cost=_amount(int(totals[8] or 0)) or Decimal(0),
                    unpriced=int(totals[9] or 0),
                    estimated=int(totals[10] or 0),
                    saved_cost=_amount(int(totals[11] or 0)) or Decimal(0),
                )
            )
        return summaries

    def _true(self, column: str) -> str:
        return column if self.database.dialect == "postgres" else f"{column} = 1"

    async def records(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        where: Mapping[str, Any] | None = None,
        limit: int = 1000,
    ) -> list[SpendRecord]:
        await self.prepare()
        clauses, params = self._where(since, until, where)
        sql = f"SELECT {', '.join('s.' + c for c in _COLUMNS)} FROM {TABLE} s"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY s.time_us, s.id LIMIT ?"
        params.append(int(limit))
        rows = await self.database.fetch(sql, params)
        return [self._record(row) for row in rows]

    @staticmethod
    def _record(row: Sequence[Any]) -> SpendRecord:
        value = dict(zip(_COLUMNS, row, strict=True))
        tags = value["tags"]
        if isinstance(tags, str):
            tags = json.loads(tags)
        return SpendRecord(
            id=value["id"],
            time=datetime.fromtimestamp(value["time_us"] / 1_000_000, UTC),
            request_id=value["request_id"],
            attempt=int(value["attempt"]),
            route=value["route"],
            provider=value["provider"],
            model_requested=value["model_requested"],
            model_served=value["model_served"],
            input_tokens=int(value["input_tokens"]),
            output_tokens=int(value["output_tokens"]),
            cache_read_tokens=int(value["cache_read_tokens"]),
            cache_write_tokens=int(value["cache_write_tokens"]),
            reasoning_tokens=int(value["reasoning_tokens"]),
            cost=_amount(value["cost_nanos"]),
            currency=value["currency"],
            estimated=bool(value["estimated"]),
            outcome=value["outcome"],
            cache=value["cache"],
            saved_cost=_amount(value["saved_nanos"]),
            duration_ms=value["duration_ms"],
            time_to_first_update_ms=value["time_to_first_update_ms"],
            key=value["key_id"],
            key_name=value["key_name"],
            user=value["user_id"],
            team=value["team"],
            tags=tuple(tags or ()),
            endpoint=value["endpoint"],
            session=value["session"],
        )

    async def aclose(self) -> None:
        await self.database.aclose()


class SQLiteSpendStore(SqlSpendStore):
    """The spend records in a SQLite file at `path` (made with its folder when missing), the
    embedded default: no server. Its schema is brought up to date at the first write
    (`auto_upgrade`). Several processes may share the file (WAL journaling; each waits its
    turn to write within `timeout`)."""

    def __init__(
        self, path: str | Path, *, timeout: float = 5.0, auto_upgrade: bool = True
    ) -> None:
        super().__init__(_db.open_database(Path(path), timeout=timeout), auto_upgrade=auto_upgrade)


class PostgresSpendStore(SqlSpendStore):
    """The spend records in PostgreSQL (`dsn`: a ``postgresql://`` URL; asyncpg, at most
    `pool_size` connections per process), shared by replicas. Its schema is
    ``chat-pipeline db upgrade``'s to apply (`auto_upgrade` to apply it at the first write
    instead)."""

    def __init__(
        self,
        dsn: str,
        *,
        timeout: float = 5.0,
        pool_size: int = 2,
        auto_upgrade: bool = False,
    ) -> None:
        if not dsn.startswith(("postgresql://", "postgres://")):
            raise ValueError("PostgresSpendStore needs a postgresql:// URL")
        super().__init__(
            _db.open_database(dsn, timeout=timeout, pool_size=pool_size),
            auto_upgrade=auto_upgrade,
        )
