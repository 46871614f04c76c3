"""Budgets and rate limits of whoever makes a request (a `Subject`): what the gateway's
governance layer and the library's budgets layer (`middleware.budgets`) share.

`Governor.admit` turns a request's estimate into one reservation (`pipeline._reservations`:
every budget of the key, its team and its user, and their rate limits, in one Redis round
trip shared with the other requests of the same loop turn) and answers an `Admission`:
granted (with what the response headers say), refused (`BudgetExceededError`,
`RateLimitExceededError`) or, when Redis cannot answer, served without it (fail open, the
default) or refused (`BudgetUnavailableError`, with ``fail_closed``). `Admission.settle`
gives the reservation back with what the request's attempts cost (the request scope's
`AttemptLog`: a failover or a hedge settles each attempt, priced where it was logged) and
the tokens they used.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Literal

from pipeline._reservations import (
    NANOS,
    BudgetCheck,
    Demand,
    Granted,
    Limits,
    RateCheck,
    RateState,
    Refused,
    Reservations,
    Settlement,
    nanos,
)
from pipeline.errors import BudgetExceededError, BudgetUnavailableError, RateLimitExceededError
from pipeline.keys._model import Budget, period_bounds

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

    from pipeline._scope import AttemptLog
    from pipeline.spend import SpendLedger

__all__ = ["Admission", "Governor", "RateCost", "Subject", "scope_name"]

_logger = logging.getLogger("chat_pipeline.budgets")
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
_PERIODS: tuple[str | None, ...] = ("day", "week", "month", None)


def scope_name(value: str) -> str:
    """`value` as a counter key's part (letters, digits and ``. _ : -``; others escaped)."""
    return _UNSAFE.sub(lambda m: f"%{ord(m.group(0)):02x}", value)


@dataclass(frozen=True, slots=True)
class Subject:
    """Whose request it is: the caller's `identity` (never a secret) and `name`, its
    `team` and `user`, and the budgets and limits of each (None: none)."""

    identity: str
    name: str | None = None
    budget: Budget | None = None
    rpm: int | None = None
    tpm: int | None = None
    team: str | None = None
    team_budget: Budget | None = None
    team_rpm: int | None = None
    team_tpm: int | None = None
    user: str | None = None
    user_budget: Budget | None = None

    @property
    def governed(self) -> bool:
        return any(
            (
                self.budget,
                self.rpm,
                self.tpm,
                self.team_budget,
                self.team_rpm,
                self.team_tpm,
                self.user_budget,
            )
        )


@dataclass(frozen=True, slots=True)
class RateCost:
    """What a request's tokens cost at most, per token, in `NANOS` (the dearest route it
    may use), for its reservation."""

    input: float = 0.0
    output: float = 0.0

    @classmethod
    def of(cls, prices: Sequence[tuple[Decimal, Decimal]]) -> RateCost:
        """The dearest of per-million `(input, output)` prices."""
        if not prices:
            return cls()
        return cls(
            max(float(i) for i, _ in prices) * NANOS / 1_000_000,
            max(float(o) for _, o in prices) * NANOS / 1_000_000,
        )


@dataclass(slots=True)
class Admission:
    """A request let through: `granted` (None when Redis could not answer and the request is
    served without a reservation); settle it once it ended, however it ended."""

    governor: Governor
    demand: Demand
    granted: Granted | None
    estimated_tokens: int
    settled: bool = False

    @property
    def rates(self) -> tuple[RateState, ...]:
        """Each rate limit's state after this request was admitted (none without Redis)."""
        return self.granted.rates if self.granted is not None else ()

    @property
    def soft_remaining(self) -> Decimal | None:
        return self.granted.soft_remaining if self.granted is not None else None

    def settle(self, log: AttemptLog | None) -> None:
        """Release the reservation with what the attempts in `log` cost and used (once)."""
        if self.settled:
            return
        self.settled = True
        cost = Decimal(0)
        tokens = 0
        if log is not None:
            for attempt in log.attempts:
                if attempt.cost is not None:
                    cost += attempt.cost.amount
                usage = attempt.usage
                tokens += (usage.input_tokens or 0) + (usage.output_tokens or 0)
        self.governor.settle(self, cost, tokens)


class Governor:
    """Admits and settles requests against `reservations` (see the module docstring)."""

    def __init__(
        self,
        reservations: Reservations,
        *,
        fail_closed: bool = False,
        burst: float = 1.0,
        lease: float = 600.0,
        default_max_output_tokens: int = 4096,
        retry_after: float = 1.0,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        from pipeline import _semconv

        instruments = _semconv.meter(_semconv.BUDGETS_SCOPE, meter_provider)
        self._refusals = instruments.create_counter(
            _semconv.BUDGET_REFUSALS_METRIC,
            unit="{request}",
            description="Requests refused by a budget, a rate limit or an unavailable store",
        )
        self._soft = instruments.create_counter(
            _semconv.BUDGET_SOFT_LIMIT_METRIC,
            unit="{request}",
            description="Requests admitted past a soft budget limit",
        )
        self.reservations = reservations
        self.fail_closed = fail_closed
        self.burst = burst
        self.lease = lease
        self.default_max_output_tokens = default_max_output_tokens
        self.retry_after = retry_after
        self._periods: dict[str | None, tuple[float, str, int]] = {}
        self._made: dict[str, tuple[Subject, float, Limits]] = {}
        self._soft_warned: dict[str, float] = {}

    # -- building a demand -------------------------------------------------------------------

    def _period(self, period: str | None) -> tuple[str, int]:
        """The current period's id and when its counters may expire (unix seconds)."""
        now = time.time()
        cached = self._periods.get(period)
        if cached is not None and now < cached[0]:
            return cached[1], cached[2]
        ident, _, end = period_bounds(period, datetime.fromtimestamp(now, UTC))
        expire = 0 if end is None else int((end + timedelta(days=1)).timestamp())
        # Good until the next minute: a period ends on a whole minute.
        self._periods[period] = (math.floor(now / 60) * 60 + 60, ident, expire)
        return ident, expire

    def _budget(self, kind: str, name: str, budget: Budget, scope: str) -> BudgetCheck:
        ident, expire = self._period(budget.period)
        return BudgetCheck(
            self.reservations.key("b", kind, scope_name(name), ident),
            nanos(budget.limit, up=True),
            None if budget.soft is None else nanos(budget.soft),
            expire,
            scope,
        )

    def demand(
        self, subject: Subject, *, input_tokens: int, max_output_tokens: int | None, costs: RateCost
    ) -> tuple[Demand, int]:
        """The reservation a request asks for, and the tokens it is estimated at."""
        output = max_output_tokens or self.default_max_output_tokens
        tokens = input_tokens + output
        amount = math.ceil(input_tokens * costs.input + output * costs.output)
        demand = Demand(amount=amount, lease=self.lease, tokens=tokens, limits=self.limits(subject))
        return demand, tokens

    def limits(self, subject: Subject) -> Limits:
        """A subject's budgets and rate limits, made once a minute (a period ends on a whole
        minute) per subject."""
        now = time.time()
        made = self._made.get(subject.identity)
        if made is not None and made[0] is subject and now < made[1]:
            return made[2]
        budgets: list[BudgetCheck] = []
        if subject.budget is not None:
            budgets.append(self._budget("k", subject.identity, subject.budget, "key"))
        if subject.team is not None and subject.team_budget is not None:
            budgets.append(self._budget("t", subject.team, subject.team_budget, "team"))
        if subject.user is not None and subject.user_budget is not None:
            budgets.append(self._budget("u", subject.user, subject.user_budget, "user"))
        rates: list[RateCheck] = []
        key, burst = self.reservations.key, self.burst

        def rate(kind: str, name: str, unit: Literal["requests", "tokens"], limit: int) -> None:
            suffix = "rpm" if unit == "requests" else "tpm"
            scope = "key" if kind == "k" else "team"
            rates.append(RateCheck(key("r", kind, name, suffix), limit, None, unit, scope, burst))

        mine = scope_name(subject.identity)
        if subject.rpm:
            rate("k", mine, "requests", subject.rpm)
        if subject.tpm:
            rate("k", mine, "tokens", subject.tpm)
        if subject.team is not None:
            team = scope_name(subject.team)
            if subject.team_rpm:
                rate("t", team, "requests", subject.team_rpm)
            if subject.team_tpm:
                rate("t", team, "tokens", subject.team_tpm)
        limits = Limits(budgets, rates)
        if len(self._made) >= 10_000:
            self._made.clear()
        self._made[subject.identity] = (subject, math.floor(now / 60) * 60 + 60, limits)
        return limits

    # -- admitting and settling --------------------------------------------------------------

    async def admit(
        self,
        subject: Subject,
        *,
        input_tokens: int,
        max_output_tokens: int | None,
        costs: RateCost,
    ) -> Admission:
        """Reserve what the request may cost: an `Admission`, or `BudgetExceededError`,
        `RateLimitExceededError`, `BudgetUnavailableError` (fail closed)."""
        demand, tokens = self.demand(
            subject, input_tokens=input_tokens, max_output_tokens=max_output_tokens, costs=costs
        )
        answer = await self.reservations.reserve(demand)
        if isinstance(answer, Granted):
            admission = Admission(self, demand, answer, tokens)
            if answer.soft_remaining is not None:
                self._soft_passed(subject, answer.soft_remaining)
            return admission
        from pipeline import _semconv

        if isinstance(answer, Refused):
            if answer.budget is not None:
                self._refusals.add(
                    1,
                    {
                        _semconv.BUDGET_REASON: "budget_exceeded",
                        _semconv.BUDGET_SCOPE_NAME: answer.budget.scope,
                    },
                )
                raise BudgetExceededError(answer.budget.scope, subject.name)
            rate = answer.rate
            assert rate is not None
            self._refusals.add(
                1,
                {
                    _semconv.BUDGET_REASON: "rate_limit_exceeded",
                    _semconv.BUDGET_SCOPE_NAME: rate.scope,
                },
            )
            raise RateLimitExceededError(
                rate.scope,
                rate.unit,
                rate.limit,
                retry_after=max(answer.retry_after_ms, 1) / 1000.0,
                states=answer.rates,
            )
        # Redis did not answer: nothing is known to be reserved, but the call may still run
        # there, so the request is settled all the same.
        admission = Admission(self, demand, None, tokens)
        if self.fail_closed:
            admission.settle(None)
            self._refusals.add(1, {_semconv.BUDGET_REASON: "unavailable"})
            raise BudgetUnavailableError(retry_after=self.retry_after)
        return admission

    def settle(self, admission: Admission, cost: Decimal, tokens: int) -> None:
        """Give `admission`'s reservation back: `cost` spent, `tokens` used."""
        self.reservations.settle(
            Settlement(admission.demand, nanos(cost), tokens - admission.estimated_tokens)
        )

    def _soft_passed(self, subject: Subject, remaining: Decimal) -> None:
        self._soft.add(1)
        # A line a minute per caller at most: a key past its soft limit passes it on every
        # request until its period ends.
        now = time.monotonic()
        if now - self._soft_warned.get(subject.identity, -math.inf) >= 60:
            self._soft_warned[subject.identity] = now
            _logger.warning(
                "key %s passed a soft budget limit: %s left",
                subject.name or subject.identity[:10],
                remaining,
            )

    # -- rebuilding the counters from the ledger ---------------------------------------------

    async def spent_from(self, ledger: SpendLedger) -> list[tuple[str, int, int]]:
        """What each key, team and user spent in each current period, from `ledger`: the
        counters to restore (key, spent in `NANOS`, expiry)."""
        now = datetime.now(UTC)
        found: list[tuple[str, int, int]] = []
        for period in _PERIODS:
            ident, start, _ = period_bounds(period, now)
            _, expire = self._period(period)
            for field, kind in (("key", "k"), ("team", "t"), ("user", "u")):
                for summary in await ledger.summary([field], since=start):
                    name = summary.group.get(field)
                    if name is None or not summary.cost:
                        continue
                    name = str(name)
                    if field == "key" and not name.startswith("k:"):
                        name = "vk:" + name  # the ledger keeps a virtual key's id
                    key = self.reservations.key("b", kind, scope_name(name), ident)
                    found.append((key, nanos(summary.cost), expire))
        return found
