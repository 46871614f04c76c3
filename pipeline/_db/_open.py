"""`open_database`: the database a URL or a path names."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from pipeline._db._base import DEFAULT_POOL_SIZE, DEFAULT_TIMEOUT, Database
from pipeline._db._postgres import PostgresDatabase
from pipeline._db._sqlite import SQLiteDatabase

__all__ = ["open_database"]


def open_database(
    url: str | Path,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    pool_size: int = DEFAULT_POOL_SIZE,
) -> Database:
    """The database `url` names: ``postgresql://...`` (or ``postgres://``), or
    ``sqlite:///path`` / a plain file path. Nothing is connected yet. `ValueError` for
    anything else, in words that never echo the URL."""
    text = str(url)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(text, timeout=timeout, pool_size=pool_size)
    if "://" in text:
        # SQLAlchemy's convention: sqlite:///relative.db, sqlite:////absolute/path.db.
        if not text.startswith("sqlite:///"):
            scheme = urlsplit(text).scheme
            raise ValueError(
                "a database is a postgresql:// URL, a sqlite:/// URL or a file path "
                f"(got a {scheme or 'malformed'} URL)"
            )
        text = unquote(text[len("sqlite:///") :])
    if not text:
        raise ValueError("a SQLite database needs a file path")
    return SQLiteDatabase(Path(text), timeout=timeout)
