"""Bedrock Converse's vocabulary: each table written once, its inverse derived.

Pure data, importing only the core. `pipeline.wire.bedrock.outbound` reads it; a value a
table does not hold passes as it came (a vendor's enum is open).
"""

from __future__ import annotations

from typing import Any, Final

from pipeline.errors import FailureKind
from pipeline.types import BEDROCK_EXTRAS, FinishReason, ToolChoice

__all__ = [
    "API",
    "ANTHROPIC_EFFORT",
    "BEDROCK_EXTRAS",
    "CACHE_POINT",
    "CONTEXT_MESSAGES",
    "DOCUMENT_FORMATS",
    "DOCUMENT_MEDIA_TYPES",
    "ERROR_KINDS",
    "GEO_PREFIXES",
    "IMAGE_FORMATS",
    "IMAGE_MEDIA_TYPES",
    "MAX_CACHE_POINTS",
    "NOVA_EFFORT",
    "OPENAI_EFFORT",
    "STOP_REASONS",
    "STREAM_END",
    "STREAM_EXCEPTIONS",
    "STREAM_EXCEPTION_MEMBERS",
    "TOOL_CHOICES",
    "TOOL_CHOICE_VALUES",
    "finish_reason",
    "tool_choice",
]

API = "bedrock"
"""This API's name (`RawTool.api`, the key of its fields in `FunctionTool`)."""

STOP_REASONS: dict[str, FinishReason] = {
    "end_turn": FinishReason.STOP,
    "stop_sequence": FinishReason.STOP,
    "max_tokens": FinishReason.LENGTH,
    "model_context_window_exceeded": FinishReason.LENGTH,
    "tool_use": FinishReason.TOOL_CALLS,
    "guardrail_intervened": FinishReason.CONTENT_FILTER,
    "content_filtered": FinishReason.CONTENT_FILTER,
}
"""Converse ``stopReason`` -> the finish reason every client reports. The others
(``malformed_model_output``, ``malformed_tool_use``, new ones) pass as they came."""


def finish_reason(value: object) -> str | None:
    """A ``stopReason`` as a finish reason (`STOP_REASONS`; an unknown one as it came)."""
    if not isinstance(value, str):
        return None
    return STOP_REASONS.get(value) or value


TOOL_CHOICES: dict[str, ToolChoice] = {"auto": ToolChoice.AUTO, "any": ToolChoice.REQUIRED}
"""The ``toolChoice`` members and the choice each is (a named tool is ``{"tool": {"name"}}``).
`ToolChoice.NONE` has no member: no ``toolChoice`` is sent, and the tools only when the
conversation already holds tool blocks (the API refuses those without a ``toolConfig``)."""
TOOL_CHOICE_VALUES: dict[ToolChoice, str] = {
    choice: member for member, choice in TOOL_CHOICES.items()
}


def tool_choice(choice: ToolChoice) -> dict[str, Any] | None:
    """`choice` as a ``toolChoice``; None for `ToolChoice.NONE`, which has none."""
    if choice.name is not None:
        return {"tool": {"name": choice.name}}
    member = TOOL_CHOICE_VALUES.get(choice)
    return None if member is None else {member: {}}


IMAGE_FORMATS: dict[str, str] = {
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/gif": "gif",
    "image/webp": "webp",
}
"""A media type -> the ``image.format`` it is sent as."""
IMAGE_MEDIA_TYPES: dict[str, str] = {v: k for k, v in IMAGE_FORMATS.items()}

DOCUMENT_FORMATS: dict[str, str] = {
    "application/pdf": "pdf",
    "text/csv": "csv",
    "application/msword": "doc",
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": "docx",
    "application/vnd.ms-excel": "xls",
    "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet": "xlsx",
    "text/html": "html",
    "text/plain": "txt",
    "text/markdown": "md",
}
"""A media type -> the ``document.format`` it is sent as."""
DOCUMENT_MEDIA_TYPES: dict[str, str] = {v: k for k, v in DOCUMENT_FORMATS.items()}

CACHE_POINT: Final = "cachePoint"
MAX_CACHE_POINTS: Final = 4
"""The most ``cachePoint`` blocks one request may hold (system, messages and tools
together); beyond it the earliest are left out, as the Messages API's breakpoints are."""

# -- errors -----------------------------------------------------------------------------------

ERROR_KINDS: dict[str, FailureKind] = {
    "ThrottlingException": FailureKind.RATE_LIMITED,
    # A quota of the account (tokens a day...): waiting helps, another route helps sooner.
    "ServiceQuotaExceededException": FailureKind.RATE_LIMITED,
    "ModelNotReadyException": FailureKind.TRANSIENT,
    "ServiceUnavailableException": FailureKind.TRANSIENT,
    "InternalServerException": FailureKind.TRANSIENT,
    "ModelTimeoutException": FailureKind.TRANSIENT,
    "ModelStreamErrorException": FailureKind.TRANSIENT,
    # The model failed on this request: another route may answer, the same one again
    # usually fails the same way.
    "ModelErrorException": FailureKind.UNKNOWN,
    "ValidationException": FailureKind.REQUEST_INVALID,
    "ResourceNotFoundException": FailureKind.REQUEST_INVALID,
    "AccessDeniedException": FailureKind.AUTHENTICATION,
    "UnrecognizedClientException": FailureKind.AUTHENTICATION,
    "InvalidSignatureException": FailureKind.AUTHENTICATION,
    "ExpiredTokenException": FailureKind.AUTHENTICATION,
    "IncompleteSignatureException": FailureKind.AUTHENTICATION,
    "MissingAuthenticationTokenException": FailureKind.AUTHENTICATION,
}
"""An error's type (the ``x-amzn-ErrorType`` header, or a stream's exception) -> its kind.
An error of another type is classified by its HTTP status."""

STREAM_EXCEPTION_MEMBERS: dict[str, str] = {
    "internalServerException": "InternalServerException",
    "modelStreamErrorException": "ModelStreamErrorException",
    "validationException": "ValidationException",
    "throttlingException": "ThrottlingException",
    "serviceUnavailableException": "ServiceUnavailableException",
}
"""A ConverseStream exception event's ``:exception-type`` (the union member) -> the error
type it carries."""
STREAM_EXCEPTIONS: dict[str, str] = {v: k for k, v in STREAM_EXCEPTION_MEMBERS.items()}

STREAM_END: Final = "metadata"
"""The event that ends a complete ConverseStream (after ``messageStop``: the usage)."""

CONTEXT_MESSAGES: Final = (
    "input is too long",
    "too many input tokens",
    "prompt is too long",
    "the model returned the following errors: prompt is too long",
    "the model returned the following errors: input is too long",
)
"""How a ValidationException's message starts when the prompt does not fit the model (the
start is compared, the message never copied)."""

# -- reasoning, per model family ---------------------------------------------------------------

GEO_PREFIXES: Final = ("us.", "eu.", "apac.", "jp.", "au.", "ca.", "us-gov.", "global.")
"""The prefixes of cross-region inference profiles: ``us.anthropic.claude-...`` is a Claude."""

ANTHROPIC_EFFORT: dict[str, str] = {"minimal": "low"}
"""Efforts as Converse's ``outputConfig.effort`` (``low``, ``medium``, ``high``, ``xhigh``,
``max``); others pass as they are."""
NOVA_EFFORT: dict[str, str] = {"minimal": "low", "xhigh": "high", "max": "high"}
"""Efforts as Amazon Nova's ``reasoningConfig.maxReasoningEffort`` (``low``, ``medium``,
``high``)."""
OPENAI_EFFORT: dict[str, str] = {"minimal": "low", "xhigh": "high", "max": "high"}
"""Efforts as OpenAI's open-weight models' ``reasoning_effort`` on Bedrock."""
