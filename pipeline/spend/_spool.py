"""The ledger's spool: records its database could not take, kept in a local folder until it
can, also across a restart.

Each process appends to a file of its own (``spend-<pid>-<random>.jsonl``, one record a line),
which it holds under an exclusive `flock` while it lives. A file whose lock is free belongs
to a process that ended (stopped, crashed, killed): any ledger using the folder takes it
over, writes its records and deletes it. Records are written by id, idempotently, so a file
written twice (a process killed between writing its records and deleting the file) is still
one row per record. Every call here is blocking file work: the ledger runs it on a thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from pipeline.spend._record import SpendRecord

__all__ = ["Spool"]

_logger = logging.getLogger("chat_pipeline.spend")
_PATTERN = "spend-*.jsonl"


class Spool:
    """A folder of spooled records, and this process's file in it (at most `max_bytes`)."""

    def __init__(self, folder: str | os.PathLike[str], *, max_bytes: int) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.path = self.folder / f"spend-{os.getpid()}-{os.urandom(4).hex()}.jsonl"
        self._file: IO[str] | None = None
        self.size = 0

    def _own(self) -> IO[str]:
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held while alive
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.seek(0, os.SEEK_END)
            self.size = handle.tell()
            self._file = handle
        return self._file

    def append(self, records: list[SpendRecord]) -> int:
        """Append `records` to this process's file, flushed to the kernel (a process killed
        afterwards loses none of them); returns how many fit under `max_bytes` (the rest
        are not kept)."""
        handle = self._own()
        lines: list[str] = []
        size = self.size
        for record in records:
            line = json.dumps(record.as_dict(), separators=(",", ":")) + "\n"
            if size + len(line) > self.max_bytes:
                break
            size += len(line)
            lines.append(line)
        if lines:
            handle.write("".join(lines))
            handle.flush()
            self.size = size
        return len(lines)

    def pending(self) -> list[Path]:
        """The files with records to write: this process's (when it holds any) and those of
        processes that ended."""
        found = []
        if self._file is not None and self.size:
            found.append(self.path)
        if self.folder.is_dir():
            for path in sorted(self.folder.glob(_PATTERN)):
                if path != self.path:
                    found.append(path)
        return found

    @contextlib.contextmanager
    def claim(self, path: Path) -> Iterator[IO[str] | None]:
        """`path` opened for reading while this process holds it: its own file, or another's
        whose lock is free (None when its process still lives, or it is gone)."""
        if path == self.path:
            handle = self._own()
            handle.seek(0)
            yield handle
            return
        try:
            other = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            yield None
            return
        try:
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None  # its process is alive and owns it
                return
            yield other
        finally:
            other.close()

    @staticmethod
    def batches(handle: IO[str], size: int) -> Iterator[list[SpendRecord]]:
        """The records of an open spool file, `size` at a time. A line cut short (its
        process killed while writing it) is skipped, and said so."""
        batch: list[SpendRecord] = []
        for line in handle:
            try:
                batch.append(SpendRecord.from_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError):
                _logger.warning("a spooled spend record was cut short when written; skipped")
                continue
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch

    def written(self, path: Path) -> None:
        """Every record of `path` was written: empty this process's file, or delete
        another's (its lock is still held: nobody else takes it meanwhile)."""
        if path == self.path:
            handle = self._own()
            handle.seek(0)
            handle.truncate()
            self.size = 0
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def close(self) -> None:
        """Release this process's file (deleted when empty)."""
        handle, self._file = self._file, None
        if handle is None:
            return
        if not self.size:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        handle.close()
