"""One package per wire API (`chat_completions`, `responses`, `messages`, `gemini`,
`bedrock`), each with its vocabulary, its outbound codec (what providers use) and, when the
gateway serves the API, its inbound codec; `sse` frames server-sent events both ways and
`tools` is the typed tool boundary. This package re-exports what providers and the gateway
share of the private `_common`: the wire error, the malformed-answer error, field readers."""

from __future__ import annotations

from pipeline.wire._common import (
    ChatRequest,
    WireError,
    caller_of,
    dumps,
    enum_value,
    error_from_payload,
    malformed,
    request_object,
    unsupported_parameter,
    user_of,
)

__all__ = [
    "ChatRequest",
    "WireError",
    "caller_of",
    "dumps",
    "enum_value",
    "error_from_payload",
    "malformed",
    "request_object",
    "unsupported_parameter",
    "user_of",
]
