"""`KeyRing`: a replica's copy of the virtual keys, so no request reads the database.

It loads every key when it starts, then asks the store for the changes since the last one
it saw every `refresh_interval` seconds (one indexed query): a key created, changed,
rotated or revoked on any replica is known here within that interval plus the query's
time. A lookup is a SHA-256 of the presented secret and a dictionary read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from pipeline.keys._model import SECRET_PREFIX, VirtualKey, hash_secret
from pipeline.keys._store import KeyRecord, KeyStore

__all__ = ["KeyRing", "Lookup"]

_logger = logging.getLogger("chat_pipeline.keys")


@dataclass(frozen=True, slots=True)
class Lookup:
    """What a presented secret is: its key, and why it is refused (None: it is not)."""

    key: VirtualKey
    refused: Literal["revoked", "expired", "rotated"] | None = None


class KeyRing:
    """The keys of `store`, kept current (see the module docstring)."""

    def __init__(self, store: KeyStore, *, refresh_interval: float = 1.0) -> None:
        if not refresh_interval > 0:
            raise ValueError("refresh_interval: expected seconds, more than 0")
        self.store = store
        self.refresh_interval = refresh_interval
        # Per secret's hash: its key, when the secret stops working (rotated out), and until
        # when (unix seconds) nothing refuses it, with its lookup made once.
        self._by_hash: dict[str, tuple[VirtualKey, datetime | None, float, Lookup]] = {}
        self._hashes: dict[str, tuple[str, ...]] = {}  # key id -> its secrets' hashes
        self._version = 0
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.refreshed = asyncio.Event()  # set after each refresh (tests wait on it)

    @staticmethod
    def looks_like_secret(token: bytes | str) -> bool:
        """Whether `token` has a virtual key's shape (else it may be an ``api_keys_env``
        key)."""
        prefix = SECRET_PREFIX.encode() if isinstance(token, bytes) else SECRET_PREFIX
        return token.startswith(prefix)  # type: ignore[arg-type]

    def find(self, token: bytes | str, now: datetime | None = None) -> Lookup | None:
        """The key a presented secret belongs to, or None."""
        found = self._by_hash.get(hash_secret(token))
        if found is None:
            return None
        key, until, usable_until, usable = found
        if now is None:
            if time.time() < usable_until:
                return usable
            now = datetime.now(UTC)
        why = key.usable(now)
        if why is not None:
            return Lookup(key, why)
        if until is not None and until <= now:
            return Lookup(key, "rotated")
        return Lookup(key)

    def __len__(self) -> int:
        return len(self._hashes)

    async def start(self) -> None:
        """Load every key, then keep them current in the background."""
        await self.refresh()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def refresh(self) -> None:
        """Apply the changes made since the last refresh."""
        version, records = await self.store.changes(self._version)
        for record in records:
            self._apply(record)
        self._version = max(self._version, version)
        self.refreshed.set()
        self.refreshed = asyncio.Event()

    def _apply(self, record: KeyRecord) -> None:
        key = record.key
        for digest in self._hashes.pop(key.id, ()):
            self._by_hash.pop(digest, None)
        self._hashes[key.id] = tuple(digest for digest, _ in record.secrets)
        ends = [moment.timestamp() for moment in (key.revoked_at, key.expires_at) if moment]
        usable = Lookup(key)
        for digest, until in record.secrets:
            usable_until = min([*ends, until.timestamp()] if until else ends, default=math.inf)
            self._by_hash[digest] = (key, until, usable_until, usable)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            try:
                await self.refresh()
            except Exception as exc:  # keep the keys known; try again next interval
                if not self._failing:
                    _logger.warning(
                        "reading key changes failed (%s): the keys known are kept; "
                        "trying again every %.3g s",
                        type(exc).__name__,
                        self.refresh_interval,
                    )
                self._failing = True
                continue
            if self._failing:
                self._failing = False
                _logger.info("reading key changes works again")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
