"""What every wire API reads and writes alike: the errors of a bad answer (`malformed`,
`error_from_payload`) and of a bad request (`WireError`, `invalid`...), field readers,
usage, tool results, the compact JSON the codecs write, and the request every inbound codec
makes (`ChatRequest`). Pure functions, no I/O; nothing here quotes a payload (it may hold
prompt text)."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline._json import json_body
from pipeline.errors import FailureKind, ProviderError, WireError, kind_for_status, provider_error
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    DataContent,
    FunctionResultContent,
    UsageDetails,
)

__all__ = [
    "ChatRequest",
    "UsageFields",
    "WireError",
    "cache_counted_apart",
    "caller_of",
    "chat_response_format",
    "data_url",
    "dumps",
    "enum_value",
    "error_from_payload",
    "int_or_none",
    "integer",
    "invalid",
    "malformed",
    "number",
    "parse_arguments",
    "put",
    "read_usage",
    "request_object",
    "str_or_none",
    "tool_result_text",
    "unsupported_parameter",
    "user_of",
]

dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""JSON as the codecs write it: compact, and text as it is (no ``\\u`` escapes)."""


def malformed(provider: str, what: str) -> ProviderError:
    """A provider sent something that is not the wire format."""
    return provider_error(
        FailureKind.UNKNOWN, f"malformed response: {what}", provider=provider, code="malformed"
    )


def int_or_none(value: Any) -> int | None:
    # What JSON decodes to (an int, or nothing) first: every usage count of every response
    # comes through here.
    if type(value) is int:
        return value
    if value is None:
        return None
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


# -- content and formats ----------------------------------------------------------------------


def data_url(content: DataContent) -> str:
    """`content` as a URL: its own, or a ``data:`` URL of its bytes."""
    if content.uri is not None:
        return content.uri
    encoded = base64.b64encode(content.data or b"").decode("ascii")
    return f"data:{content.media_type or 'application/octet-stream'};base64,{encoded}"


def chat_response_format(value: Any) -> Any:
    """`ChatOptions.response_format` as a Chat Completions ``response_format``."""
    if value in ("json", "json_object"):
        return {"type": "json_object"}
    if value == "text":
        return {"type": "text"}
    if isinstance(value, Mapping) and "type" not in value and "schema" in value:
        # A bare {"name":..., "schema":...} is shorthand for a JSON-schema format.
        return {"type": "json_schema", "json_schema": dict(value)}
    return value


# -- usage ------------------------------------------------------------------------------------

UsageFields = Mapping[str, tuple[str, ...]]
"""Where an API's usage object keeps each count: a `UsageDetails` field -> its path of keys
(``("prompt_tokens_details", "cached_tokens")``). Each API's `vocab` has one, read by
`read_usage` and written by its inbound codec with `put`."""


_new_object = object.__new__
_USAGE_SLOTS = tuple(
    (count.name, UsageDetails.__dict__[count.name].__set__)
    for count in dataclasses.fields(UsageDetails)
)


def read_usage(value: Any, fields: UsageFields) -> UsageDetails | None:
    """The usage an object says, each count read where `fields` puts it (a count that is
    not an integer is unknown); None when `value` is not an object."""
    # Every answer has usage, and this was half of a whole answer's parse: decoded JSON holds
    # plain dicts and ints, whose exact types are checked before the Mapping ABC's check,
    # and the counts go straight into the slots of a frozen dataclass of counts only.
    if type(value) is not dict and not isinstance(value, Mapping):
        return None
    usage: UsageDetails = _new_object(UsageDetails)
    for name, set_count in _USAGE_SLOTS:
        found: Any = value
        for key in fields.get(name, ()):  # a count the format does not have stays unknown
            if type(found) is not dict and not isinstance(found, Mapping):
                found = None
                break
            found = found.get(key)
        set_count(usage, int_or_none(found))
    return usage


def put(body: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set `value` at `path` in `body`, making the objects on the way."""
    for key in path[:-1]:
        body = body.setdefault(key, {})
    body[path[-1]] = value


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


# -- requests in (the inbound codecs) ---------------------------------------------------------


@dataclass(slots=True)
class ChatRequest:
    """A parsed request: what to ask the pipeline and how to answer."""

    model: str
    messages: list[ChatMessage]
    options: ChatOptions
    stream: bool = False
    include_usage: bool = False
    tool_names: frozenset[str] = field(default_factory=frozenset)
    builtin_tools: list[str] = field(default_factory=list)
    """The types of the provider-side tools the request offered, left out of the pipeline's
    tools (see `pipeline.gateway._builtin_tools`)."""
    user: str | None = None
    """The end user the request names (``user`` or ``safety_identifier``; Anthropic's
    ``metadata.user_id``), for a response cache partitioned by user; None when it names
    none."""
    caller: dict[str, str] | None = None
    """What the body says of its caller, for the spend ledger's attribution (`caller_of`)."""
    body: dict[str, Any] | None = None
    """The body's JSON object as it came (a Chat Completions one: the forwarded path's)."""
    plain_messages: bool = False
    """Every message of `body` is of the plain shape (a ``role`` of system, user or
    assistant and a non-empty string ``content``, nothing else), which the forwarded path
    sends as it came without looking at each again; False says nothing either way."""


def user_of(payload: Mapping[str, Any]) -> str | None:
    """The end user an OpenAI-format body names: ``user``, else ``safety_identifier``."""
    for name in ("user", "safety_identifier"):
        value = payload.get(name)
        if isinstance(value, str) and value:
            return value
    return None


_CALLER_KEYS = frozenset({"user", "user_id", "team", "tags", "session", "session_id"})


def caller_of(payload: dict[str, Any]) -> dict[str, str] | None:
    """The body's ``user`` and the attribution keys of its ``metadata`` (``user``,
    ``user_id``, ``team``, ``tags``, ``session``, ``session_id``), string values only, each
    cut to 256 characters: whose request it says it is (never anything else of the body)."""
    found: dict[str, str] = {}
    metadata = payload.get("metadata")
    if isinstance(metadata, dict):
        for key in _CALLER_KEYS:
            value = metadata.get(key)
            if isinstance(value, str) and value:
                found[key] = value[:256]
    user = payload.get("user")
    if isinstance(user, str) and user:
        found["user"] = user[:256]
    return found or None


def invalid(param: str, what: str, code: str | None = "invalid_value") -> WireError:
    """A 400 naming the request field `param` and what is wrong with it (never its value)."""
    return WireError(400, f"{param}: {what}", param=param, code=code)


def number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    """The number `body[key]` holds, from `low` to `high`; None when absent."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(key, "expected a number")
    if not low <= value <= high:
        raise invalid(key, f"expected a number from {low:g} to {high:g}")
    return float(value)


def enum_value(value: Any, param: str) -> str | None:
    """The value of a vendor's enum: any string (the enum is open), or None; `WireError`
    naming `param` for another type."""
    if value is not None and not isinstance(value, str):
        raise invalid(param, "expected a string")
    return value


def integer(body: Mapping[str, Any], key: str, low: int) -> int | None:
    """The integer `body[key]` holds, at least `low`; None when absent."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(key, "expected an integer")
    if value < low:
        raise invalid(key, f"expected an integer of at least {low}")
    return value


def request_object(body: bytes) -> dict[str, Any]:
    """The JSON object a request body is, or a 400 ``invalid_json`` saying why not."""
    try:
        payload = json_body(body)
    except ValueError as exc:  # not JSON in UTF-8, or nested deeper than the bound
        raise WireError(400, str(exc), code="invalid_json") from None
    if not isinstance(payload, dict):
        raise WireError(400, "the request body must be a JSON object", code="invalid_json")
    return payload


def unsupported_parameter(param: str) -> WireError:
    """The 400 of a request parameter this gateway does not know."""
    return WireError(
        400,
        f"{param}: this parameter is not supported by this gateway",
        param=param,
        code="unsupported_parameter",
    )
