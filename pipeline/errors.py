"""Every error the library raises, and how any exception is classified.

::

    ChatPipelineError
    ├── ConfigError                    a configuration value is wrong; names the key path
    ├── ToolArgumentsError             a tool call's arguments do not fit the tool
    │                                  (also a ValueError)
    ├── WireError                      the gateway answers a request with an HTTP error
    │                                  (its status and OpenAI error body)
    ├── RequestRefusedError            the pipeline refused the request before any provider
    │                                  was called; names the field (also a ValueError)
    ├── BudgetExceededError            a budget of the caller (key, team, user) is spent
    ├── RateLimitExceededError         the caller's own rate limit is reached (retry_after)
    ├── BudgetUnavailableError         budgets could not be checked and fail_closed is set
    ├── KeyNotFoundError               no virtual key has that id or name (also a LookupError)
    ├── SchemaVersionError             a database's schema is not this code's (run
    │                                  `chat-pipeline db upgrade`, or upgrade the code)
    ├── RoutingError                   a router could not pick a route
    │   ├── SemanticIndexError         a saved semantic index does not fit this router
    │   ├── RequestBudgetExceededError  the request's provider-call budget is spent
    │   └── RequestTimeoutError        the request's deadline passed (also a TimeoutError)
    └── ProviderError                  a provider failed; `kind` says how (FailureKind)
        ├── RateLimitedError           RATE_LIMITED             429
        ├── QuotaExhaustedError        QUOTA_EXHAUSTED          the provider account's quota or
        │                                                       credit ran out (402,
        │                                                       insufficient_quota)
        ├── TransientProviderError     TRANSIENT                5xx, timeouts, resets, cut streams
        │   └── AttemptTimeoutError    TRANSIENT                the router cut an attempt short
        │                                                       (also a TimeoutError)
        ├── CircuitOpenError           CIRCUIT_OPEN             the route's breaker is open
        ├── RequestInvalidError        REQUEST_INVALID          400/404/422
        │   └── UnsendableRequestError REQUEST_INVALID          not sent: not JSON, a bad tool
        │                                                       (also a ValueError)
        ├── ContextLengthExceededError CONTEXT_LENGTH_EXCEEDED  prompt too long for the model
        ├── ContentFilteredError       CONTENT_FILTERED         the provider's filter refused
        ├── AuthenticationError        AUTHENTICATION           401/403
        ├── ResponseValidationError    INVALID_RESPONSE         the answer failed the route's
        │                                                       response validation
        └── UnknownProviderError       UNKNOWN                  anything else a provider said

Four more live here that never reach a caller (not exported: the library catches them)::

    MalformedSSE                       a line of a provider's stream is not server-sent
                                       events (a ValueError; becomes a ProviderError)
    RedisUnavailable                   Redis was not used for a call (skipped during an
                                       outage, or failed): the component fails open
    RespError                          an error reply of Redis to the budgets' connection
                                       (its first word only)
    _VectorShapeError                  an embedding matrix of the wrong shape (a ValueError;
                                       becomes a typed error where an embedder is checked)

`classify(exc)` maps any exception (ours, httpx2's, the old httpx's or aiohttp's when the
application already imported them, or unknown) to a `FailureKind`; `retry_after_of(exc)`
reads the wait a failure asks for (ours, or ``Retry-After`` of any HTTP status error with a
response). The
default policies built on it: `is_retryable` (rate limits and transient failures) and
`is_failover_eligible` (those, an exhausted quota, an open circuit, an invalid response and
unknown failures): a malformed answer is that deployment's failure, another route may answer
well, but the same route asked again usually answers the same way, so it is not retried; an
exhausted quota or credit balance stays exhausted for hours, so it is never retried either.
Request errors (invalid, too long, filtered, unauthenticated) are never retried nor failed
over: another deployment would refuse them the same way.

Messages never contain prompt text, response text or credentials: provider errors are
built from status codes and provider error codes, never from echoed request bodies, and a
provider's error code is kept only when it looks like one (letters, digits and ``_.-``).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, Self

import httpx2

__all__ = [
    "AttemptTimeoutError",
    "AuthenticationError",
    "BudgetExceededError",
    "BudgetUnavailableError",
    "ChatPipelineError",
    "CircuitOpenError",
    "ConfigError",
    "ContentFilteredError",
    "ContextLengthExceededError",
    "FailureKind",
    "KeyNotFoundError",
    "ProviderError",
    "QuotaExhaustedError",
    "RateLimitExceededError",
    "RateLimitedError",
    "RequestBudgetExceededError",
    "RequestInvalidError",
    "RequestRefusedError",
    "RequestTimeoutError",
    "ResponseValidationError",
    "RoutingError",
    "SchemaVersionError",
    "SemanticIndexError",
    "ToolArgumentsError",
    "TransientProviderError",
    "UnsendableRequestError",
    "UnknownProviderError",
    "WireError",
    "classify",
    "is_failover_eligible",
    "is_retryable",
    "kind_for_status",
    "parse_retry_after",
    "provider_error",
    "retry_after_of",
]


class FailureKind(StrEnum):
    """Why a call failed, as far as routing and retry care."""

    RATE_LIMITED = "rate_limited"
    QUOTA_EXHAUSTED = "quota_exhausted"
    TRANSIENT = "transient"
    CIRCUIT_OPEN = "circuit_open"
    REQUEST_INVALID = "request_invalid"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CONTENT_FILTERED = "content_filtered"
    AUTHENTICATION = "authentication"
    INVALID_RESPONSE = "invalid_response"
    UNKNOWN = "unknown"


class ChatPipelineError(Exception):
    """Base of every error this library raises."""


class ConfigError(ChatPipelineError):
    """Configuration is missing or wrong. `key_path` names the (first) problem's key, e.g.
    ``routes.a.model``; `problems` lists every ``(key path, what is wrong)`` found, and the
    message has one line per problem."""

    def __init__(
        self,
        key_path: str,
        message: str,
        *,
        problems: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        self.key_path = key_path
        self.detail = message
        self.problems: tuple[tuple[str, str], ...] = (
            tuple(problems) if problems else ((key_path, message),)
        )
        super().__init__(
            "\n".join(f"{path}: {what}" if path else what for path, what in self.problems)
        )

    @classmethod
    def from_problems(cls, problems: Sequence[tuple[str, str]]) -> ConfigError:
        """One error reporting every problem (at least one)."""
        path, message = problems[0]
        return cls(path, message, problems=problems)


class ToolArgumentsError(ChatPipelineError, ValueError):
    """Arguments that do not fit the tool's signature. The message names the fields and
    error types only, never the offending values (they may be user content)."""


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class WireError(ChatPipelineError):
    """A request the gateway answers with an error: its HTTP status and OpenAI error.

    `message` is ours, never the request's text; `retry_after` (seconds) becomes a
    ``Retry-After`` header. `should_retry` False says a retry cannot help soon (answered
    with ``x-should-retry: false``, and, in Anthropic's format, an error type its clients do
    not retry).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.should_retry = should_retry

    @staticmethod
    def error_body(message: str, type: str, code: str | None, param: str | None = None) -> bytes:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        error = {"message": message, "type": type, "param": param, "code": code}
        return _dumps({"error": error}).encode()

    def body(self) -> bytes:
        return self.error_body(self.message, self.type, self.code, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return []
        return [(b"retry-after", str(max(1, math.ceil(self.retry_after))).encode())]


class RequestRefusedError(ChatPipelineError, ValueError):
    """The pipeline refused the request before any provider was called: the caller's
    mistake, never a provider's (an empty conversation; a value the API of the route it
    reached cannot express). `param` names the field (``messages``, ``reasoning.effort``);
    the message is ours and quotes no content.

    `classify` makes it `REQUEST_INVALID`: never retried nor failed over, and a breaker
    counts it as nothing (no deployment was asked). The gateway answers it with a 400
    naming `param`, in every format.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @classmethod
    def untranslatable(
        cls, param: str, value: object, api: str, known: Sequence[str] = ()
    ) -> RequestRefusedError:
        """`param`'s value has no equivalent in `api` (the API of the route the request
        reached), which takes the `known` values. The value is named when it looks like
        an enum's value (letters, digits and ``_.-``), else only described."""
        shown = f"{value!r}" if type(value) is str and _SAFE_CODE.fullmatch(value) else "its value"
        takes = f" (it takes {', '.join(known)})" if known else ""
        return cls(f"{param}: {shown} has no equivalent in {api}{takes}", param=param)


class BudgetExceededError(ChatPipelineError):
    """A budget the request counts against is spent (`scope`: ``key``, ``team`` or
    ``user``): no provider was called. Retrying cannot help before the budget's period ends
    or it is raised."""

    def __init__(self, scope: str = "key", name: str | None = None) -> None:
        self.scope = scope
        self.name = name
        super().__init__(f"the {scope}'s budget is spent")


class RateLimitExceededError(ChatPipelineError):
    """The caller's own rate limit is reached (`scope` ``key`` or ``team``, `unit`
    ``requests`` or ``tokens``, `limit` a minute): no provider was called; a retry after
    `retry_after` seconds can be admitted. `states` holds each limit's remaining and reset
    (the response headers' figures)."""

    def __init__(
        self,
        scope: str = "key",
        unit: str = "requests",
        limit: int = 0,
        *,
        retry_after: float = 1.0,
        states: Sequence[Any] = (),
    ) -> None:
        self.scope = scope
        self.unit = unit
        self.limit = limit
        self.retry_after = retry_after
        self.states = tuple(states)
        super().__init__(f"the {scope}'s limit of {limit} {unit} a minute is reached")


class BudgetUnavailableError(ChatPipelineError):
    """Budgets and rate limits could not be checked (their Redis did not answer) and they
    are configured to fail closed: the request was refused, not served unchecked."""

    def __init__(self, *, retry_after: float = 1.0) -> None:
        self.retry_after = retry_after
        super().__init__("budgets could not be checked; retry later")


class KeyNotFoundError(ChatPipelineError, LookupError):
    """No virtual key has that id or name."""


class RoutingError(ChatPipelineError):
    """A router could not choose a route (the selector returned nothing, or no route fits)."""


class _VectorShapeError(ValueError):
    """What an embedder returned is not the matrix expected (count, dimension, finiteness,
    zero rows; `zero` tells the last). Private (`pipeline._vectors` raises it): callers turn
    it into their own typed error; the message names no text."""

    def __init__(self, message: str, *, zero: bool = False) -> None:
        super().__init__(message)
        self.zero = zero


class SemanticIndexError(RoutingError):
    """A saved semantic-routing index cannot be used by this router: not such a file, another
    format version, or made by another embedder (identity, dimension or probe vectors)."""


class RequestBudgetExceededError(RoutingError):
    """The request has used every provider call its router allowed."""


class RequestTimeoutError(RoutingError, TimeoutError):
    """The request's deadline (the router's ``request_timeout``) passed. A `TimeoutError`,
    so code written for `asyncio.timeout` keeps working."""


class ProviderError(ChatPipelineError):
    """A provider call failed.

    `kind` decides what the pipeline does next (see `FailureKind`); `status_code`,
    `retry_after` (seconds), `provider` and the provider's error `code` describe it; `url`
    is the endpoint called, without query string. The message is ours, never the
    provider's body, so it cannot carry prompt text; a `code` that does not look like an
    error code (letters, digits and ``_.-``) is dropped, from the message and from `.code`
    alike.

    An error's class is its classification: ``ProviderError(kind=k)`` creates the subclass
    for `k` (as `provider_error` does), and a subclass given a contradicting `kind` is a
    `TypeError`, so catching `RateLimitedError` catches exactly the rate limits.
    """

    default_kind = FailureKind.UNKNOWN

    def __new__(
        cls, *args: object, kind: FailureKind | str | None = None, **kwargs: object
    ) -> Self:
        if kind is not None:
            # A kind's value ("rate_limited") is that kind: compared as a FailureKind.
            try:
                kind = FailureKind(kind)
            except ValueError:
                raise ValueError(
                    f"unknown failure kind {kind!r}; expected one of "
                    f"{[k.value for k in FailureKind]}"
                ) from None
            if kind is not cls.default_kind:
                if cls is not ProviderError:
                    raise TypeError(
                        f"{cls.__name__} is a {cls.default_kind.value} error; kind={kind!s} "
                        "contradicts it (provider_error(kind) picks the class for a kind)"
                    )
                cls = _ERROR_CLASSES[kind]  # type: ignore[assignment]
        return super().__new__(cls, *args)

    def __init__(
        self,
        message: str = "",
        *,
        kind: FailureKind | str | None = None,
        status_code: int | None = None,
        retry_after: float | None = None,
        provider: str | None = None,
        code: str | None = None,
        url: str | None = None,
    ) -> None:
        self.status_code = status_code
        self.retry_after = retry_after
        self.provider = provider
        self.code = code = _safe_code(code)
        self.url = url
        self.message = message or _describe(self.kind, status_code, code)
        super().__init__(self.message)

    @property
    def kind(self) -> FailureKind:
        """The classification: fixed by the class."""
        return self.default_kind

    def __str__(self) -> str:
        prefix = f"{self.provider}: " if self.provider else ""
        return f"{prefix}{self.message}"


class RateLimitedError(ProviderError):
    default_kind = FailureKind.RATE_LIMITED


class QuotaExhaustedError(ProviderError):
    """The provider account's own quota or credit ran out (OpenAI's ``insufficient_quota``,
    Anthropic's credit-balance refusal, a 402 from an OpenAI-compatible vendor): the route
    cannot serve for a long while. Failed over before output, never retried on that route."""

    default_kind = FailureKind.QUOTA_EXHAUSTED


class TransientProviderError(ProviderError):
    default_kind = FailureKind.TRANSIENT


class AttemptTimeoutError(TransientProviderError, TimeoutError):
    """The router cut an attempt at its own limit (``attempt_timeout``, or the time it keeps
    for a backup): the route did not answer in time. A deployment failure: the route's
    breaker counts it and the router may fail over."""


class CircuitOpenError(ProviderError):
    """The route's circuit breaker is open: the call was not made."""

    default_kind = FailureKind.CIRCUIT_OPEN


class RequestInvalidError(ProviderError):
    default_kind = FailureKind.REQUEST_INVALID


class UnsendableRequestError(RequestInvalidError, ValueError):
    """The request could not be put on the wire (options that are not JSON, a malformed
    tool or content, no model): nothing was sent. The caller's mistake: never retried nor
    failed over, and a breaker counts it as nothing (the deployment was never asked)."""


class ContextLengthExceededError(ProviderError):
    default_kind = FailureKind.CONTEXT_LENGTH_EXCEEDED


class ContentFilteredError(ProviderError):
    default_kind = FailureKind.CONTENT_FILTERED


class AuthenticationError(ProviderError):
    default_kind = FailureKind.AUTHENTICATION


class UnknownProviderError(ProviderError):
    default_kind = FailureKind.UNKNOWN


class ResponseValidationError(ProviderError):
    """The response failed the route's response validation (`use_response_validation`):
    not the JSON the caller asked for, or refused by the caller's check.

    `problems` lists each problem as ``(location, what)``: a location in the JSON
    (``items[0].price``; ``$`` for the whole answer) and an error type (``missing``,
    ``json_invalid``, ``required``, ...). Neither the message nor `problems` ever quotes the
    response: locations name only the validator's own fields (other keys show as ``*``).
    `usage` is the refused response's token usage (`UsageDetails`), when it reported one:
    what getting it cost, which the spend ledger records.
    """

    default_kind = FailureKind.INVALID_RESPONSE

    def __init__(
        self,
        message: str = "",
        *,
        problems: Sequence[tuple[str, str]] = (),
        usage: Any = None,
        **fields: Any,
    ) -> None:
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)
        self.usage = usage
        super().__init__(message, **fields)


class SchemaVersionError(ChatPipelineError):
    """A database's schema is not the one this code needs: behind it (``chat-pipeline db
    upgrade`` applies the missing migrations) or ahead of it (newer code wrote it). `found`
    and `expected` are the versions."""

    def __init__(self, message: str, *, found: int, expected: int) -> None:
        super().__init__(message)
        self.found = found
        self.expected = expected


class MalformedSSE(ValueError):
    """A line that is not server-sent events."""


class RespError(Exception):
    """An error reply of Redis on the budgets' bare connection (`pipeline._resp`): `code`
    is its first word (``NOSCRIPT``, ``ERR``, ...), the rest may echo arguments."""

    def __init__(self, code: str) -> None:
        super().__init__(f"Redis answered {code}")
        self.code = code


class RedisUnavailable(Exception):
    """Redis was not used for this call (being skipped, or the call failed: `Outage` has
    logged why). Never reaches a caller of the library."""


_ERROR_CLASSES: dict[FailureKind, type[ProviderError]] = {
    cls.default_kind: cls
    for cls in (
        RateLimitedError,
        QuotaExhaustedError,
        TransientProviderError,
        CircuitOpenError,
        RequestInvalidError,
        ContextLengthExceededError,
        ContentFilteredError,
        AuthenticationError,
        ResponseValidationError,
        UnknownProviderError,
    )
}


_SAFE_CODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _safe_code(code: object) -> str | None:
    """`code` if it looks like a machine-readable error code (letters, digits, ``_.-``, at
    most 64 characters), else None: a provider's "code" could otherwise smuggle echoed
    request text into messages, logs and spans."""
    if type(code) is str and _SAFE_CODE.fullmatch(code):
        return code
    return None


def _describe(kind: FailureKind, status_code: int | None, code: str | None) -> str:
    parts = [kind.value.replace("_", " ")]
    if status_code is not None:
        parts.append(f"(HTTP {status_code}")
        parts[-1] += f", code {code})" if code else ")"
    elif code:
        parts.append(f"(code {code})")
    return " ".join(parts)


def provider_error(
    kind: FailureKind,
    message: str = "",
    *,
    status_code: int | None = None,
    retry_after: float | None = None,
    provider: str | None = None,
    code: str | None = None,
    url: str | None = None,
) -> ProviderError:
    """Create the `ProviderError` subclass that matches `kind`."""
    return _ERROR_CLASSES[kind](
        message,
        kind=kind,
        status_code=status_code,
        retry_after=retry_after,
        provider=provider,
        code=code,
        url=url,
    )


_CONTEXT_CODES = frozenset({"context_length_exceeded", "string_above_max_length"})
_FILTER_CODES = frozenset({"content_filter", "content_policy_violation", "content_filtered"})
# OpenAI answers an account out of quota 429 ``insufficient_quota`` (a rate limit's status:
# only the code tells that waiting will not help); vendors say the same in these words.
_QUOTA_CODES = frozenset(
    {"insufficient_quota", "billing_hard_limit_reached", "insufficient_balance", "quota_exceeded"}
)


def kind_for_status(status_code: int, code: str | None = None) -> FailureKind:
    """The failure kind of an HTTP status, refined by the provider's error `code`."""
    if code in _CONTEXT_CODES:
        return FailureKind.CONTEXT_LENGTH_EXCEEDED
    if code in _FILTER_CODES:
        return FailureKind.CONTENT_FILTERED
    if code in _QUOTA_CODES or status_code == 402:
        return FailureKind.QUOTA_EXHAUSTED
    if status_code == 429:
        return FailureKind.RATE_LIMITED
    if status_code in (401, 403):
        return FailureKind.AUTHENTICATION
    if status_code == 408 or status_code >= 500:
        return FailureKind.TRANSIENT
    if 400 <= status_code < 500:
        return FailureKind.REQUEST_INVALID
    return FailureKind.UNKNOWN


def parse_retry_after(value: str | None, *, now: Callable[[], float] = time.time) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta seconds or an HTTP date).

    Returns `None` for a missing or unparseable value; never a negative number.
    """
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - now()
    if math.isnan(seconds) or math.isinf(seconds):
        return None
    return max(0.0, seconds)


def classify(exc: BaseException) -> FailureKind:
    """Map any exception to a `FailureKind`.

    Our `ProviderError`s carry their kind; httpx2 status errors map by status; its
    transport errors (timeouts, refused or reset connections, broken HTTP) and any
    `TimeoutError`/`ConnectionError` are transient. When the application already imported
    the old ``httpx`` or ``aiohttp`` (this module imports neither), their errors map the
    same way: aiohttp's status errors (``ClientResponseError``) by status, its other
    ``ClientError``s (timeouts, connection, TLS and DNS failures, a body cut short) are
    transient, except an invalid URL (`UNKNOWN`, like httpx2's). pybreaker's open-circuit
    error is `CIRCUIT_OPEN`; everything else (including a stray `CancelledError` from a
    client) is `UNKNOWN`.
    """
    if isinstance(exc, ProviderError):
        return exc.kind
    if isinstance(exc, RequestRefusedError):
        return FailureKind.REQUEST_INVALID
    if isinstance(exc, httpx2.HTTPStatusError):
        return kind_for_status(exc.response.status_code)
    if isinstance(exc, httpx2.TransportError | TimeoutError | ConnectionError):
        return FailureKind.TRANSIENT
    legacy = sys.modules.get("httpx")
    if legacy is not None and legacy is not httpx2:
        if isinstance(exc, legacy.HTTPStatusError):
            return kind_for_status(exc.response.status_code)
        if isinstance(exc, legacy.TransportError):
            return FailureKind.TRANSIENT
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        if isinstance(exc, aiohttp.ClientResponseError):
            return kind_for_status(exc.status)
        if isinstance(exc, aiohttp.InvalidURL):
            return FailureKind.UNKNOWN
        return FailureKind.TRANSIENT
    if _is_breaker_open(exc):
        return FailureKind.CIRCUIT_OPEN
    return FailureKind.UNKNOWN


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds the failure asks the caller to wait, or None when it does not say.

    A `ProviderError`'s `retry_after`; otherwise the ``Retry-After`` header of the response
    an HTTP status error carries: httpx2's, the old httpx's (when the application already
    imported it), or any error whose ``response`` attribute is one of their responses (as
    the official SDKs' status errors are), or an aiohttp ``ClientResponseError``'s headers;
    otherwise a non-negative number in the exception's own ``retry_after`` attribute.
    """
    if isinstance(exc, ProviderError):
        return exc.retry_after
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientResponseError) and exc.headers:
        return parse_retry_after(exc.headers.get("Retry-After"))
    response = getattr(exc, "response", None)
    if response is not None and _is_http_response(response):
        return parse_retry_after(response.headers.get("retry-after"))
    value = getattr(exc, "retry_after", None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _is_http_response(value: object) -> bool:
    if isinstance(value, httpx2.Response):
        return True
    legacy = sys.modules.get("httpx")
    return legacy is not None and isinstance(value, legacy.Response)


def _is_breaker_open(exc: BaseException) -> bool:
    # pybreaker is imported lazily: classification must stay cheap for pipelines without it.
    try:
        import pybreaker
    except ImportError:  # pragma: no cover - pybreaker is a dependency
        return False
    return isinstance(exc, pybreaker.CircuitBreakerError)


_RETRYABLE = frozenset({FailureKind.RATE_LIMITED, FailureKind.TRANSIENT})
_FAILOVER = frozenset(
    {
        FailureKind.RATE_LIMITED,
        FailureKind.QUOTA_EXHAUSTED,
        FailureKind.TRANSIENT,
        FailureKind.CIRCUIT_OPEN,
        FailureKind.INVALID_RESPONSE,
        FailureKind.UNKNOWN,
    }
)


def is_retryable(exc: BaseException) -> bool:
    """Default retry policy: rate limits and transient failures; never a cancellation."""
    if isinstance(exc, asyncio.CancelledError) or not isinstance(exc, Exception):
        return False
    return classify(exc) in _RETRYABLE


def is_failover_eligible(exc: BaseException) -> bool:
    """Default failover policy: deployment failures (an exhausted quota included), an open
    circuit, an invalid response and unknown failures.

    A `CancelledError` raised by a client while its caller is not being cancelled counts as
    an unknown failure; the routers decide about caller cancellation before asking.
    """
    if not isinstance(exc, Exception | asyncio.CancelledError):
        return False
    return classify(exc) in _FAILOVER
