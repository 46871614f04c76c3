"""The HTTP status and error every failure of the pipeline becomes (`error_for`), in OpenAI's
error shape, which each inbound format rewrites in its own. It also re-exports the Chat
Completions codec's names (`pipeline.wire.chat_completions.inbound`) that were importable
here before the codecs moved into `pipeline.wire`."""

from __future__ import annotations

import re
import time

from pipeline._retry_signal import signal_of as retry_signal_of
from pipeline.errors import (
    FailureKind,
    ProviderError,
    RequestRefusedError,
    RequestTimeoutError,
    RoutingError,
    WireError,
    classify,
    retry_after_of,
)
from pipeline.wire import (
    ChatRequest,
    caller_of,
    enum_value,
    request_object,
    unsupported_parameter,
    user_of,
)
from pipeline.wire.chat_completions.inbound import (
    ChunkEncoder,
    completion,
    error_body,
    finish_reason,
    parse_request,
)

__all__ = [
    "NOT_RETRYABLE",
    "ChatRequest",
    "ChunkEncoder",
    "WireError",
    "caller_of",
    "completion",
    "error_body",
    "enum_value",
    "error_for",
    "finish_reason",
    "now",
    "parse_request",
    "request_object",
    "unsupported_parameter",
    "user_of",
]


_SAFE_CODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# kind -> (status, type, code, our words)
_KINDS: dict[FailureKind, tuple[int, str, str | None, str]] = {
    FailureKind.RATE_LIMITED: (
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
        "the model provider is rate limiting requests",
    ),
    # The gateway's own provider account is out of quota or credit: the operator's to fix
    # (never the caller's 402, which is the caller's budget); a retry cannot help soon.
    FailureKind.QUOTA_EXHAUSTED: (
        503,
        "server_error",
        "upstream_quota_exhausted",
        "the model provider's quota or credit for the gateway's account is exhausted",
    ),
    FailureKind.REQUEST_INVALID: (
        400,
        "invalid_request_error",
        None,
        "the model provider refused the request as invalid",
    ),
    # OpenAI's own words ("This model's maximum context length is N tokens. ..."): the
    # phrase LiteLLM, the SDKs' users and agent frameworks look for to tell a context
    # overflow (LiteLLM's ContextWindowExceededError) from any other 400.
    FailureKind.CONTEXT_LENGTH_EXCEEDED: (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "This model's maximum context length is exceeded by the request. "
        "Please reduce the length of the messages.",
    ),
    FailureKind.CONTENT_FILTERED: (
        400,
        "invalid_request_error",
        "content_filter",
        "the model provider's content filter refused the request",
    ),
    # The provider refusing the gateway's own credentials is the gateway's fault, not the
    # caller's: 502 (an upstream answered badly), never the 401 that tells a client its
    # key is wrong; retrying cannot help (`NOT_RETRYABLE`).
    FailureKind.AUTHENTICATION: (
        502,
        "server_error",
        "upstream_authentication_failed",
        "the model provider refused the gateway's own credentials; your key for this "
        "gateway was accepted: the gateway's configuration must be fixed",
    ),
    FailureKind.TRANSIENT: (
        503,
        "server_error",
        "upstream_unavailable",
        "the model provider is unavailable",
    ),
    FailureKind.CIRCUIT_OPEN: (
        503,
        "server_error",
        "circuit_open",
        "the route is unavailable (circuit open)",
    ),
    FailureKind.INVALID_RESPONSE: (
        503,
        "server_error",
        "upstream_invalid_response",
        "the model provider's answer failed the route's response validation",
    ),
    FailureKind.UNKNOWN: (
        503,
        "server_error",
        "upstream_error",
        "the model provider failed to answer",
    ),
}


NOT_RETRYABLE = frozenset({"upstream_authentication_failed", "upstream_quota_exhausted"})
"""Error codes answered with ``x-should-retry: false``: the official SDKs (which retry
5xx) do not retry them."""


_EVERY_ROUTE_FAILED = frozenset(
    {
        FailureKind.RATE_LIMITED,
        FailureKind.QUOTA_EXHAUSTED,
        FailureKind.TRANSIENT,
        FailureKind.CIRCUIT_OPEN,
        FailureKind.INVALID_RESPONSE,
        FailureKind.UNKNOWN,
    }
)
"""The kinds of a failure before output that mean every route the request could take
failed (the others are the request's own fault, or the gateway's configuration)."""


def _said_wait(exc: BaseException, retry_after: float) -> float | None:
    """How long the routes said to wait, the earliest of every attempt (a rate limit that
    said no time: `retry_after`), or None when none said."""
    signal = retry_signal_of(exc)
    wait = signal.wait()
    if wait is None and signal.rate_limited:
        wait = retry_after
    return wait


def error_for(
    exc: BaseException,
    retry_after: float,
    *,
    after_output: bool = False,
    route: str | None = None,
) -> WireError:
    """The HTTP status and OpenAI error a failure of the pipeline becomes.

    A request the pipeline refused before any provider was called (`RequestRefusedError`:
    the caller's mistake) is a 400 naming its field, its message ours, and `route` (the one
    it reached, when known) named. Timeouts (the request's deadline, or an attempt cut short
    with nothing left to try) are 504; request errors 400 with their code (a context overflow
    in OpenAI's words, ``param: messages``); the provider refusing our credentials 502. Every
    other failure before output means every route failed, whatever each answered (rate
    limits, 5xx, open breakers, invalid answers): 503, read from every attempt
    (`pipeline._retry_signal`), with ``Retry-After`` the earliest time any route said it may
    serve again (a provider's ``Retry-After``, an open breaker's next probe; a rate limit
    that said no time counts as `retry_after`), or, when none said, `should_retry` False
    (``x-should-retry: false``: agents otherwise retry for minutes before their user sees
    anything). A failure `after_output` is one route's, mid-stream: its own status (429 for a
    rate limit), and a retry after its own ``Retry-After``, else `retry_after`. The message is
    ours: a kind and, for a provider error, which provider and what status it answered.
    """
    if isinstance(exc, WireError):
        return exc
    if isinstance(exc, RequestRefusedError):
        message = exc.message if route is None else f"{exc.message} (route {route})"
        return WireError(400, message, param=exc.param, code="invalid_value")
    if isinstance(exc, TimeoutError):  # RequestTimeoutError, AttemptTimeoutError, others
        what = (
            "the request's deadline passed before the model answered"
            if isinstance(exc, RequestTimeoutError)
            else "the model did not answer in time"
        )
        return WireError(504, what, type="timeout_error", code="timeout")
    if isinstance(exc, RoutingError):
        wait = retry_after if after_output else _said_wait(exc, retry_after)
        return WireError(
            503,
            "no route could serve the request"
            + ("" if wait is not None else "; no route says when it may serve again"),
            type="server_error",
            code="no_route",
            retry_after=wait,
            should_retry=None if wait is not None else False,
        )
    kind = classify(exc)
    status, type_, code, message = _KINDS.get(kind, _KINDS[FailureKind.UNKNOWN])
    wait = None
    should_retry = None
    if after_output:
        if status in (429, 503):
            # One route failed mid-answer: asking again may well be served.
            own = retry_after_of(exc)
            wait = own if own is not None else retry_after
            message += "; retry later"
    elif kind in _EVERY_ROUTE_FAILED:
        status, type_ = 503, "server_error"
        wait = _said_wait(exc, retry_after)
        if wait is None:
            should_retry = False
            message += "; no route says when it may serve again"
        else:
            message += "; retry later"
    if isinstance(exc, ProviderError):
        details = []
        if exc.provider:
            details.append(f"provider {exc.provider}")
        if exc.status_code is not None:
            details.append(f"HTTP {exc.status_code}")
        if details:
            message += f" ({', '.join(details)})"
        if code is None and exc.code and _SAFE_CODE.fullmatch(exc.code):
            code = exc.code
    param = "messages" if kind is FailureKind.CONTEXT_LENGTH_EXCEEDED else None
    return WireError(
        status,
        message,
        type=type_,
        code=code,
        param=param,
        retry_after=wait,
        should_retry=should_retry,
    )


def now() -> int:
    """The ``created`` timestamp of a response."""
    return int(time.time())
