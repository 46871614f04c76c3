"""What a virtual key is: its fields, its secret, its budget; checked once, here."""

from __future__ import annotations

import calendar
import fnmatch
import hashlib
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, model_validator

from pipeline._settings import Settings

__all__ = [
    "SECRET_PREFIX",
    "Budget",
    "IssuedKey",
    "VirtualKey",
    "check_name",
    "hash_secret",
    "model_allowed",
    "new_key_id",
    "new_secret",
    "period_bounds",
]

SECRET_PREFIX = "sk-cp-"
"""How every virtual key's secret begins (so a leaked one is recognised, and told apart from
an ``api_keys_env`` key)."""
SHOWN = 12
"""Characters of a secret kept as its `VirtualKey.prefix` (the prefix and six random ones)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MODEL_GLOB = re.compile(r"[A-Za-z0-9*?\[][A-Za-z0-9._:/*?\[\]!-]{0,127}")
_MAX_METADATA = 4096


def check_name(value: str, what: str = "name") -> str:
    """`value` if it is 1-64 letters, digits and ``. _ -`` starting with a letter or digit
    (full match: no trailing newline); `ValueError` naming `what` otherwise."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{what}: expected 1-64 letters, digits and . _ - (starting with one)")
    return value


def _money(value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, Decimal | int | float | str):
        raise ValueError("expected an amount (a number or a decimal string)")
    try:
        amount = Decimal(str(value)) if not isinstance(value, Decimal) else value
    except InvalidOperation:
        raise ValueError("expected an amount (a number or a decimal string)") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError("expected a finite amount, not negative")
    if amount > Decimal(9_000_000):
        raise ValueError("expected an amount up to 9,000,000")
    return amount


Money = Annotated[Decimal, BeforeValidator(_money)]


class Budget(Settings):
    """What a key, a team or a user may spend: `limit` per `period` (``day``, ``week``,
    ``month``: calendar-aligned in UTC, weeks from Monday; None: ever), and a `soft` limit
    past which responses say what remains (header ``x-chat-pipeline-budget-remaining``), a
    line is logged and a metric counted."""

    limit: Money
    """The most the scope may spend in a period, in the prices' currency (USD by default)."""
    period: Literal["day", "week", "month"] | None = None
    """The period the limit is for (calendar-aligned in UTC; unset: for ever)."""
    soft: Money | None = None
    """Past this much spent, responses say what remains (at most `limit`)."""

    def __init__(
        self,
        limit: Any = None,
        period: Literal["day", "week", "month"] | None = None,
        soft: Any = None,
        **fields: Any,
    ) -> None:
        given: dict[str, Any] = dict(fields)
        if limit is not None:
            given["limit"] = limit
        if period is not None:
            given["period"] = period
        if soft is not None:
            given["soft"] = soft
        super().__init__(**given)

    @model_validator(mode="after")
    def _soft_under_limit(self) -> Budget:
        if self.soft is not None and self.soft > self.limit:
            raise ValueError("soft: must be at most the limit")
        return self

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"limit": str(self.limit), "period": self.period}
        if self.soft is not None:
            out["soft"] = str(self.soft)
        return out


def period_bounds(period: str | None, at: datetime) -> tuple[str, datetime | None, datetime | None]:
    """The period containing `at` (UTC): its id (in counter keys), start and end (None for
    a budget without a period)."""
    at = at.astimezone(UTC)
    if period is None:
        return "all", None, None
    if period == "day":
        start = datetime(at.year, at.month, at.day, tzinfo=UTC)
        return start.strftime("d%Y%m%d"), start, start + timedelta(days=1)
    if period == "week":
        day = datetime(at.year, at.month, at.day, tzinfo=UTC)
        start = day - timedelta(days=day.weekday())
        return start.strftime("w%Y%m%d"), start, start + timedelta(days=7)
    if period == "month":
        start = datetime(at.year, at.month, 1, tzinfo=UTC)
        days = calendar.monthrange(at.year, at.month)[1]
        return start.strftime("m%Y%m"), start, start + timedelta(days=days)
    raise ValueError(f"unknown budget period {period!r}")


def new_secret() -> str:
    """A fresh secret: `SECRET_PREFIX` and 256 random bits (URL-safe base64)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str | bytes) -> str:
    """What is stored of a secret: its SHA-256, in hex (the secret is random enough that a
    fast hash is safe; a slow one would cost every request)."""
    data = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(data).hexdigest()


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def model_allowed(globs: Sequence[str], model: str) -> bool:
    """Whether `model` (the name a client sent) matches one of `globs` (the whole name:
    ``gpt-*`` allows ``gpt-4o``, not ``my-gpt-4o``); no globs allow every model."""
    if not globs:
        return True
    return any(fnmatch.fnmatchcase(model, glob) for glob in globs)


def check_models(models: Sequence[str]) -> tuple[str, ...]:
    if isinstance(models, str) or not isinstance(models, Sequence):
        raise ValueError("models: expected a list of model names or glob patterns")
    for glob in models:
        if not isinstance(glob, str) or not _MODEL_GLOB.fullmatch(glob):
            raise ValueError(
                "models: each is a model name or a glob pattern of them (letters, digits, "
                ". _ : / - and * ? [...])"
            )
    return tuple(models)


def check_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    import json

    if not isinstance(metadata, Mapping):
        raise ValueError("metadata: expected a table of names to values")
    try:
        text = json.dumps(dict(metadata), sort_keys=True)
    except (TypeError, ValueError):
        raise ValueError("metadata: expected JSON values") from None
    if len(text) > _MAX_METADATA:
        raise ValueError(f"metadata: at most {_MAX_METADATA} characters of JSON")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def check_limit(value: int | None, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**12:
        raise ValueError(f"{what}: expected a whole number from 1")
    return value


@dataclass(frozen=True, slots=True)
class VirtualKey:
    """A key the gateway hands out and can take back. Its secret is never kept: only its
    SHA-256 (in the store) and its first characters (`prefix`, shown to tell keys apart).

    `models` are glob patterns of the model names a client may send (none: every model);
    `rpm` and `tpm` its requests and tokens a minute (None: no limit); `budget` what it may
    spend; `team` and `user` whose budgets and limits it also counts against. A key is
    refused once `expires_at` or `revoked_at` has passed."""

    id: str
    name: str
    prefix: str
    team: str | None = None
    user: str | None = None
    models: tuple[str, ...] = ()
    rpm: int | None = None
    tpm: int | None = None
    budget: Budget | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None

    @property
    def identity(self) -> str:
        """The caller identity of requests made with this key (cache partitions, limits,
        counters): never its secret."""
        return "vk:" + self.id

    def usable(self, now: datetime) -> Literal["revoked", "expired"] | None:
        """Why the key cannot be used at `now` (``revoked``, ``expired``), or None."""
        if self.revoked_at is not None and self.revoked_at <= now:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return None

    def as_dict(self) -> dict[str, Any]:
        """The key as JSON values (what ``keys show`` and ``/admin/keys`` answer)."""
        return {
            "id": self.id,
            "name": self.name,
            "prefix": self.prefix,
            "team": self.team,
            "user": self.user,
            "models": list(self.models),
            "rpm": self.rpm,
            "tpm": self.tpm,
            "budget": self.budget.as_dict() if self.budget is not None else None,
            "expires_at": _iso(self.expires_at),
            "revoked_at": _iso(self.revoked_at),
            "metadata": dict(self.metadata),
            "created_at": _iso(self.created_at),
        }


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z") if value else None


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A key just created or rotated, with its secret: shown once, never stored."""

    key: VirtualKey
    secret: str
