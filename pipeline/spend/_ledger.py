"""`SpendLedger`: records queue in memory and are written in batches by a task of their own;
a request never waits on the database."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pipeline._redis import Outage
from pipeline._semconv import (
    ROUTE_NAME,
    SPEND_COST_METRIC,
    SPEND_DROPPED_METRIC,
    SPEND_KEY,
    SPEND_MODEL,
    SPEND_REASON,
    SPEND_SCOPE,
    SPEND_SPOOLED_METRIC,
    SPEND_TEAM,
    SPEND_UNPRICED_METRIC,
    SPEND_WRITTEN_METRIC,
    meter,
)
from pipeline.errors import SchemaVersionError
from pipeline.pricing import PriceBook, default_book
from pipeline.spend._record import Attribution, SpendRecord, SpendSummary
from pipeline.spend._settings import LedgerSettings
from pipeline.spend._spool import Spool
from pipeline.spend._store import SpendStore

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

    from pipeline._scope import PricedAttempt

__all__ = ["SpendLedger"]

_logger = logging.getLogger("chat_pipeline.spend")

_Entry = tuple[Any, ...]
"""A queued entry whose record is not made yet: ``(priced attempt, request id, attribution)``,
or ``(record,)``."""

MAX_LABEL_SETS = 1000
"""Distinct (route, model, key name, team) label sets the cost metric keeps; past them the
key name and team read ``other`` (a caller cannot grow a metric without bound)."""


class _Warnings:
    """A warning when something first happens, then at most once a minute."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warn(self, what: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(what, -float("inf")) >= 60.0:
            self._last[what] = now
            _logger.warning(message, *args)


class SpendLedger:
    """Keeps a `SpendRecord` per provider attempt (and per cache hit) in `store`, off the
    request path.

    Promises:

    * `record` never waits and never raises: records join an in-memory queue (at most
      `max_queue`; more are dropped, counted in ``chat_pipeline.spend.dropped`` and logged);
    * a task of the ledger's own writes the queue every `flush_interval` seconds, or at
      once when `max_batch` records wait, in batches of `max_batch`, each in one statement;
    * when the database fails, the batch and the queue go to the `spool` folder (one file
      per process, at most `max_spool_bytes`), and the ledger tries again after
      `retry_interval`: the spool is written first, then the queue. A spool left by a
      process that ended is written too. Every write is idempotent by record id, so a
      record is one row however often it was sent: exactly once;
    * `aclose` writes what is queued (within `timeout`), spools what the database does not
      take, and closes the store: a stopped process loses nothing. A process killed
      (``kill -9``) loses what it had queued: at most `flush_interval` seconds of records
      (and the batch being written, unless the database had committed it).

    `prices` is the book attempts without a route `Price` are priced by (default: the
    process's `GenAIPricesBook`). Metrics: ``chat_pipeline.spend.cost`` (by route, model,
    key name, team) and ``chat_pipeline.spend.unpriced`` as records arrive;
    ``chat_pipeline.spend.written``, ``.spooled`` and ``.dropped`` as they are kept.
    """

    def __init__(
        self,
        store: SpendStore,
        settings: LedgerSettings | None = None,
        *,
        prices: PriceBook | None = None,
        meter_provider: MeterProvider | None = None,
        close_store: bool = True,
        **options: Any,
    ) -> None:
        if not isinstance(store, SpendStore):
            raise TypeError("store must be a SpendStore (SQLiteSpendStore, PostgresSpendStore)")
        self.settings = LedgerSettings.from_options(settings, options)
        self.store = store
        if prices is None:
            book = default_book()
            book.warm()  # the price data loads now, not in a request
            prices = book
        elif not isinstance(prices, PriceBook):
            raise TypeError("prices must be a PriceBook (with a cost(...) method)")
        self.prices: PriceBook = prices
        self._close_store = close_store
        settings = self.settings
        self._spool = (
            Spool(settings.spool, max_bytes=settings.max_spool_bytes)
            if settings.spool is not None
            else None
        )
        # Entries: (a priced attempt, its request id, its attribution), whose record the writer
        # makes; (a record,) given to `record`; or a record queued again (made already).
        self._queue: collections.deque[_Entry | SpendRecord] = collections.deque()
        self._outage = Outage(
            _logger,
            f"spend database ({getattr(store, 'describe', lambda: type(store).__name__)()})",
            "spooling records" if self._spool is not None else "keeping records in memory",
            settings.retry_interval,
        )
        self._warnings = _Warnings()
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self._closed = False
        self._draining = asyncio.Lock()
        self._labels: dict[tuple[Any, ...], dict[str, str]] = {}
        instruments = meter(SPEND_SCOPE, meter_provider)
        self._cost = instruments.create_counter(
            SPEND_COST_METRIC, unit="{currency}", description="What recorded attempts cost"
        )
        self._unpriced = instruments.create_counter(
            SPEND_UNPRICED_METRIC, unit="{attempt}", description="Recorded attempts without a price"
        )
        self._written = instruments.create_counter(
            SPEND_WRITTEN_METRIC, unit="{record}", description="Spend records written"
        )
        self._spooled = instruments.create_counter(
            SPEND_SPOOLED_METRIC, unit="{record}", description="Spend records spooled"
        )
        self._dropped = instruments.create_counter(
            SPEND_DROPPED_METRIC, unit="{record}", description="Spend records dropped"
        )
        self.written = 0
        self.spooled = 0
        self.dropped = 0

    def __repr__(self) -> str:
        return f"SpendLedger({self.store!r}, queued={len(self._queue)})"

    @property
    def queued(self) -> int:
        """Records waiting in memory to be written."""
        return len(self._queue)

    # -- the request side ----------------------------------------------------------------------

    def record(self, records: Iterable[SpendRecord]) -> None:
        """Queue `records` to be written (never waits, never raises)."""
        self._enqueue([(record,) for record in records])

    def record_attempts(
        self,
        attempts: Sequence[PricedAttempt],
        request_id: str | None,
        attribution: Attribution | None,
    ) -> None:
        """Queue the records of one request's priced `attempts` (`pipeline._scope`), whose
        request it was: the records are made by the writer, off the request's path (never
        waits, never raises)."""
        self._enqueue([(attempt, request_id, attribution) for attempt in attempts])

    def _enqueue(self, entries: list[_Entry]) -> None:
        queue = self._queue
        room = 0 if self._closed else self.settings.max_queue - len(queue)
        if len(entries) > room:
            kept = max(room, 0)
            self._records(entries[kept:])  # counted in the metrics, then dropped
            self._drop(len(entries) - kept, "queue_full")
            entries = entries[:kept]
        queue.extend(entries)
        if not queue:
            return
        try:
            self._writer()
        except RuntimeError:  # no running event loop: written at the next flush
            return
        if len(queue) >= self.settings.max_batch and self._wake is not None:
            self._wake.set()

    def _records(self, entries: Iterable[_Entry | SpendRecord]) -> list[SpendRecord]:
        """The records of queued entries. A priced attempt's record is made here, once (the
        record, and its id, stay what is written, spooled or tried again); records made now
        or queued by `record` are counted in the metrics, a record queued again is not."""
        made: list[SpendRecord] = []
        fresh: list[SpendRecord] = []
        of_attempt = SpendRecord.of_attempt
        for entry in entries:
            if isinstance(entry, SpendRecord):
                made.append(entry)  # a record queued again: made and counted already
                continue
            record = entry[0] if len(entry) == 1 else of_attempt(*entry)
            made.append(record)
            fresh.append(record)
        if fresh:
            self._count(fresh)
        return made

    def _take(self, count: int) -> list[SpendRecord]:
        """The records of the queue's first `count` entries, taken from it."""
        queue = self._queue
        return self._records([queue.popleft() for _ in range(count)])

    def _count(self, records: list[SpendRecord]) -> None:
        """Add `records` to the cost and unpriced metrics, once per label set."""
        costs: dict[tuple[Any, ...], float] = {}
        unpriced: dict[tuple[str, str], int] = {}
        for record in records:
            if record.cache == "hit":
                continue
            model = record.model_served or record.model_requested or ""
            cost = record.cost
            if cost is None:
                where = (record.route or "", model)
                unpriced[where] = unpriced.get(where, 0) + 1
            elif cost:
                key = (record.route, model, record.key_name, record.team, record.currency)
                costs[key] = costs.get(key, 0.0) + float(cost)
        for (route_name, unpriced_model), count in unpriced.items():
            self._unpriced.add(count, {ROUTE_NAME: route_name, SPEND_MODEL: unpriced_model})
        for key, amount in costs.items():
            labels = self._labels.get(key)
            if labels is None:
                route, served, key_name, team, _ = key
                crowded = len(self._labels) >= MAX_LABEL_SETS
                labels = {
                    ROUTE_NAME: route or "",
                    SPEND_MODEL: served,
                    SPEND_KEY: "other" if crowded else key_name or "",
                    SPEND_TEAM: "other" if crowded else team or "",
                }
                if not crowded:
                    self._labels[key] = labels
            self._cost.add(amount, labels)

    def _drop(self, count: int, reason: str) -> None:
        self.dropped += count
        self._dropped.add(count, {SPEND_REASON: reason})
        self._warnings.warn(
            reason,
            "spend ledger dropped %d record(s): %s (max_queue=%d, max_spool_bytes=%d)",
            count,
            "its queue is full" if reason == "queue_full" else "its spool is full",
            self.settings.max_queue,
            self.settings.max_spool_bytes,
        )

    def _writer(self) -> None:
        task = self._task
        if task is None or task.done():
            loop = asyncio.get_running_loop()
            if task is not None and task.get_loop() is loop:
                return  # it ended: the ledger is closing
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="chat-pipeline spend ledger")

    # -- the writer ----------------------------------------------------------------------------

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        interval = self.settings.flush_interval
        while not self._closing:
            try:
                async with asyncio.timeout(interval):
                    await wake.wait()
            except TimeoutError:
                pass
            wake.clear()
            if self._closing:
                return
            try:
                await self._drain()
            except Exception as exc:  # the writer goes on; the next interval tries again
                _logger.error("spend ledger writer failed (%s)", type(exc).__name__, exc_info=exc)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, SchemaVersionError):
            self._warnings.warn("schema", "spend ledger cannot write: %s", exc)
        self._outage.failed(exc)

    async def _drain(self, *, final: bool = False) -> bool:
        """Write the spool, then the queue, one drain at a time (the writer's, a flush's).
        When the database fails (or is being skipped after a failure), queued records go
        to the spool. True when nothing is left."""
        async with self._draining:
            return await self._drain_now(final)

    async def _drain_now(self, final: bool) -> bool:
        if self._outage.skipping() and not final:
            await self._spool_queue()
            return False
        if self._spool is not None and not await self._replay():
            await self._spool_queue()
            return False
        queue = self._queue
        size = self.settings.max_batch
        while queue:
            batch = self._take(min(size, len(queue)))
            try:
                await self.store.write(batch)
            except Exception as exc:  # the database did not take it: keep it
                self._failed(exc)
                await self._keep(batch)
                await self._spool_queue()
                return False
            except BaseException:
                # Cut short (closing's bound): still queued. Had the database committed it,
                # writing it again is harmless (by id).
                self._queue.extendleft(reversed(batch))
                raise
            self._outage.succeeded()
            self._wrote(len(batch))
        return True

    def _wrote(self, count: int) -> None:
        self.written += count
        self._written.add(count)

    async def _keep(self, batch: list[SpendRecord]) -> None:
        """A batch the database did not take: to the spool, or back to the queue's front."""
        if self._spool is not None:
            await self._to_spool(batch)
            return
        room = self.settings.max_queue - len(self._queue)
        kept = batch[: max(room, 0)]
        self._queue.extendleft(reversed(kept))
        if len(kept) < len(batch):
            self._drop(len(batch) - len(kept), "queue_full")

    async def _spool_queue(self) -> None:
        if self._spool is None or not self._queue:
            return
        await self._to_spool(self._take(len(self._queue)))

    async def _to_spool(self, records: list[SpendRecord]) -> None:
        spool = self._spool
        assert spool is not None
        kept = await asyncio.to_thread(spool.append, records)
        if kept:
            self.spooled += kept
            self._spooled.add(kept)
        if kept < len(records):
            self._drop(len(records) - kept, "spool_full")

    async def _replay(self) -> bool:
        """Write every spooled record (this process's and those of processes that ended);
        False when the database failed meanwhile (what was not written stays spooled)."""
        spool = self._spool
        assert spool is not None
        for path in await asyncio.to_thread(spool.pending):
            with spool.claim(path) as handle:
                if handle is None:
                    continue
                batches = spool.batches(handle, self.settings.max_batch)
                while True:
                    batch = await asyncio.to_thread(next, batches, None)
                    if batch is None:
                        break
                    try:
                        await self.store.write(batch)
                    except Exception as exc:  # stays spooled; tried again later
                        self._failed(exc)
                        return False
                    self._outage.succeeded()
                    self._wrote(len(batch))
                await asyncio.to_thread(spool.written, path)
        return True

    async def flush(self) -> bool:
        """Write the spool and the queue now (this process's records reach the database
        before a summary, say); True when nothing is left waiting. Never raises for the
        database's failure: what it did not take is kept."""
        return await self._drain(final=True)

    # -- reports -------------------------------------------------------------------------------

    async def summary(
        self,
        group_by: Sequence[str] = (),
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> list[SpendSummary]:
        """The records in [`since`, `until`) matching `where` (a field -> a value or a list
        of values; ``tag`` matches records carrying any of them), added up per group of the
        `group_by` fields: ``key``, ``key_name``, ``user``, ``team``, ``tag`` (a record
        counts in each of its tags' groups), ``endpoint``, ``session``, ``route``,
        ``provider``, ``model_requested``, ``model_served``, ``outcome``, ``cache``,
        ``request_id``, and ``day`` / ``hour`` (UTC). Every group is also split by
        ``currency``: amounts are never added across currencies. This process's queued
        records are written first."""
        await self.flush()
        return await self.store.summary(group_by, since=since, until=until, where=where)

    async def records(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        where: Mapping[str, Any] | None = None,
        limit: int = 1000,
    ) -> list[SpendRecord]:
        """The records themselves, oldest first (this process's queued ones written first)."""
        await self.flush()
        return await self.store.records(since=since, until=until, where=where, limit=limit)

    # -- closing -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop the writer, write what is queued (within `timeout`), spool what the database
        does not take, close the store. Records given afterwards are dropped."""
        if self._closed:
            return
        self._closing = True
        task, wake = self._task, self._wake
        if task is not None and not task.done() and wake is not None:
            wake.set()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
        self._closed = True
        try:
            async with asyncio.timeout(self.settings.timeout):
                await self._drain(final=True)
        except TimeoutError:
            pass
        if self._queue:
            if self._spool is not None:
                await self._spool_queue()
            else:
                lost = len(self._take(len(self._queue)))  # counted in the metrics still
                _logger.warning(
                    "spend ledger closed with %d record(s) its database did not take "
                    "(no spool configured)",
                    lost,
                )
        if self._spool is not None:
            self._spool.close()
        if self._close_store:
            await self.store.aclose()
