"""Route health: what every attempt teaches a router about the routes it can choose.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import collections
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar

from opentelemetry.metrics import CallbackOptions, Observation
from pydantic import Field

from pipeline import _semconv
from pipeline._settings import Settings
from pipeline.errors import AttemptTimeoutError, FailureKind, classify, retry_after_of

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter, MeterProvider

__all__ = [
    "AttemptTicket",
    "HealthSettings",
    "RouteHealth",
    "RouteStats",
    "counts_against_route",
]

_DEPLOYMENT_FAILURES = frozenset(
    {
        FailureKind.RATE_LIMITED,
        FailureKind.QUOTA_EXHAUSTED,
        FailureKind.TRANSIENT,
        FailureKind.INVALID_RESPONSE,
        FailureKind.UNKNOWN,
    }
)
_COOLING_KINDS = frozenset({FailureKind.RATE_LIMITED, FailureKind.TRANSIENT})


def counts_against_route(exc: BaseException) -> bool:
    """Default `counts`: rate limits, exhausted quotas, transient, invalid-response and
    unknown failures (the failures that say something about the deployment, not about the
    request); an attempt the router cut for time is a latency sample instead."""
    return (
        isinstance(exc, Exception)
        and not isinstance(exc, AttemptTimeoutError)
        and classify(exc) in _DEPLOYMENT_FAILURES
    )


_Seconds = Annotated[float, Field(gt=0)]
_RECENT = 5  # answers whose median is a route's typical latency
_READMIT = 0.5  # an outlier is readmitted under 1 + (outlier_latency_ratio - 1) x this


class HealthSettings(Settings):
    """How `RouteHealth` weighs its signals (see the module docstring)."""

    code_only: ClassVar[frozenset[str]] = frozenset({"counts"})

    latency_decay: _Seconds = 5.0
    """Seconds over which faster answers bring a route's peak-EWMA latency estimate down (a slower
    answer raises it at once)."""
    failure_decay: _Seconds = 20.0
    """Seconds over which a route's failure ratio decays, so old failures weigh less."""
    max_cooldown: Annotated[float, Field(ge=0)] = 60.0
    """The longest a `Retry-After` (on a 429 or 503) takes a route out of rotation, in seconds."""
    quota_cooldown: Annotated[float, Field(ge=0)] = 900.0
    """Seconds a route whose provider said its quota or credit ran out (`QuotaExhaustedError`) stays
    out of rotation (longer when the provider's `Retry-After` says so)."""
    outlier_latency_ratio: Annotated[float, Field(gt=1)] = 2.0
    """A route whose typical latency (the median of its last five answers) is over this many times
    the other routes' median is an outlier."""
    outlier_latency_gap: Annotated[float, Field(ge=0)] = 0.1
    """Seconds a route's typical latency must also be over the others' median to make it an outlier
    (so tiny latencies do not make outliers)."""
    outlier_failure_gap: Annotated[float, Field(gt=0, le=1)] = 0.05
    """A route whose failure ratio is over the others' by this much is an outlier (with at least
    `min_failures` decayed failures)."""
    min_failures: Annotated[float, Field(ge=0)] = 1.0
    """Decayed failures a route must have before its failure ratio can make it an outlier."""
    probe_interval: _Seconds = 2.0
    """Seconds after a route became an outlier before its first probe."""
    max_probe_interval: _Seconds = 5.0
    """The longest wait between two probes of an outlier, in seconds (the interval doubles while
    probes miss)."""
    probe_timeout_ratio: _Seconds = 1.25
    """A probe is cut at this many times the healthy routes' typical latency (the cut is not held
    against the route's breaker)."""
    recovery_probes: Annotated[int, Field(ge=1)] = 2
    """Probes in a row answered in time that readmit an outlier."""
    counts: Callable[[BaseException], bool] = counts_against_route
    """Which failures count against a route's health (code only; default: deployment failures; an
    attempt cut for time is a latency sample instead)."""


@dataclass(frozen=True, slots=True)
class RouteStats:
    """One route's health as of now.

    `latency` is the estimate of its time to first update in seconds (``None`` before any
    sample): the peak-EWMA; `typical_latency` the median of its last answers, which tells
    an outlier; both count a route that has answered nothing for a while with how long it
    has been waiting; `failure_ratio` is between 0
    and 1; `cooldown` is the seconds of cooldown left (0 when none); `samples` is the decayed
    number of attempts behind `failure_ratio`.
    """

    name: str
    in_flight: int
    latency: float | None
    typical_latency: float | None
    failure_ratio: float
    cooldown: float
    samples: float


class _Signals:
    """The mutable signals of one route (one event loop; no locks needed)."""

    __slots__ = (
        "attempts",
        "cooldown_until",
        "ewma",
        "ewma_at",
        "failures",
        "good_probe_total",
        "good_probes",
        "in_flight",
        "last_answer",
        "next_token",
        "outlier_since",
        "pending",
        "probe_at",
        "probe_wait",
        "probing",
        "ratio_at",
        "recent",
        "shared",
    )

    def __init__(self) -> None:
        self.in_flight = 0
        self.pending: dict[int, float] = {}  # token -> start, until the first update
        self.next_token = 0
        self.ewma: float | None = None  # the peak-EWMA: what choosing among routes weighs
        self.ewma_at = 0.0
        # The last answers' latencies: their median tells an outlier (one answer in a
        # route's tail does not; a route whose answers all slowed down does, within a few).
        self.recent: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self.last_answer = -math.inf  # when the route last produced a first update
        self.failures = 0.0
        self.attempts = 0.0
        self.ratio_at = 0.0
        self.cooldown_until = -math.inf
        self.probe_at = -math.inf  # when the last probe started
        self.probe_wait = 0.0  # how long after it the next one is due (0: not an outlier)
        self.outlier_since: float | None = None
        self.probing = False
        self.good_probes = 0  # probes in a row that answered within their bound
        self.good_probe_total = 0.0  # and their latencies, summed
        # What other replicas said (see RedisHealthStore): (peak latency, typical latency,
        # failures, attempts).
        self.shared: tuple[float | None, float | None, float, float] | None = None


class AttemptTicket:
    """One attempt's place in its route's health: tell it the first update and the end."""

    __slots__ = ("_health", "_probe", "_signals", "_start", "_token", "_waiting", "route")

    def __init__(
        self, health: RouteHealth, route: str, signals: _Signals, start: float, probe: bool
    ) -> None:
        self._health = health
        self.route = route
        self._signals = signals
        self._start = start
        self._probe = probe
        token = signals.next_token
        signals.next_token = token + 1
        self._token = token
        signals.pending[token] = start
        signals.in_flight += 1
        self._waiting = True

    def now(self) -> float:
        """The time on its health's clock."""
        return self._health._clock()

    def first_update(self) -> None:
        """The attempt produced its first update (or its whole response): a latency sample."""
        if not self._waiting:
            return
        self._waiting = False
        signals = self._signals
        signals.pending.pop(self._token, None)
        now = self._health._clock()
        latency = now - self._start
        if self._probe:
            self._health._probe_answered(signals, latency, now)
        else:
            self._health._observe_latency(signals, latency, now, censored=False)

    def ended(self, outcome: str, error: BaseException | None = None) -> None:
        """The attempt ended with `outcome` (a `FailoverAttempt` outcome) and `error`."""
        health = self._health
        signals = self._signals
        signals.in_flight -= 1
        now = health._clock()
        if self._probe:
            signals.probing = False
            signals.probe_at = now  # the next one is due an interval after this one ended
            settings = health.settings
            if self._waiting and outcome != "completed":
                # Not answered in time: probe again later, up to the longest interval.
                signals.good_probes = 0
                signals.good_probe_total = 0.0
                signals.probe_wait = min(
                    max(signals.probe_wait, settings.probe_interval) * 2.0,
                    settings.max_probe_interval,
                )
            elif outcome not in ("canceled", "abandoned"):
                signals.probe_wait = settings.probe_interval
        if self._waiting:
            self._waiting = False
            signals.pending.pop(self._token, None)
            if outcome == "completed":
                if self._probe:
                    health._probe_answered(signals, now - self._start, now)
                else:
                    health._observe_latency(signals, now - self._start, now, censored=False)
            elif outcome in ("failed_before_output", "abandoned"):
                # It waited this long and learnt nothing faster (or lost a hedged race before
                # its first update): the route is at least this slow.
                health._observe_latency(signals, now - self._start, now, censored=True)
        if outcome in ("canceled", "abandoned"):
            return  # the caller's doing: nothing about the route
        failed = error is not None and health.settings.counts(error)
        health._observe_outcome(signals, failed, now)
        if error is not None and failed:
            health._cool_down_for(self.route, signals, error, now)


class RouteHealth:
    """The health of the routes one or more routers choose among, keyed by route name.

    Give one `RouteHealth` to several routers over the same deployments and they learn
    together. `store` (a `RedisHealthStore`) shares what replicas learn; ``None`` keeps it
    in this process. `clock` is monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        settings: HealthSettings | None = None,
        *,
        store: HealthStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        meter_provider: MeterProvider | None = None,
        **options: object,
    ) -> None:
        self.settings = HealthSettings.from_options(settings, options)
        if store is not None and not isinstance(store, HealthStore):
            raise TypeError("store must be a HealthStore (such as RedisHealthStore) or None")
        self._clock = clock
        self._routes: dict[str, _Signals] = {}
        meter = _semconv.meter(_semconv.ROUTING_SCOPE, meter_provider)
        self._cooldowns = meter.create_counter(
            _semconv.COOLDOWNS_METRIC,
            unit="{cooldown}",
            description="Cooldowns routes went into after a Retry-After answer",
        )
        _observe(meter, self)
        self.store = store
        if store is not None:
            store.attach(self)

    def __repr__(self) -> str:
        return f"RouteHealth(routes={sorted(self._routes)})"

    # -- feeding ---------------------------------------------------------------------------

    def _signals(self, route: str) -> _Signals:
        signals = self._routes.get(route)
        if signals is None:
            signals = self._routes[route] = _Signals()
        return signals

    def attempt_started(self, route: str, *, probe: bool = False) -> AttemptTicket:
        """Count an attempt on `route` in flight; the ticket records how it goes."""
        signals = self._signals(route)
        now = self._clock()
        if probe:
            signals.probing = True
            signals.probe_at = now
        ticket = AttemptTicket(self, route, signals, now, probe)
        if self.store is not None:
            self.store.touched(self, now)
        return ticket

    def cool_down(self, route: str, seconds: float) -> None:
        """Take `route` out of rotation for `seconds` (capped at `max_cooldown`)."""
        if not seconds > 0:
            return
        now = self._clock()
        signals = self._signals(route)
        until = now + min(float(seconds), self.settings.max_cooldown)
        if until > signals.cooldown_until:
            self._cooled(route, signals, until, now)

    def _cooled(self, route: str, signals: _Signals, until: float, now: float) -> None:
        if signals.cooldown_until <= now:  # a new cooldown, not a longer one
            self._cooldowns.add(1, {_semconv.ROUTE_NAME: route})
        signals.cooldown_until = until
        if self.store is not None:
            self.store.cooled(self, route, until, now)

    def _observe_latency(
        self, signals: _Signals, sample: float, now: float, *, censored: bool
    ) -> None:
        decay = self.settings.latency_decay
        recent = signals.recent
        if censored:
            # A wait cut short says "at least this slow": it never lowers the median.
            if recent:
                sample = max(sample, _median(list(recent)))
            recent.append(sample)
        else:
            recent.append(sample)
            signals.last_answer = now
        estimate = signals.ewma
        if estimate is None or sample >= estimate:
            signals.ewma = sample  # the peak: a slower answer counts at once
        elif censored:
            return
        else:
            weight = math.exp(-max(0.0, now - signals.ewma_at) / decay)
            signals.ewma = estimate * weight + sample * (1.0 - weight)
        signals.ewma_at = now

    def _probe_answered(self, signals: _Signals, latency: float, now: float) -> None:
        """A probe's first update: a sample, and after enough good probes in a row, the
        route's estimate becomes theirs (a recovered route need not wait for the peak it
        reached while it was down to decay)."""
        self._observe_latency(signals, latency, now, censored=False)
        signals.good_probes += 1
        signals.good_probe_total += latency
        if signals.good_probes >= self.settings.recovery_probes:
            signals.ewma = signals.good_probe_total / signals.good_probes
            signals.ewma_at = now
            signals.recent.clear()
            signals.recent.append(signals.ewma)
            signals.good_probes = 0
            signals.good_probe_total = 0.0

    def _decay_outcomes(self, signals: _Signals, now: float) -> None:
        elapsed = now - signals.ratio_at
        if elapsed > 0:
            weight = math.exp(-elapsed / self.settings.failure_decay)
            signals.failures *= weight
            signals.attempts *= weight
            signals.ratio_at = now

    def _observe_outcome(self, signals: _Signals, failed: bool, now: float) -> None:
        self._decay_outcomes(signals, now)
        signals.attempts += 1.0
        if failed:
            signals.failures += 1.0

    def _cool_down_for(
        self, route: str, signals: _Signals, error: BaseException, now: float
    ) -> None:
        wait = retry_after_of(error)
        kind = classify(error)
        if kind is FailureKind.QUOTA_EXHAUSTED:
            # Credit comes back when someone pays, not in seconds: a long cooldown.
            wait = max(self.settings.quota_cooldown, wait or 0.0)
            if not wait > 0:
                return
            until = now + wait
        elif wait is None or not wait > 0 or kind not in _COOLING_KINDS:
            return
        else:
            until = now + min(float(wait), self.settings.max_cooldown)
        if until > signals.cooldown_until:
            self._cooled(route, signals, until, now)

    # -- reading ---------------------------------------------------------------------------

    def _latency(self, signals: _Signals, now: float, *, typical: bool = False) -> float | None:
        """The effective estimate (the peak, or with `typical` the median of the last
        answers): this process's,
        or what a replica saw if slower."""
        estimate = self._own_latency(signals, now, typical=typical)
        shared = signals.shared
        if shared is not None:
            theirs = shared[1] if typical else shared[0]
            if theirs is not None:
                return theirs if estimate is None else max(estimate, theirs)
        return estimate

    def _own_latency(self, signals: _Signals, now: float, *, typical: bool = False) -> float | None:
        if typical:
            recent = signals.recent
            estimate = _median(list(recent)) if recent else None
        else:
            estimate = signals.ewma
        if signals.pending:
            # A route that has answered nothing since its oldest waiting attempt started is
            # at least that slow: a hang is seen while it hangs. (One slow answer among
            # others does not count: the others answered meanwhile.)
            oldest = signals.pending[next(iter(signals.pending))]  # tokens grow with time
            stalled = now - max(oldest, signals.last_answer)
            if estimate is None or stalled > estimate:
                return stalled
        return estimate

    def _ratio(self, signals: _Signals, now: float) -> tuple[float, float, float]:
        """(failure ratio, decayed failures, decayed attempts), replicas included."""
        self._decay_outcomes(signals, now)
        failures, attempts = signals.failures, signals.attempts
        if signals.shared is not None:
            failures += signals.shared[2]
            attempts += signals.shared[3]
        # One attempt more in the denominator: a single failure is not yet a 100% ratio.
        return failures / (attempts + 1.0), failures, attempts

    def stats(self, route: str) -> RouteStats:
        """The health of `route` now (a route never attempted is healthy and unknown)."""
        now = self._clock()
        signals = self._signals(route)
        ratio, _, attempts = self._ratio(signals, now)
        return RouteStats(
            name=route,
            in_flight=signals.in_flight,
            latency=self._latency(signals, now),
            typical_latency=self._latency(signals, now, typical=True),
            failure_ratio=ratio,
            cooldown=max(0.0, signals.cooldown_until - now),
            samples=attempts,
        )

    def snapshot(self) -> dict[str, RouteStats]:
        """Every known route's `RouteStats`."""
        return {name: self.stats(name) for name in list(self._routes)}

    def cooling_down(self, route: str) -> bool:
        """Whether `route` is in a cooldown now."""
        signals = self._routes.get(route)
        return signals is not None and signals.cooldown_until > self._clock()

    def cooldown_left(self, route: str) -> float:
        """Seconds left of `route`'s cooldown (0 when it has none)."""
        signals = self._routes.get(route)
        return 0.0 if signals is None else max(0.0, signals.cooldown_until - self._clock())

    def judge(self, routes: Iterable[str]) -> Judgement:
        """How `routes` compare now: each one's cost inputs and which are outliers."""
        return Judgement(self, list(routes), self._clock())

    async def aclose(self) -> None:
        """Stop sharing (a `store`'s pending work is finished or cancelled)."""
        if self.store is not None:
            await self.store.detach(self)


class Judgement:
    """The routes' signals read once for one selection, and the outliers among them."""

    __slots__ = (
        "latency",
        "now",
        "outliers",
        "probe_deadline",
        "ratio",
        "signals",
        "typical",
        "typical_latency",
    )

    def __init__(self, health: RouteHealth, routes: list[str], now: float) -> None:
        settings = health.settings
        self.now = now
        self.signals = {name: health._signals(name) for name in routes}
        self.latency: dict[str, float | None] = {}
        self.typical: dict[str, float | None] = {}
        self.ratio: dict[str, float] = {}
        failures: dict[str, float] = {}
        for name, signals in self.signals.items():
            self.latency[name] = health._latency(signals, now)
            self.typical[name] = health._latency(signals, now, typical=True)
            self.ratio[name], failures[name], _ = health._ratio(signals, now)
        self.outliers: set[str] = set()
        self.probe_deadline: float | None = None
        known = [value for value in self.latency.values() if value is not None]
        # What an unknown route is assumed to cost: the typical known one (or a unit).
        self.typical_latency = _median(known) if known else 1.0
        if len(routes) < 2:
            return
        # Outliers are told by the typical latency: the peak would call a route an outlier
        # for one answer in its tail.
        for name in routes:
            # A route answering in no measurable time is the fastest, not an unknown one.
            others_latency = [
                value
                for other, value in self.typical.items()
                if other != name and value is not None
            ]
            latency = self.typical[name]
            if latency is not None and others_latency:
                median = _median(others_latency)
                ratio = settings.outlier_latency_ratio
                if self.signals[name].outlier_since is not None:
                    # An outlier stays one until it is clearly back (or good probes readmit
                    # it): a route 3x slower must not drift in and out as the others'
                    # estimates move.
                    ratio = 1.0 + (ratio - 1.0) * _READMIT
                if latency > max(median * ratio, median + settings.outlier_latency_gap):
                    self.outliers.add(name)
                    continue
            others_ratio = [value for other, value in self.ratio.items() if other != name]
            if (
                failures[name] >= settings.min_failures
                and self.ratio[name] - _median(others_ratio) > settings.outlier_failure_gap
            ):
                self.outliers.add(name)
        for name, signals in self.signals.items():
            if name in self.outliers:
                if signals.outlier_since is None:
                    # Its first probe is due one interval after it became an outlier.
                    signals.outlier_since = signals.probe_at = now
                    signals.probe_wait = settings.probe_interval
            elif signals.outlier_since is not None:
                signals.outlier_since = None
                signals.probe_wait = 0.0
        if known:
            healthy = [
                value
                for name, value in self.typical.items()
                if value is not None and name not in self.outliers
            ]
            if healthy:
                self.probe_deadline = max(
                    _median(healthy) * settings.probe_timeout_ratio,
                    settings.outlier_latency_gap,
                )

    def probe_due(self, health: RouteHealth, route: str) -> bool:
        """Whether outlier `route` may have a probe now: none in flight, and its interval
        (longer after each probe that did not answer in time) has passed."""
        signals = self.signals[route]
        return not signals.probing and self.now - signals.probe_at >= signals.probe_wait


class HealthStore:
    """Where replicas share route health. The base class shares nothing (a no-op store);
    `RedisHealthStore` is the shared one. A store never blocks a request: it is told what
    changed and syncs in the background, bounded by its own timeout."""

    def attach(self, health: RouteHealth) -> None:
        """`health` starts using this store."""

    def touched(self, health: RouteHealth, now: float) -> None:
        """An attempt started: a chance to sync if it is due (never waits)."""

    def cooled(self, health: RouteHealth, route: str, until: float, now: float) -> None:
        """`route` went into a cooldown until `until` (on `health`'s clock)."""

    async def detach(self, health: RouteHealth) -> None:
        """`health` stops using this store; finish or cancel pending work."""


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2.0


# One set of health gauges per meter, reading every live RouteHealth that uses it (a
# callback per RouteHealth would pile up in the meter as routers come and go).
_GAUGED: weakref.WeakKeyDictionary[Meter, weakref.WeakSet[RouteHealth]] = (
    weakref.WeakKeyDictionary()
)


def _observe(meter: Meter, health: RouteHealth) -> None:
    healths = _GAUGED.get(meter)
    if healths is None:
        healths = _GAUGED[meter] = weakref.WeakSet()

        def latency(options: CallbackOptions) -> Iterator[Observation]:
            for each in list(healths):
                for stats in each.snapshot().values():
                    if stats.latency is not None:
                        yield Observation(stats.latency, {_semconv.ROUTE_NAME: stats.name})

        def in_flight(options: CallbackOptions) -> Iterator[Observation]:
            for each in list(healths):
                for stats in each.snapshot().values():
                    yield Observation(stats.in_flight, {_semconv.ROUTE_NAME: stats.name})

        def failure_ratio(options: CallbackOptions) -> Iterator[Observation]:
            for each in list(healths):
                for stats in each.snapshot().values():
                    yield Observation(stats.failure_ratio, {_semconv.ROUTE_NAME: stats.name})

        meter.create_observable_gauge(
            _semconv.HEALTH_LATENCY_METRIC,
            callbacks=[latency],
            unit="s",
            description="Route latency estimate (peak-EWMA of time to first update)",
        )
        meter.create_observable_gauge(
            _semconv.HEALTH_IN_FLIGHT_METRIC,
            callbacks=[in_flight],
            unit="{attempt}",
            description="Route attempts in flight in this process",
        )
        meter.create_observable_gauge(
            _semconv.HEALTH_FAILURE_RATIO_METRIC,
            callbacks=[failure_ratio],
            unit="1",
            description="Route decaying failure ratio",
        )
    healths.add(health)
