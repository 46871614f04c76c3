"""The governance layer: a key's model scope, then its budgets and rate limits (and its
team's and user's), checked after the body was read and before the pipeline runs.

* a model outside the virtual key's globs: 403 ``model_not_allowed``;
* a budget spent: 402 ``budget_exceeded`` with ``x-should-retry: false`` (the SDKs and
  agents do not retry it);
* a rate limit reached: 429 ``rate_limit_exceeded`` with ``retry-after`` (and
  ``retry-after-ms``), which the official SDKs wait for before they retry;
* Redis unavailable with ``fail_closed``: 503 ``budget_unavailable`` with ``retry-after``;

each in the inbound format's own error body. Every answer of a rate-limited key carries its
limits (``x-ratelimit-limit-requests``, ``-remaining-``, ``-reset-`` and the ``-tokens``
trio; ``anthropic-ratelimit-*`` on ``/v1/messages``); one past a soft budget limit carries
``x-chat-pipeline-budget-remaining``. A request let through opens the request's attempt log
(`pipeline._scope`), and settles its reservation with what its attempts cost once it ended,
however it ended.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pipeline import _scope
from pipeline._governance import Admission, Governor, RateCost, Subject
from pipeline._reservations import RateState
from pipeline._streams import StreamEnd, StreamWatcher, forward
from pipeline.client import ChatClient, DelegatingChatClient, metadata_of
from pipeline.errors import BudgetExceededError, BudgetUnavailableError, RateLimitExceededError
from pipeline.gateway._exchange import EXCHANGE, ASGIApp, Exchange, Receive, Scope, Send
from pipeline.gateway.wire import WireError
from pipeline.keys._model import model_allowed
from pipeline.pricing import (
    Price,
    attempt_usage,
    estimate_input_tokens,
    priced,
    reached_provider,
    response_characters,
    streamed_characters,
)
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages, UsageDetails

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

    from pipeline.config import PipelineConfig
    from pipeline.keys import KeyRing, KeyStore
    from pipeline.keys._settings import BudgetsSettings

__all__ = ["Governance", "GovernanceMiddleware", "MeteredClient", "rate_headers"]

_logger = logging.getLogger("chat_pipeline.gateway")
_BUDGET_HEADER = b"x-chat-pipeline-budget-remaining"


def _duration(milliseconds: int) -> bytes:
    """OpenAI's reset format: ``120ms``, ``1s``, ``1.5s``, ``6m0s``."""
    if milliseconds < 1000:
        return b"%dms" % milliseconds
    seconds = milliseconds / 1000
    if seconds < 60:
        return f"{seconds:.3f}".rstrip("0").rstrip(".").encode() + b"s"
    minutes, rest = divmod(round(seconds), 60)
    return b"%dm%ds" % (minutes, rest)


def rate_headers(states: tuple[RateState, ...], *, anthropic: bool) -> list[tuple[bytes, bytes]]:
    """The rate-limit headers of `states` (the first limit of each unit: the key's before
    its team's), OpenAI's or Anthropic's."""
    headers: list[tuple[bytes, bytes]] = []
    seen: set[str] = set()
    now = datetime.now(UTC) if anthropic else None
    for state in states:
        unit = state.check.unit
        if unit in seen:
            continue
        seen.add(unit)
        limit = str(state.check.limit).encode()
        remaining = str(state.remaining).encode()
        if now is not None:
            reset = (now + timedelta(milliseconds=state.reset_ms)).replace(microsecond=0)
            prefix = b"anthropic-ratelimit-" + unit.encode()
            headers += [
                (prefix + b"-limit", limit),
                (prefix + b"-remaining", remaining),
                (prefix + b"-reset", reset.isoformat().replace("+00:00", "Z").encode()),
            ]
        else:
            suffix = unit.encode()
            headers += [
                (b"x-ratelimit-limit-" + suffix, limit),
                (b"x-ratelimit-remaining-" + suffix, remaining),
                (b"x-ratelimit-reset-" + suffix, _duration(state.reset_ms)),
            ]
    return headers


@dataclass
class Governance:
    """What the layer needs, built once per worker by the app: the virtual keys (`ring`),
    the budgets and limits (`governor`, `settings`), and what a model name's routes cost at
    most (`costs_for`)."""

    ring: KeyRing | None = None
    store: KeyStore | None = None
    governor: Governor | None = None
    settings: BudgetsSettings | None = None
    costs_for: Callable[[str], RateCost] = lambda model: RateCost()
    price_of: Callable[[Any], Decimal | None] | None = None
    prices: Any = None
    closers: list[Callable[[], Any]] = field(default_factory=list)
    # Subjects by identity, with the key object they were made from (a key changed in the
    # ring is a new object: its subject is made again).
    _subjects: dict[str, tuple[Any, Subject]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        config: PipelineConfig,
        *,
        retry_after: float,
        meter_provider: MeterProvider | None = None,
    ) -> Governance:
        """The governance `config` asks for (nothing when it has no ``[keys]`` nor
        ``[budgets]``). Nothing connects yet."""
        made = cls()
        spend = config.spend
        keys = config.keys
        if keys is not None and keys.enabled and spend is not None:
            from pipeline.keys import KeyRing, PostgresKeyStore, SQLiteKeyStore

            store: KeyStore
            if spend.store == "postgres":
                store = PostgresKeyStore(
                    spend.database_url(), auto_upgrade=bool(spend.auto_upgrade)
                )
            else:
                store = SQLiteKeyStore(spend.path)
            made.store = store
            made.ring = KeyRing(store, refresh_interval=keys.refresh_interval)
        budgets = config.budgets
        if budgets is not None:
            from pipeline._reservations import Reservations
            from pipeline._resp import RespClient
            from pipeline.pricing import default_book

            rebuild = None
            if spend is not None:
                rebuild = _rebuild_from(spend)
            fallback = (
                "requests are refused (fail_closed)"
                if budgets.fail_closed
                else "requests are served without budgets or rate limits"
            )
            reservations = Reservations(
                RespClient(os.environ[budgets.redis_url_env], timeout=budgets.timeout),
                namespace=budgets.namespace,
                rebuild_delay=budgets.rebuild_delay,
                fallback=fallback,
            )
            governor = Governor(
                reservations,
                fail_closed=budgets.fail_closed,
                burst=budgets.burst,
                lease=budgets.lease,
                default_max_output_tokens=budgets.default_max_output_tokens,
                retry_after=retry_after,
                meter_provider=meter_provider,
            )
            if rebuild is not None:
                reservations._rebuild = lambda: rebuild(governor)
            made.governor = governor
            made.settings = budgets
            made.prices = default_book()
        return made

    @property
    def active(self) -> bool:
        return self.ring is not None or self.governor is not None

    async def start(self) -> None:
        if self.ring is not None:
            await self.ring.start()
        if self.governor is not None:
            # Counters lost with a fresh or restarted Redis are rebuilt now, not at a request.
            reservations = self.governor.reservations
            await reservations.prepare(reservations.rebuild_delay + 10.0)

    async def aclose(self) -> None:
        if self.ring is not None:
            await self.ring.aclose()
        if self.store is not None:
            await self.store.aclose()
        if self.governor is not None:
            await self.governor.reservations.aclose()
            await self.governor.reservations.redis.aclose()

    def subject(self, exchange: Exchange) -> Subject | None:
        """Whose request it is, with its budgets and limits (None: no caller identity)."""
        settings = self.settings
        identity = exchange.key
        if settings is None or not identity:
            return None
        key = exchange.virtual_key
        found = self._subjects.get(identity)
        if found is not None and found[0] is key:
            return found[1]
        if len(self._subjects) >= 10_000:
            self._subjects.clear()
        made = self._subject(identity, exchange.key_name, key, settings)
        self._subjects[identity] = (key, made)
        return made

    @staticmethod
    def _subject(identity: str, name: str | None, key: Any, settings: BudgetsSettings) -> Subject:
        team = user = None
        budget = settings.key
        rpm = tpm = None
        if key is not None:
            team, user = key.team, key.user
            budget = key.budget or settings.key
            rpm, tpm = key.rpm, key.tpm
        team_limits = settings.teams.get(team) if team is not None else None
        user_limits = settings.users.get(user) if user is not None else None
        return Subject(
            identity,
            name,
            budget,
            rpm,
            tpm,
            team,
            (team_limits.budget if team_limits else None) or settings.team,
            team_limits.rpm if team_limits else None,
            team_limits.tpm if team_limits else None,
            user,
            (user_limits.budget if user_limits else None) or settings.user,
        )


def _rebuild_from(spend: Any) -> Callable[[Governor], Any]:
    """The rebuild of lost counters from the spend database `spend` names."""

    async def rebuild(governor: Governor) -> Any:
        from pipeline.spend import PostgresSpendStore, SQLiteSpendStore

        store = (
            PostgresSpendStore(spend.database_url())
            if spend.store == "postgres"
            else SQLiteSpendStore(spend.path)
        )
        try:
            return await governor.spent_from(store)  # type: ignore[arg-type]
        finally:
            await store.aclose()

    return rebuild


def _refusal(exc: Exception, anthropic: bool) -> tuple[WireError, list[tuple[bytes, bytes]]]:
    if isinstance(exc, BudgetExceededError):
        return (
            WireError(
                402,
                f"budget_exceeded: the {exc.scope}'s budget is spent; no more requests are "
                "served until its period ends or it is raised",
                type="budget_exceeded",
                code="budget_exceeded",
                should_retry=False,
            ),
            [],
        )
    if isinstance(exc, RateLimitExceededError):
        wait_ms = max(1, math.ceil(exc.retry_after * 1000))
        headers = rate_headers(exc.states, anthropic=anthropic)
        headers.append((b"retry-after-ms", str(wait_ms).encode()))
        return (
            WireError(
                429,
                f"rate_limit_exceeded: the {exc.scope}'s limit of {exc.limit} {exc.unit} a "
                "minute is reached; retry after the time retry-after says",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                retry_after=exc.retry_after,
            ),
            headers,
        )
    assert isinstance(exc, BudgetUnavailableError)
    return (
        WireError(
            503,
            "budgets cannot be checked now; retry later",
            type="server_error",
            code="budget_unavailable",
            retry_after=exc.retry_after,
        ),
        [],
    )


_MODEL_NOT_ALLOWED = WireError(
    403,
    "model_not_allowed: this API key may not use this model",
    type="invalid_request_error",
    code="model_not_allowed",
    param="model",
)


class GovernanceMiddleware:
    """Checks a request against its key's models, budgets and limits, then runs `app` and
    settles (see the module docstring)."""

    __slots__ = ("_anthropic", "_governance", "_path", "app")

    def __init__(self, app: ASGIApp, *, governance: Governance, path: str) -> None:
        self.app = app
        self._governance = governance
        self._path = path
        self._anthropic = path.startswith("/v1/messages")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange: Exchange = scope[EXCHANGE]
        request = exchange.request
        key = exchange.virtual_key
        if (
            request is not None
            and key is not None
            and key.models
            and not model_allowed(key.models, request.model)
        ):
            exchange.failure = _MODEL_NOT_ALLOWED
            await exchange.error(_MODEL_NOT_ALLOWED)
            return
        governance = self._governance
        governor = governance.governor
        subject = governance.subject(exchange) if governor is not None else None
        if governor is None or subject is None or request is None or not subject.governed:
            await self.app(scope, receive, send)
            return
        try:
            admission = await governor.admit(
                subject,
                input_tokens=estimate_input_tokens(request.messages),
                max_output_tokens=request.options.max_output_tokens,
                costs=governance.costs_for(request.model),
            )
        except (BudgetExceededError, RateLimitExceededError, BudgetUnavailableError) as exc:
            error, headers = _refusal(exc, self._anthropic)
            exchange.extra_headers += headers
            exchange.failure = error
            await exchange.error(error)
            return
        self._headers(exchange, admission)
        log, token = _scope.open_attempt_log(governance.prices)
        try:
            await self.app(scope, receive, send)
        finally:
            if token is not None:
                _scope.exit_attempt_log(token)
            # With [spend], the handler keeps the request's log (with whose request it is).
            admission.settle(
                exchange.attempts if exchange.attempts is not None else log, governance.price_of
            )

    def _headers(self, exchange: Exchange, admission: Admission) -> None:
        rates = admission.rates
        if rates:
            exchange.extra_headers += rate_headers(rates, anthropic=self._anthropic)
        remaining = admission.soft_remaining
        if remaining is not None:
            shown = max(remaining, Decimal(0)).quantize(Decimal("0.000001"))
            exchange.extra_headers.append((_BUDGET_HEADER, str(shown).encode()))


# -- what a target without a router cost ---------------------------------------------------


class MeteredClient(DelegatingChatClient):
    """A model name's client without a router beneath (a route served by name, a pipeline
    of one route): the call itself is the request's one attempt, priced with `price` (the
    route's, else the attempt log's book) and added to the request's attempt log when it
    ended, so budgets settle with it. Routers log their own attempts; a cache hit logs
    itself (then nothing is added here)."""

    def __init__(self, inner: ChatClient, *, route: str, price: Price | None) -> None:
        super().__init__(inner)
        self.route = route
        self.price = price

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        log = _scope.current_attempt_log()
        if log is None:
            return await self.inner.get_response(messages, options)
        meter = _Meter(self, log, messages, options)
        try:
            response = await self.inner.get_response(messages, options)
        except BaseException as exc:
            meter._log("failed_before_output", exc)
            raise
        meter.usage, meter.model = response.usage, response.model_id
        meter.characters = response_characters(response)
        meter._log("completed", None)
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        log = _scope.current_attempt_log()
        if log is None:
            return self.inner.get_streaming_response(messages, options)
        return forward(
            lambda: self.inner.get_streaming_response(messages, options),
            _Meter(self, log, messages, options),
        )


class _Meter(StreamWatcher):
    """One call through a `MeteredClient`: what it used, logged once when it ended."""

    __slots__ = (
        "characters",
        "client",
        "count",
        "first",
        "log",
        "messages",
        "model",
        "options",
        "started",
        "started_at",
        "usage",
    )

    def __init__(
        self,
        client: MeteredClient,
        log: _scope.AttemptLog,
        messages: Messages,
        options: ChatOptions | None,
    ) -> None:
        self.client = client
        self.log = log
        self.messages = messages
        self.options = options
        self.count = len(log.attempts)  # attempts logged before (a cache hit adds one)
        self.started_at = time.time()
        self.started = time.perf_counter()
        self.first: float | None = None
        self.usage: UsageDetails | None = None
        self.model: str | None = None
        self.characters = 0

    def update(self, update: ChatResponseUpdate) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.started
        if update.usage is not None:
            self.usage = update.usage if self.usage is None else self.usage + update.usage
        if update.model_id:
            self.model = update.model_id
        self.characters += streamed_characters(update)

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        if how == "completed":
            outcome = "completed"
        elif how in ("canceled", "abandoned"):
            outcome = how
        else:
            outcome = "failed_after_output" if self.first is not None else "failed_before_output"
        self._log(outcome, error)

    def _log(self, outcome: str, error: BaseException | None) -> None:
        log = self.log
        if len(log.attempts) != self.count or not reached_provider(error):
            return
        from pipeline.types import as_messages

        client = self.client
        metadata = metadata_of(client.inner)
        usage, estimated = attempt_usage(
            self.usage,
            completed=outcome == "completed",
            characters=self.characters,
            messages=as_messages(self.messages),
            error=error,
        )
        requested = (self.options.model_id if self.options else None) or metadata.model_id
        cost = priced(
            client.price,
            log.prices,
            metadata.provider_name,
            self.model or requested,
            usage,
            at=datetime.fromtimestamp(self.started_at, UTC),
            estimated=estimated,
        )
        log.add(
            _scope.PricedAttempt(
                route=client.route,
                number=1,
                outcome=outcome,
                provider=metadata.provider_name,
                model_requested=requested,
                model_served=self.model,
                usage=usage,
                estimated=estimated,
                cost=cost,
                started_at=self.started_at,
                duration=time.perf_counter() - self.started,
                time_to_first_update=self.first,
            )
        )
