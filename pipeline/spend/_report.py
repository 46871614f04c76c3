"""Spend summaries as people read them: times given on a command line or in a query string,
and a summary as a table, JSON or CSV (``chat-pipeline spend``, ``GET /admin/spend``)."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pipeline.spend._record import SpendSummary
from pipeline.spend._store import GROUPS

__all__ = ["FORMATS", "TOTALS", "parse_time", "parse_where", "render"]

FORMATS = ("table", "json", "csv")
TOTALS = (
    "requests",
    "attempts",
    "cache_hits",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
    "cost",
    "unpriced",
    "estimated",
    "saved_cost",
)
"""The columns after the groups', in order."""

_AGO = re.compile(r"(\d+)\s*([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_time(text: str, *, now: datetime | None = None) -> datetime:
    """A time: ISO 8601 (``2026-03-01``, ``2026-03-01T12:00``, with an offset or UTC), or
    a span before `now` (``90m``, ``24h``, ``7d``, ``2w``). `ValueError` naming the forms."""
    value = text.strip()
    ago = _AGO.fullmatch(value)
    if ago is not None:
        moment = now if now is not None else datetime.now(UTC)
        return moment - timedelta(**{_UNITS[ago.group(2)]: int(ago.group(1))})
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"not a time: {value[:40]!r} (expected ISO 8601 such as 2026-03-01 or "
            "2026-03-01T12:00Z, or a span before now such as 90m, 24h, 7d)"
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def parse_where(pairs: Sequence[str] | Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """``field=value`` filters (a field given twice matches either value; an empty value
    matches records without one); `ValueError` for a field that is not one of `GROUPS`."""
    items: list[tuple[str, str]] = []
    if isinstance(pairs, Mapping):
        items = [(key, value) for key, values in pairs.items() for value in values]
    else:
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"expected FIELD=VALUE, got {pair[:40]!r}")
            items.append((key.strip(), value))
    where: dict[str, list[str | None]] = {}
    for key, value in items:
        if key not in GROUPS or key in ("day", "hour"):
            raise ValueError(
                f"cannot filter on {key[:40]!r}; expected one of "
                f"{', '.join(g for g in GROUPS if g not in ('day', 'hour'))}"
            )
        where.setdefault(key, []).append(value or None)
    return {key: values if len(values) > 1 else values[0] for key, values in where.items()}


def render(
    summaries: Sequence[SpendSummary],
    group_by: Sequence[str],
    form: Literal["table", "json", "csv"],
) -> str:
    """`summaries` as an aligned text table, a JSON document or CSV (one row a group)."""
    names = [*dict.fromkeys(group_by)]
    if "currency" not in names:
        names.append("currency")
    rows = [summary.as_dict() for summary in summaries]
    if form == "json":
        return json.dumps({"group_by": names, "data": rows}, indent=2) + "\n"
    columns = [*names, *TOTALS]
    if form == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if row.get(c) is None else row[c] for c in columns])
        return out.getvalue()
    table = [
        columns,
        *[["-" if row.get(c) is None else str(row[c]) for c in columns] for row in rows],
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    numeric = {i for i, c in enumerate(columns) if c in TOTALS}
    lines = [
        "  ".join(
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
            for i, cell in enumerate(line)
        ).rstrip()
        for line in table
    ]
    return "\n".join(lines) + "\n"
