"""What both wire formats (Chat Completions and Anthropic Messages) read and write alike.

Pure functions, no I/O. Anything a provider sends that does not fit raises a
`ProviderError` saying what was wrong, never a `KeyError` or `JSONDecodeError`, and never
quoting the payload (it may hold prompt text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pipeline.errors import FailureKind, ProviderError, kind_for_status, provider_error
from pipeline.types import FunctionResultContent, UsageDetails

__all__ = [
    "cache_counted_apart",
    "error_from_payload",
    "int_or_none",
    "malformed",
    "parse_arguments",
    "str_or_none",
    "tool_result_text",
]


def malformed(provider: str, what: str) -> ProviderError:
    """A provider sent something that is not the wire format."""
    return provider_error(
        FailureKind.UNKNOWN, f"malformed response: {what}", provider=provider, code="malformed"
    )


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def cache_counted_apart(
    uncached: Any, read: Any, written: Any, output: Any, reasoning: Any = None
) -> UsageDetails:
    """Usage from an API that counts prompt-cache reads and writes apart from its input
    tokens (Anthropic's Messages, Bedrock's Converse): input tokens include them, as
    `UsageDetails` counts them, and they are told apart too. Non-integers are unknown."""
    read, written = int_or_none(read), int_or_none(written)
    known = [p for p in (int_or_none(uncached), written, read) if p is not None]
    input_tokens = sum(known) if known else None
    output_tokens = int_or_none(output)
    total = (
        input_tokens + output_tokens
        if input_tokens is not None and output_tokens is not None
        else None
    )
    return UsageDetails(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        total_tokens=total,
        reasoning_tokens=int_or_none(reasoning),
        cache_read_tokens=read,
        cache_write_tokens=written,
    )


# -- errors -----------------------------------------------------------------------------------

# Error `code`s and `type`s of both formats, for errors that come without an HTTP status
# (in-band stream errors). With a status, the status decides (refined by the code).
_IN_BAND_KINDS = {
    "rate_limit_exceeded": FailureKind.RATE_LIMITED,
    "rate_limit_error": FailureKind.RATE_LIMITED,
    "insufficient_quota": FailureKind.QUOTA_EXHAUSTED,
    "billing_error": FailureKind.QUOTA_EXHAUSTED,
    "server_error": FailureKind.TRANSIENT,
    "api_error": FailureKind.TRANSIENT,
    "overloaded_error": FailureKind.TRANSIENT,
    "service_unavailable": FailureKind.TRANSIENT,
    "timeout_error": FailureKind.TRANSIENT,
    "context_length_exceeded": FailureKind.CONTEXT_LENGTH_EXCEEDED,
    "content_filter": FailureKind.CONTENT_FILTERED,
    "invalid_request_error": FailureKind.REQUEST_INVALID,
    "not_found_error": FailureKind.REQUEST_INVALID,
    "request_too_large": FailureKind.REQUEST_INVALID,
    "authentication_error": FailureKind.AUTHENTICATION,
    "permission_error": FailureKind.AUTHENTICATION,
}

# How providers begin the message of a request-invalid error that means the prompt does not
# fit (Anthropic: "prompt is too long: ..."; OpenAI-compatible servers without a code:
# "This model's maximum context length is ..."; Gemini: "The input token count (...)
# exceeds the maximum ..."). Only the start is compared, and the message is never copied
# anywhere.
_CONTEXT_MESSAGES = (
    "prompt is too long",
    "this model's maximum context length",
    "the input token count",
)
_REQUEST_TYPES = (None, "invalid_request_error", "INVALID_ARGUMENT")
# Anthropic refuses a request of an account out of credit as a 400 invalid_request_error
# ("Your credit balance is too low to access the Anthropic API. ..."): only these words tell
# it from a bad request. Compared the same way, never copied.
_QUOTA_MESSAGES = ("your credit balance is too low",)

# Google APIs (Gemini, Vertex AI) say more in an error's ``details``: how long to wait
# (``google.rpc.RetryInfo``) and why (``google.rpc.ErrorInfo``: a bad API key is a 400).
_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
_GOOGLE_AUTH_REASONS = frozenset({"API_KEY_INVALID"})


def _google_details(details: Any) -> tuple[str | None, float | None]:
    """The ``ErrorInfo`` reason and the ``RetryInfo`` delay (seconds) of Google's details."""
    reason = delay = None
    if not isinstance(details, list):
        return None, None
    for detail in details[:16]:
        if not isinstance(detail, Mapping):
            continue
        kind = detail.get("@type")
        if kind == _ERROR_INFO:
            reason = str_or_none(detail.get("reason"))
        elif kind == _RETRY_INFO:
            wait = detail.get("retryDelay")  # a Duration: "37s", "1.5s"
            if isinstance(wait, str) and wait.endswith("s"):
                try:
                    seconds = float(wait[:-1])
                except ValueError:
                    continue
                if seconds >= 0 and seconds != float("inf"):
                    delay = seconds
    return reason, delay


def _status_of(code: Any) -> int | None:
    """An HTTP status sent as an error code (LiteLLM sends ``"code": "500"``)."""
    if isinstance(code, str) and code.isdigit() and len(code) == 3:
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
        return code
    return None


def error_from_payload(
    error: Any, provider: str, *, status_code: int | None = None, url: str | None = None
) -> ProviderError:
    """A `ProviderError` from an error object: a body's ``error`` or an in-band one, in
    any of the formats (``{"code", "type", "message"}``, Anthropic's ``{"type",
    "message"}``, Google's ``{"code", "status", "message", "details"}``).

    Only the machine-readable `code`, `type` and Google's `status` are kept (Google's
    `status` as the code); the message is looked at only to recognize a prompt that is too
    long, and never copied, since providers echo request content in it. Without an HTTP
    status, a numeric code is looked up as one. Google's details give the wait
    (`retry_after`) and refine the kind (a 400 for a bad API key is `AUTHENTICATION`).
    """
    code: Any = None
    type_ = message = status = None
    reason = delay = None
    if isinstance(error, Mapping):
        code = error.get("code")
        status = str_or_none(error.get("status")) or None
        type_ = str_or_none(error.get("type")) or status
        message = str_or_none(error.get("message"))
        if "details" in error:
            reason, delay = _google_details(error["details"])
    numeric = _status_of(code)
    code_text = str(code) if isinstance(code, str | int) and not isinstance(code, bool) else None
    code_text = code_text or None
    # A numeric code is a status, not a name: the type refines it instead.
    name = type_ if numeric is not None else (code_text or type_)
    if (
        message is not None
        and type_ in _REQUEST_TYPES
        and message[:40].lower().startswith(_CONTEXT_MESSAGES)
    ):
        kind = FailureKind.CONTEXT_LENGTH_EXCEEDED
    elif (
        message is not None
        and type_ in (None, "invalid_request_error", "billing_error")
        and message[:40].lower().startswith(_QUOTA_MESSAGES)
    ):
        kind = FailureKind.QUOTA_EXHAUSTED
    elif reason in _GOOGLE_AUTH_REASONS:
        kind = FailureKind.AUTHENTICATION
    elif status_code is not None or numeric is not None:
        kind = kind_for_status(status_code or numeric or 0, name)
    else:
        kind = (
            _IN_BAND_KINDS.get(code_text or "")
            or _IN_BAND_KINDS.get(type_ or "")
            or FailureKind.UNKNOWN
        )
    return provider_error(
        kind,
        provider=provider,
        status_code=status_code,
        retry_after=delay,
        code=status or code_text or type_,
        url=url,
    )


# -- tools ------------------------------------------------------------------------------------


def tool_result_text(content: FunctionResultContent) -> str:
    """A tool result as the text a model reads (an exception names only its type)."""
    if content.exception is not None and content.result is None:
        return f"Error: {type(content.exception).__name__}"
    if isinstance(content.result, str):
        return content.result
    try:
        return json.dumps(content.result)
    except (TypeError, ValueError):
        return str(content.result)


def parse_arguments(raw: Any, provider: str) -> dict[str, Any]:
    """Tool call arguments (a JSON object, as a string or decoded) as a dict."""
    if isinstance(raw, Mapping):
        return dict(raw)
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, str):
        raise malformed(provider, "tool call arguments are neither a string nor an object")
    try:
        value = json.loads(raw)
    except ValueError:
        raise malformed(provider, "tool call arguments are not valid JSON") from None
    if not isinstance(value, dict):
        raise malformed(provider, "tool call arguments are not a JSON object")
    return value
