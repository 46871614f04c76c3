import asyncio
import re
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import httpx2
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
    QuotaExhaustedError,
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
    retry_after_of,
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
        # An account out of quota or credit: waiting a Retry-After will not bring it back.
        (429, "insufficient_quota", FailureKind.QUOTA_EXHAUSTED),
        (402, None, FailureKind.QUOTA_EXHAUSTED),
        (402, "billing_error", FailureKind.QUOTA_EXHAUSTED),
    ],
)
def test_kind_for_status(status: int, code: str | None, kind: FailureKind) -> None:
    assert kind_for_status(status, code) is kind


def test_provider_error_factory_picks_the_subclass() -> None:
    classes = {
        FailureKind.RATE_LIMITED: RateLimitedError,
        FailureKind.QUOTA_EXHAUSTED: QuotaExhaustedError,
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


def _status_error(status: int, headers: dict[str, str] | None = None) -> httpx2.HTTPStatusError:
    request = httpx2.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return httpx2.HTTPStatusError(
        "x", request=request, response=httpx2.Response(status, headers=headers, request=request)
    )


def _legacy_status_error(status: int, headers: dict[str, str] | None = None) -> Exception:
    """The old httpx's error, as a user's own client raises it."""
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return httpx.HTTPStatusError(
        "x", request=request, response=httpx.Response(status, headers=headers, request=request)
    )


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (RateLimitedError(), FailureKind.RATE_LIMITED),
        (_status_error(503), FailureKind.TRANSIENT),
        (_status_error(401), FailureKind.AUTHENTICATION),
        (httpx2.ConnectError("refused"), FailureKind.TRANSIENT),
        (httpx2.ReadTimeout("slow"), FailureKind.TRANSIENT),
        (httpx2.RemoteProtocolError("cut"), FailureKind.TRANSIENT),
        (httpx2.SSEError("not an event stream"), FailureKind.TRANSIENT),
        (_legacy_status_error(429), FailureKind.RATE_LIMITED),
        (_legacy_status_error(500), FailureKind.TRANSIENT),
        (_legacy_status_error(400), FailureKind.REQUEST_INVALID),
        (httpx.ConnectError("refused"), FailureKind.TRANSIENT),
        (httpx.ReadTimeout("slow"), FailureKind.TRANSIENT),
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


def test_a_kind_given_as_its_value_is_that_kind() -> None:
    # A string equal to the kind's value names the kind: no contradiction.
    error = RateLimitedError("slow down", kind="rate_limited", status_code=429)
    assert type(error) is RateLimitedError and error.kind is FailureKind.RATE_LIMITED
    chosen = ProviderError(kind="transient")
    assert type(chosen) is TransientProviderError and chosen.kind is FailureKind.TRANSIENT
    assert type(ProviderError(kind="unknown")) is ProviderError


def test_a_contradicting_kind_still_raises_given_as_a_value_too() -> None:
    with pytest.raises(TypeError, match="kind=transient contradicts it"):
        RateLimitedError(kind="transient")
    with pytest.raises(TypeError, match="kind=rate_limited contradicts it"):
        ResponseValidationError(kind=FailureKind.RATE_LIMITED)


def test_an_unknown_kind_is_a_value_error_naming_the_kinds() -> None:
    with pytest.raises(ValueError, match=r"unknown failure kind 'slow'; expected one of \['rate_l"):
        ProviderError(kind="slow")


def test_every_error_class_lives_here_and_in_the_tree() -> None:
    import pipeline.errors as errors

    classes = [
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, BaseException)
    ]
    assert {c.__module__ for c in classes} == {"pipeline.errors"}
    assert errors.__doc__ is not None
    tree = set(re.findall(r"\w+", errors.__doc__.split("`classify(exc)`")[0]))
    # Caught inside the library, never a caller's: documented, not exported.
    internal = {"MalformedSSE", "RedisUnavailable", "RespError", "_VectorShapeError"}
    for cls in classes:
        assert cls.__name__ in tree
        if cls.__name__ in internal:
            assert cls.__name__ not in errors.__all__
            assert not issubclass(cls, ChatPipelineError)
            continue
        assert cls.__name__ in errors.__all__
        assert issubclass(cls, ChatPipelineError)


def test_errors_defined_here_are_still_importable_where_they_were_public() -> None:
    from middleware.function_invocation import ToolArgumentsError as from_loop
    from middleware.tools import ToolArgumentsError as from_tools
    from pipeline.errors import ToolArgumentsError, WireError
    from pipeline.gateway.wire import WireError as from_wire

    assert from_tools is from_loop is ToolArgumentsError and from_wire is WireError
    assert issubclass(ToolArgumentsError, ValueError)


def test_wire_error_is_the_openai_error_body_and_its_wait() -> None:
    from pipeline.errors import WireError

    error = WireError(429, "slow down", type="rate_limit_error", code="rate", retry_after=1.2)
    assert error.body() == (
        b'{"error":{"message":"slow down","type":"rate_limit_error","param":null,"code":"rate"}}'
    )
    assert error.headers() == [(b"retry-after", b"2")]
    assert WireError(400, "bad", param="x").headers() == []


@pytest.mark.parametrize(
    ("exc", "seconds"),
    [
        (RateLimitedError(retry_after=4.0), 4.0),
        (RateLimitedError(), None),
        (_status_error(429, {"Retry-After": "3"}), 3.0),
        (_status_error(503, {"Retry-After": "0.5"}), 0.5),
        (_status_error(429), None),
        (_status_error(429, {"Retry-After": "soon"}), None),
        (_legacy_status_error(429, {"Retry-After": "2"}), 2.0),
        (_legacy_status_error(429), None),
        (httpx2.ConnectError("refused"), None),
        (ValueError("?"), None),
    ],
)
def test_retry_after_of_reads_any_status_error_with_a_response(
    exc: BaseException, seconds: float | None
) -> None:
    assert retry_after_of(exc) == seconds


def test_retry_after_of_reads_an_sdk_style_error_carrying_a_response() -> None:
    class SDKStatusError(Exception):
        def __init__(self, response: httpx2.Response) -> None:
            super().__init__("rate limited")
            self.response = response

    response = httpx2.Response(429, headers={"retry-after": "6"})
    assert retry_after_of(SDKStatusError(response)) == 6.0

    class Hinted(Exception):
        retry_after: object = 1.5

    assert retry_after_of(Hinted()) == 1.5
    Hinted.retry_after = -1
    assert retry_after_of(Hinted()) is None
    Hinted.retry_after = True
    assert retry_after_of(Hinted()) is None


def test_classification_never_imports_the_old_httpx() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pipeline.errors as e;"
        "e.classify(ValueError()); e.retry_after_of(ValueError());"
        "assert 'httpx' not in sys.modules, 'httpx imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("code", "kept"),
    [
        ("rate_limit_exceeded", "rate_limit_exceeded"),
        ("500", "500"),
        ("model.v2-x", "model.v2-x"),
        ("CANARY prompt text echoed", None),
        ("x" * 65, None),
        ("", None),
        ("bad\ncode", None),
    ],
)
def test_only_safe_codes_reach_the_message(code: str, kept: str | None) -> None:
    error = provider_error(FailureKind.TRANSIENT, status_code=500, code=code, provider="p")
    assert error.code == kept
    if kept is None:
        assert str(error) == "p: transient (HTTP 500)"
    else:
        assert str(error) == f"p: transient (HTTP 500, code {kept})"


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


def test_an_exhausted_quota_fails_over_and_is_never_retried() -> None:
    error = QuotaExhaustedError(status_code=429, code="insufficient_quota", retry_after=1.0)
    assert classify(error) is FailureKind.QUOTA_EXHAUSTED
    assert is_failover_eligible(error)
    assert not is_retryable(error)
    assert not is_retryable(_status_error(402))
    assert is_failover_eligible(_status_error(402))
