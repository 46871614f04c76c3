"""`LedgerSettings`: how a `SpendLedger` queues, batches, writes and spools its records."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline._settings import Settings

__all__ = ["LedgerSettings"]


class LedgerSettings(Settings):
    """The ledger's bounds: how often and how much it writes, how long a write may take, and
    how much it keeps (in memory, then in its spool) while the database cannot take them."""

    flush_interval: Annotated[float, Field(gt=0, le=3600)] = 1.0
    """Seconds between writes of the queued records (a full batch is written at once): what a
    `kill -9` of the process can lose at most."""
    max_batch: Annotated[int, Field(ge=1, le=100_000)] = 1000
    """Records written in one statement; a queue this long is written without waiting for the
    next interval."""
    max_queue: Annotated[int, Field(ge=1, le=10_000_000)] = 100_000
    """Records kept in memory waiting to be written; more are dropped, counted
    (`chat_pipeline.spend.dropped`) and logged."""
    spool: str | None = None
    """A folder where records the database could not take are kept (one file per process) and
    written once it answers again, also after a restart (unset: kept in memory only, up to
    `max_queue`)."""
    max_spool_bytes: Annotated[int, Field(ge=1024)] = 256 * 1024 * 1024
    """Bytes of records one process keeps in its spool file; more are dropped, counted and
    logged."""
    timeout: Annotated[float, Field(gt=0, le=600)] = 5.0
    """Seconds one database call (a batch written, a summary read) may take."""
    retry_interval: Annotated[float, Field(gt=0, le=3600)] = 2.0
    """Seconds the ledger waits after a failed write before trying the database again."""
