"""The spend ledger: one record per provider attempt, written off the request path."""

from pipeline.spend._settings import LedgerSettings

__all__ = ["LedgerSettings"]
