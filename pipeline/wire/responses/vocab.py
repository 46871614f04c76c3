"""The Responses API's words and what they mean, each table written once and read both ways
(the providers write requests with it, the gateway reads them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.types import FinishReason, ToolChoice

__all__ = [
    "API",
    "ENCRYPTED_REASONING",
    "END_EVENTS",
    "INCOMPLETE_REASONS",
    "INCOMPLETE_REASON_OF",
    "TOOL_CHOICES",
    "TOOL_CHOICE_VALUES",
    "USAGE_FIELDS",
    "read_tool_choice",
    "tool_choice",
]

API = "responses"
"""This API's name (`RawTool.api`, the key of its fields in `FunctionTool`)."""

TOOL_CHOICES: dict[str, ToolChoice] = {
    "auto": ToolChoice.AUTO,
    "none": ToolChoice.NONE,
    "required": ToolChoice.REQUIRED,
}
"""The ``tool_choice`` strings; a named tool is ``{"type": "function", "name": ...}``
(``"custom"`` for a custom tool)."""

TOOL_CHOICE_VALUES: dict[ToolChoice, str] = {
    choice: value for value, choice in TOOL_CHOICES.items()
}

_NAMED_TYPES = frozenset({"function", "custom"})


def tool_choice(choice: ToolChoice, custom_tools: frozenset[str] = frozenset()) -> Any:
    """`choice` as a ``tool_choice`` (`custom_tools`: the names of the custom tools, which
    a named choice calls by their own type)."""
    if choice.name is not None:
        kind = "custom" if choice.name in custom_tools else "function"
        return {"type": kind, "name": choice.name}
    return TOOL_CHOICE_VALUES[choice]


def read_tool_choice(value: Any) -> ToolChoice | None:
    """The choice a ``tool_choice`` says (a function or custom tool by name), or None when
    it is none of these (a built-in tool's, or not this API's)."""
    if isinstance(value, str):
        return TOOL_CHOICES.get(value)
    kind = value.get("type") if isinstance(value, Mapping) else None
    if not isinstance(kind, str) or kind not in _NAMED_TYPES:
        return None
    name = value.get("name")
    return ToolChoice.named(name) if isinstance(name, str) and name else None


ENCRYPTED_REASONING = "reasoning.encrypted_content"
"""The ``include`` value that asks for reasoning items' ``encrypted_content``."""

END_EVENTS = frozenset({"response.completed", "response.incomplete"})
"""The events that end a complete stream (both carry the response with its usage)."""

INCOMPLETE_REASONS: dict[str, FinishReason] = {
    "max_output_tokens": FinishReason.LENGTH,
    "content_filter": FinishReason.CONTENT_FILTER,
}
"""An incomplete response's ``incomplete_details.reason`` -> the finish reason it is."""
INCOMPLETE_REASON_OF: dict[FinishReason, str] = {v: k for k, v in INCOMPLETE_REASONS.items()}

USAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "input_tokens": ("input_tokens",),
    "cache_read_tokens": ("input_tokens_details", "cached_tokens"),
    "cache_write_tokens": ("input_tokens_details", "cache_write_tokens"),
    "output_tokens": ("output_tokens",),
    "reasoning_tokens": ("output_tokens_details", "reasoning_tokens"),
    "total_tokens": ("total_tokens",),
}
"""Where ``usage`` keeps each `UsageDetails` count (`pipeline.wire._common.UsageFields`), in
the order the API writes them."""
