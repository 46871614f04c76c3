"""The spend ledger: a `SpendRecord` per provider attempt (and per cache hit), priced, with
whose request it was (`Attribution`), written off the request path by a `SpendLedger` into a
`SQLiteSpendStore` (a file, no server) or a `PostgresSpendStore` (shared by replicas).

In a pipeline: ``ChatPipeline.builder().use_spend(ledger, attribution=...)`` (see
`middleware.spend`); in the gateway: the ``[spend]`` table. Reports: `SpendLedger.summary`,
``chat-pipeline spend`` and the gateway's ``GET /admin/spend``.
"""

from pipeline.spend._ledger import SpendLedger
from pipeline.spend._record import Attribution, SpendRecord, SpendSummary
from pipeline.spend._settings import LedgerSettings
from pipeline.spend._store import (
    GROUPS,
    PostgresSpendStore,
    SpendStore,
    SQLiteSpendStore,
    SqlSpendStore,
)

__all__ = [
    "GROUPS",
    "Attribution",
    "LedgerSettings",
    "PostgresSpendStore",
    "SQLiteSpendStore",
    "SpendLedger",
    "SpendRecord",
    "SpendStore",
    "SpendSummary",
    "SqlSpendStore",
]
