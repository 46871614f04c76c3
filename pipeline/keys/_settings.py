"""``[keys]`` and ``[budgets]``: virtual keys, and the budgets and rate limits of keys,
teams and users (importable without Redis, the database or the gateway)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from pipeline._settings import Settings
from pipeline.keys._model import Budget, check_name

__all__ = ["BudgetsSettings", "KeysSettings", "ScopeLimits"]


def _env_name(value: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError("expected the name of an environment variable (letters, digits, _)")
    return value


def _names(value: dict[str, ScopeLimits]) -> dict[str, ScopeLimits]:
    for name in value:
        check_name(name)
    return value


_EnvName = Annotated[str, AfterValidator(_env_name)]
_PerMinute = Annotated[int, Field(ge=1, le=10**12)]


class KeysSettings(Settings):
    """``[keys]``: virtual keys (`pipeline.keys`), kept in the spend ledger's database (the
    ``[spend]`` table names it) and read by each replica into memory."""

    enabled: bool = True
    """Whether the gateway accepts virtual keys (an environment may turn them off)."""
    refresh_interval: Annotated[float, Field(gt=0, le=60)] = 1.0
    """Seconds between two reads of the key changes: a key created, changed, rotated or revoked on
    any replica is known to every other within about twice this."""


class ScopeLimits(Settings):
    """A team's or a user's budget and rate limits (``[budgets.teams.NAME]``,
    ``[budgets.users.NAME]``)."""

    budget: Budget | None = None
    """What the team or user may spend (`Budget`: `limit`, `period`, `soft`)."""
    rpm: _PerMinute | None = None
    """Requests a minute, across every key of the team (users have no rate limits of their own)."""
    tpm: _PerMinute | None = None
    """Tokens a minute (input and output), across every key of the team."""


class BudgetsSettings(Settings):
    """``[budgets]``: where budgets and rate limits are counted (a Redis every replica
    shares), what happens when it cannot answer, and the budgets of teams, users and keys
    without their own.

    A request reserves its estimated maximum cost (its input, estimated, and its
    ``max_tokens``, or `default_max_output_tokens`, at the dearest price of the routes it
    may use) on each budget it counts against, and takes its rate-limit cells, in one Redis
    round trip; it settles with what its attempts cost once it ends."""

    redis_url_env: _EnvName
    """The environment variable holding the URL of the Redis the replicas share."""
    namespace: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_:.-]+$")] = (
        "chat_pipeline:budgets"
    )
    """The prefix of every Redis key of the counters."""
    fail_closed: bool = False
    """What a request gets while Redis cannot answer: served unchecked (``false``, the default; a
    warning says so once a minute) or refused with 503 (``true``)."""
    timeout: Annotated[float, Field(gt=0, le=30)] = 0.5
    """Seconds a request waits for Redis at most."""
    burst: Annotated[float, Field(gt=0, le=60)] = 1.0
    """Seconds of a rate limit a caller may use at once: with 600 requests a minute and a burst of
    1, 11 requests at once are admitted, then one every 100 ms."""
    lease: Annotated[float, Field(gt=0, le=86_400)] = 600.0
    """Seconds a reservation holds when its request never settles (its replica died)."""
    default_max_output_tokens: Annotated[int, Field(ge=1, le=10_000_000)] = 4096
    """The output a request without ``max_tokens`` is reserved for."""
    rebuild_delay: Annotated[float, Field(ge=0, le=600)] = 2.0
    """Seconds between seeing Redis lost the counters and rebuilding them from the ledger (time for
    every replica's ledger to write what it holds); reservations wait (fail open or closed)."""
    key: Budget | None = None
    """The budget of a key without its own (an ``api_keys_env`` key, or a virtual key made without
    one)."""
    team: Budget | None = None
    """The budget of a team not listed in `teams`."""
    user: Budget | None = None
    """The budget of a user not listed in `users`."""
    teams: Annotated[dict[str, ScopeLimits], AfterValidator(_names)] = Field(default_factory=dict)
    """Each team's budget and rate limits, by name."""
    users: Annotated[dict[str, ScopeLimits], AfterValidator(_names)] = Field(default_factory=dict)
    """Each user's budget, by name."""

    @model_validator(mode="after")
    def _users_have_no_rates(self) -> BudgetsSettings:
        for name, limits in self.users.items():
            if limits.rpm is not None or limits.tpm is not None:
                raise ValueError(f"users.{name}: users have budgets only (rate limits are per key)")
        return self
