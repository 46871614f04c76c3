import asyncio
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pybreaker
import pytest

from pipeline.errors import (
    AuthenticationError,
    ChatPipelineError,
    CircuitOpenError,
    ConfigError,
    ContentFilteredError,
    ContextLengthExceededError,
    FailureKind,
    ProviderError,
    RateLimitedError,
    RequestInvalidError,
    ResponseValidationError,
    TransientProviderError,
    UnknownProviderError,
    classify,
    is_failover_eligible,
    is_retryable,
    kind_for_status,
    parse_retry_after,
    provider_error,
)


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (429, None, FailureKind.RATE_LIMITED),
        (500, None, FailureKind.TRANSIENT),
        (503, None, FailureKind.TRANSIENT),
        (408, None, FailureKind.TRANSIENT),
        (400, None, FailureKind.REQUEST_INVALID),
        (404, None, FailureKind.REQUEST_INVALID),
        (422, None, FailureKind.REQUEST_INVALID),
        (401, None, FailureKind.AUTHENTICATION),
        (403, None, FailureKind.AUTHENTICATION),
        (400, "context_length_exceeded", FailureKind.CONTEXT_LENGTH_EXCEEDED),
        (400, "content_filter", FailureKind.CONTENT_FILTERED),
        (200, None, FailureKind.UNKNOWN),
    ],
)
def test_kind_for_status(status: int, code: str | None, kind: FailureKind) -> None:
    assert kind_for_status(status, code) is kind


def test_provider_error_factory_picks_the_subclass() -> None:
    classes = {
        FailureKind.RATE_LIMITED: RateLimitedError,
        FailureKind.TRANSIENT: TransientProviderError,
        FailureKind.CIRCUIT_OPEN: CircuitOpenError,
        FailureKind.REQUEST_INVALID: RequestInvalidError,
        FailureKind.CONTEXT_LENGTH_EXCEEDED: ContextLengthExceededError,
        FailureKind.CONTENT_FILTERED: ContentFilteredError,
        FailureKind.AUTHENTICATION: AuthenticationError,
        FailureKind.INVALID_RESPONSE: ResponseValidationError,
        FailureKind.UNKNOWN: UnknownProviderError,
    }
    assert set(classes) == set(FailureKind)
    for kind, cls in classes.items():
        error = provider_error(kind, status_code=500, provider="p", code="c", retry_after=1.0)
        assert type(error) is cls and error.kind is kind
        assert isinstance(error, ProviderError) and isinstance(error, ChatPipelineError)
        assert (error.status_code, error.provider, error.code, error.retry_after) == (
            500,
            "p",
            "c",
            1.0,
        )


def test_provider_error_message_is_ours() -> None:
    error = RateLimitedError(status_code=429, code="rate_limit", provider="openai")
    assert str(error) == "openai: rate limited (HTTP 429, code rate_limit)"
    assert str(TransientProviderError()) == "transient"


def test_config_error_names_the_key_path() -> None:
    error = ConfigError("routes.small.retry.max_attempts", "expected a positive integer")
    assert str(error) == "routes.small.retry.max_attempts: expected a positive integer"
    assert error.key_path == "routes.small.retry.max_attempts"


def _status_error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return httpx.HTTPStatusError(
        "x", request=request, response=httpx.Response(status, request=request)
    )


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (RateLimitedError(), FailureKind.RATE_LIMITED),
        (_status_error(503), FailureKind.TRANSIENT),
        (_status_error(401), FailureKind.AUTHENTICATION),
        (httpx.ConnectError("refused"), FailureKind.TRANSIENT),
        (httpx.ReadTimeout("slow"), FailureKind.TRANSIENT),
        (httpx.RemoteProtocolError("cut"), FailureKind.TRANSIENT),
        (TimeoutError(), FailureKind.TRANSIENT),
        (ConnectionResetError(), FailureKind.TRANSIENT),
        (pybreaker.CircuitBreakerError("open"), FailureKind.CIRCUIT_OPEN),
        (asyncio.CancelledError(), FailureKind.UNKNOWN),
        (ValueError("?"), FailureKind.UNKNOWN),
    ],
)
def test_classify(exc: BaseException, kind: FailureKind) -> None:
    assert classify(exc) is kind


def test_default_policies() -> None:
    assert is_retryable(RateLimitedError()) and is_retryable(TransientProviderError())
    for never in (
        RequestInvalidError(),
        ContextLengthExceededError(),
        ContentFilteredError(),
        AuthenticationError(),
        CircuitOpenError(),
        ResponseValidationError(),
        UnknownProviderError(),
        asyncio.CancelledError(),
        KeyboardInterrupt(),
    ):
        assert not is_retryable(never), never
    for eligible in (
        RateLimitedError(),
        TransientProviderError(),
        CircuitOpenError(),
        ResponseValidationError(),
        ValueError(),
        asyncio.CancelledError(),
    ):
        assert is_failover_eligible(eligible), eligible
    for never in (
        RequestInvalidError(),
        ContextLengthExceededError(),
        ContentFilteredError(),
        AuthenticationError(),
        KeyboardInterrupt(),
    ):
        assert not is_failover_eligible(never), never


def test_parse_retry_after_seconds_and_dates() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    now = datetime(2026, 1, 1, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(later, now=now.timestamp) == pytest.approx(30.0)
    earlier = format_datetime(now - timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(earlier, now=now.timestamp) == 0.0


def test_an_error_class_is_its_kind() -> None:
    from pipeline.errors import FailureKind, ProviderError, RateLimitedError

    with pytest.raises(TypeError, match="RateLimitedError is a rate_limited error"):
        RateLimitedError(kind=FailureKind.AUTHENTICATION)
    chosen = ProviderError("slow down", kind=FailureKind.RATE_LIMITED, status_code=429)
    assert type(chosen) is RateLimitedError and chosen.kind is FailureKind.RATE_LIMITED
    assert str(chosen) == "slow down" and chosen.status_code == 429
    assert RateLimitedError(kind=FailureKind.RATE_LIMITED).kind is FailureKind.RATE_LIMITED
    with pytest.raises(AttributeError):
        chosen.kind = FailureKind.TRANSIENT  # type: ignore[misc]


def test_response_validation_error_keeps_its_problems_and_kind() -> None:
    error = ResponseValidationError(
        "response is not a valid Invoice", problems=[("total", "missing")], provider="small"
    )
    assert error.kind is FailureKind.INVALID_RESPONSE
    assert error.problems == (("total", "missing"),)
    assert str(error) == "small: response is not a valid Invoice"
    made = ProviderError(kind=FailureKind.INVALID_RESPONSE)
    assert type(made) is ResponseValidationError and made.problems == ()
    assert str(made) == "invalid response"
    with pytest.raises(TypeError, match="contradicts"):
        ResponseValidationError(kind=FailureKind.TRANSIENT)
