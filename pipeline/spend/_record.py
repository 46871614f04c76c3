"""`SpendRecord` (one provider attempt, or one cache hit), `Attribution` (whose request it
was) and `SpendSummary` (a group of records added up)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from pipeline._scope import PricedAttempt

__all__ = [
    "FIELDS",
    "Attribution",
    "SpendRecord",
    "SpendSummary",
    "new_record_id",
]

MAX_VALUE = 256
"""Characters kept of an attribution value (a longer one is cut)."""
MAX_TAGS = 32
"""Tags kept per request (more are dropped)."""
MAX_TAG = 64
"""Characters kept of a tag."""


def _bounded(value: Any, limit: int = MAX_VALUE) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text[:limit] if text else None


def _tags(values: Iterable[Any]) -> tuple[str, ...]:
    kept: list[str] = []
    for value in values:
        tag = _bounded(value, MAX_TAG)
        if tag is not None and tag not in kept:
            kept.append(tag)
            if len(kept) == MAX_TAGS:
                break
    return tuple(kept)


class _Attributed(NamedTuple):
    key: str | None = None
    key_name: str | None = None
    user: str | None = None
    team: str | None = None
    tags: tuple[str, ...] = ()
    endpoint: str | None = None
    session: str | None = None


_ATTRIBUTION_FIELDS = _Attributed._fields


class Attribution(_Attributed):
    """Whose request it was: the caller's `key` (a virtual key's id; never a secret) and
    its `key_name`, the `user`, the `team`, free `tags`, the `endpoint` (the gateway's
    path, or a label of your own in library use) and the conversation's `session`.

    Values are kept to 256 characters, tags to 32 of 64 characters each, so a caller cannot
    grow a record without bound. Immutable (a named tuple: its fields are the last seven
    of a `SpendRecord`)."""

    __slots__ = ()

    def __new__(
        cls,
        key: str | None = None,
        key_name: str | None = None,
        user: str | None = None,
        team: str | None = None,
        tags: Iterable[str] | str = (),
        endpoint: str | None = None,
        session: str | None = None,
    ) -> Attribution:
        if isinstance(tags, str):
            tags = tags.split(",")
        return tuple.__new__(
            cls,
            (
                _bounded(key),
                _bounded(key_name),
                _bounded(user),
                _bounded(team),
                _tags(tags) if tags else (),
                _bounded(endpoint),
                _bounded(session),
            ),
        )

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{name}={value!r}" for name, value in zip(self._fields, self, strict=True) if value
        )
        return f"Attribution({shown})"

    @classmethod
    def of(cls, value: Attribution | Mapping[str, Any] | None) -> Attribution | None:
        """`value` as an `Attribution` (a mapping of its fields, unknown keys refused)."""
        if value is None or isinstance(value, Attribution):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(str(k) for k in value if k not in _ATTRIBUTION_FIELDS)
            if unknown:
                raise ValueError(
                    f"unknown attribution field(s) {', '.join(unknown)}; "
                    f"expected some of {', '.join(sorted(_ATTRIBUTION_FIELDS))}"
                )
            return cls(**value)
        raise TypeError(
            f"attribution must be an Attribution or a mapping, not {type(value).__name__}"
        )

    def over(self, base: Attribution | None) -> Attribution:
        """This attribution's fields where set, else `base`'s; the tags of both."""
        if base is None:
            return self
        tags = self.tags
        if base.tags:
            tags = _tags((*base.tags, *tags))
        # Both were bounded when made: no checks again.
        return tuple.__new__(
            Attribution,
            (
                self.key if self.key is not None else base.key,
                self.key_name if self.key_name is not None else base.key_name,
                self.user if self.user is not None else base.user,
                self.team if self.team is not None else base.team,
                tags,
                self.endpoint if self.endpoint is not None else base.endpoint,
                self.session if self.session is not None else base.session,
            ),
        )


_PREFIX = os.urandom(8).hex()
_counter = itertools.count(1)


def new_record_id() -> str:
    """A record id unique across processes in practice (a random 64-bit prefix per process,
    then a counter): made once, when the record is, so every write of it is the same row."""
    return f"{_PREFIX}{next(_counter):x}"


class SpendRecord(NamedTuple):
    """One provider attempt (or one cache hit), as the ledger keeps it.

    `cost` is in `currency` units (None: no price was known: the record is *unpriced*);
    `estimated` says some token counts were estimated (the provider reported none, or the
    stream was cut before it did). A cache hit (`cache` ``"hit"``) used nothing, cost 0 and
    `saved_cost` what the stored answer had cost. `attempt` numbers the request's attempts
    from 1 (0 for a cache hit); `outcome` is the attempt's (``completed``,
    ``failed_before_output``, ``failed_after_output``, ``abandoned``, ``canceled``).
    Immutable (a named tuple: cheap to make, one per attempt)."""

    id: str
    time: datetime
    request_id: str | None
    attempt: int
    route: str | None
    provider: str | None
    model_requested: str | None
    model_served: str | None
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    cost: Decimal | None = None
    currency: str = "USD"
    estimated: bool = False
    outcome: str = "completed"
    cache: str | None = None
    saved_cost: Decimal | None = None
    duration_ms: float | None = None
    time_to_first_update_ms: float | None = None
    key: str | None = None
    key_name: str | None = None
    user: str | None = None
    team: str | None = None
    tags: tuple[str, ...] = ()
    endpoint: str | None = None
    session: str | None = None

    @classmethod
    def of_attempt(
        cls, attempt: PricedAttempt, request_id: str | None, attribution: Attribution | None
    ) -> SpendRecord:
        """The record of one priced attempt of a request (`pipeline._scope`)."""
        usage = attempt.usage
        cost, saved = attempt.cost, attempt.saved
        priced = cost if cost is not None else saved
        ttfu = attempt.time_to_first_update
        # Positionally, in the fields' order: a record per attempt is made on the request's
        # path, and keywords would cost twice as much.
        return tuple.__new__(
            cls,
            (
                new_record_id(),
                datetime.fromtimestamp(attempt.started_at, UTC),
                request_id,
                attempt.number,
                attempt.route,
                attempt.provider,
                attempt.model_requested,
                attempt.model_served,
                usage.input_tokens or 0,
                usage.output_tokens or 0,
                usage.cache_read_tokens or 0,
                usage.cache_write_tokens or 0,
                usage.reasoning_tokens or 0,
                cost.amount if cost is not None else None,
                priced.currency if priced is not None else "USD",
                attempt.estimated,
                attempt.outcome,
                attempt.cache,
                saved.amount if saved is not None else None,
                attempt.duration * 1000.0,
                None if ttfu is None else ttfu * 1000.0,
                *(attribution or _NOBODY),
            ),
        )

    def attributed(self, attribution: Attribution | None) -> SpendRecord:
        """This record with `attribution`'s fields."""
        if attribution is None:
            return self
        return self._replace(
            key=attribution.key,
            key_name=attribution.key_name,
            user=attribution.user,
            team=attribution.team,
            tags=attribution.tags,
            endpoint=attribution.endpoint,
            session=attribution.session,
        )

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values (costs as strings, the time as ISO 8601)."""
        out: dict[str, Any] = {}
        value: Any
        for name, value in zip(self._fields, self, strict=True):
            if isinstance(value, Decimal):
                value = str(value)
            elif isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpendRecord:
        """The record `as_dict` made."""
        values = dict(data)
        values["time"] = datetime.fromisoformat(values["time"]).astimezone(UTC)
        for name in ("cost", "saved_cost"):
            if values.get(name) is not None:
                values[name] = Decimal(values[name])
        values["tags"] = tuple(values.get("tags") or ())
        return cls(**values)


FIELDS = SpendRecord._fields
_NOBODY = Attribution()
"""The record's fields, in order."""


@dataclass(frozen=True, slots=True)
class SpendSummary:
    """The records of one group added up: `group` maps each field grouped by to its value
    (None where the records have none); `requests` counts distinct request ids, `attempts`
    the provider attempts, `cache_hits` the hits; token counts are sums; `cost` sums the
    priced records (in `currency`), `unpriced` counts attempts without a price, `estimated`
    attempts whose counts were estimated, and `saved_cost` what cache hits saved."""

    group: dict[str, Any] = field(default_factory=dict)
    requests: int = 0
    attempts: int = 0
    cache_hits: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    cost: Decimal = Decimal(0)
    unpriced: int = 0
    estimated: int = 0
    saved_cost: Decimal = Decimal(0)

    def as_dict(self) -> dict[str, Any]:
        """The group's fields, then the totals, JSON-ready (amounts as strings)."""
        out: dict[str, Any] = dict(self.group)
        for item in fields(self):
            if item.name == "group":
                continue
            value = getattr(self, item.name)
            out[item.name] = str(value) if isinstance(value, Decimal) else value
        return out


def utc(moment: datetime) -> datetime:
    """`moment` in UTC (a naive datetime is taken as UTC)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
