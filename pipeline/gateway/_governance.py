"""The governance layer: a key's model scope, then its budgets and rate limits (and its
team's and user's), checked after the body was read and before the pipeline runs.

* a model outside the virtual key's globs: 403 ``model_not_allowed``;
* a budget spent: 402 ``budget_exceeded`` with ``x-should-retry: false`` (the SDKs and
  agents do not retry it; Codex, which reads neither, gets the 429 ``usage_limit_reached``
  it stops on, still with code ``budget_exceeded``);
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
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pipeline import _scope
from pipeline._governance import Admission, Governor, RateCost, Subject
from pipeline._metering import DirectAttempt
from pipeline._reservations import Granted, RateCheck, RateState
from pipeline._streams import forward
from pipeline.client import ChatClient, DelegatingChatClient
from pipeline.errors import BudgetExceededError, BudgetUnavailableError, RateLimitExceededError
from pipeline.gateway._exchange import EXCHANGE, ASGIApp, Exchange, Receive, Scope, Send
from pipeline.gateway.wire import WireError
from pipeline.keys._model import model_allowed
from pipeline.pricing import Price, estimate_input_tokens
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

    from pipeline.config import PipelineConfig
    from pipeline.keys import KeyRing, KeyStore
    from pipeline.keys._settings import BudgetsSettings

__all__ = [
    "Governance",
    "GovernanceMiddleware",
    "MeteredClient",
    "granted_headers",
    "rate_headers",
]

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


def _reset_time(milliseconds: int) -> bytes:
    """Anthropic's reset format: when, as an RFC 3339 time (whole seconds, UTC)."""
    reset = (datetime.now(UTC) + timedelta(milliseconds=milliseconds)).replace(microsecond=0)
    return reset.isoformat().replace("+00:00", "Z").encode()


_HeaderPlan = tuple[tuple[int, bytes, bytes, bytes, bytes], ...]


def _plan(rates: Sequence[RateCheck], anthropic: bool) -> _HeaderPlan:
    """The rate-limit headers' names and limits: the first limit of each unit (the key's
    before its team's), by its place in `rates`; OpenAI's names or Anthropic's."""
    plan = []
    seen: set[str] = set()
    for index, check in enumerate(rates):
        unit = check.unit
        if unit in seen:
            continue
        seen.add(unit)
        name = unit.encode()
        if anthropic:
            prefix = b"anthropic-ratelimit-" + name
            names = (prefix + b"-limit", prefix + b"-remaining", prefix + b"-reset")
        else:
            names = (
                b"x-ratelimit-limit-" + name,
                b"x-ratelimit-remaining-" + name,
                b"x-ratelimit-reset-" + name,
            )
        plan.append((index, *names, str(check.limit).encode()))
    return tuple(plan)


def _headers_of(
    plan: _HeaderPlan, values: Sequence[int], anthropic: bool
) -> list[tuple[bytes, bytes]]:
    """The headers of `plan` with each limit's remaining and reset (ms) from `values`."""
    reset = _reset_time if anthropic else _duration
    headers: list[tuple[bytes, bytes]] = []
    for index, limit_name, remaining_name, reset_name, limit in plan:
        headers += (
            (limit_name, limit),
            (remaining_name, b"%d" % values[2 * index]),
            (reset_name, reset(values[2 * index + 1])),
        )
    return headers


def rate_headers(states: tuple[RateState, ...], *, anthropic: bool) -> list[tuple[bytes, bytes]]:
    """The rate-limit headers of `states` (the first limit of each unit: the key's before
    its team's), OpenAI's or Anthropic's."""
    values = [value for state in states for value in (state.remaining, state.reset_ms)]
    return _headers_of(_plan([state.check for state in states], anthropic), values, anthropic)


def granted_headers(granted: Granted, *, anthropic: bool) -> list[tuple[bytes, bytes]]:
    """`rate_headers` of an admitted request (the names made once per caller's limits)."""
    limits = granted.limits
    memo = "anthropic headers" if anthropic else "openai headers"
    plan = limits.memo.get(memo)
    if plan is None:
        plan = limits.memo[memo] = _plan(limits.rates, anthropic)
    return _headers_of(plan, granted.values, anthropic)


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


def _from_codex(scope: Scope) -> bool:
    """Whether the request came from the Codex CLI (or another Codex client): its
    ``originator`` header (``codex_exec``, ``codex_cli_rs``, ``codex_vscode``)."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    return any(name == b"originator" and value.startswith(b"codex") for name, value in headers)


def _for_codex(error: WireError) -> WireError:
    """A spent budget as Codex stops on it: Codex retries a 402 (any status but 400 and a
    429 of type ``usage_limit_reached``) five times, whatever ``x-should-retry`` says, and
    stops at once, telling its user the usage limit is reached, on a 429 of that type (what
    its own plans' limits answer). The code stays ``budget_exceeded``, the message ours."""
    return WireError(
        429,
        error.message,
        type="usage_limit_reached",
        code=error.code,
        should_retry=False,
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

    __slots__ = ("_anthropic", "_governance", "_path", "_responses", "app")

    def __init__(self, app: ASGIApp, *, governance: Governance, path: str) -> None:
        self.app = app
        self._governance = governance
        self._path = path
        self._anthropic = path.startswith("/v1/messages")
        self._responses = path == "/v1/responses"

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
            if self._responses and isinstance(exc, BudgetExceededError) and _from_codex(scope):
                error = _for_codex(error)
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
            admission.settle(exchange.attempts if exchange.attempts is not None else log)

    def _headers(self, exchange: Exchange, admission: Admission) -> None:
        granted = admission.granted
        if granted is None:
            return
        if granted.values:
            exchange.extra_headers += granted_headers(granted, anthropic=self._anthropic)
        remaining = granted.soft_remaining
        if remaining is not None:
            shown = max(remaining, Decimal(0)).quantize(Decimal("0.000001"))
            exchange.extra_headers.append((_BUDGET_HEADER, str(shown).encode()))


# -- what a target without a router cost ---------------------------------------------------


class MeteredClient(DelegatingChatClient):
    """A model name's client without a router beneath (a route served by name, a pipeline
    of one route): the call itself is the request's one attempt (a
    `pipeline._metering.DirectAttempt`, as the spend layer logs it), priced with `price`
    (the route's, else the attempt log's book) and added to the request's attempt log when
    it ended, so budgets settle with it. Routers log their own attempts; a cache hit logs
    itself (then nothing is added here)."""

    def __init__(self, inner: ChatClient, *, route: str, price: Price | None) -> None:
        super().__init__(inner)
        self.route = route
        self.price = price

    def _attempt(self, messages: Messages, options: ChatOptions | None) -> DirectAttempt | None:
        log = _scope.current_attempt_log()
        if log is None:
            return None
        return DirectAttempt(
            log,
            route=self.route,
            client=self.inner,
            messages=messages,
            options=options,
            price=self.price,
        )

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        attempt = self._attempt(messages, options)
        if attempt is None:
            return await self.inner.get_response(messages, options)
        mark = attempt.enter()
        try:
            response = await self.inner.get_response(messages, options)
        except BaseException as exc:
            attempt.exit(mark)
            attempt.failed(exc)
            raise
        attempt.exit(mark)
        attempt.responded(response)
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        attempt = self._attempt(messages, options)
        if attempt is None:
            return self.inner.get_streaming_response(messages, options)
        return forward(lambda: self.inner.get_streaming_response(messages, options), attempt)
