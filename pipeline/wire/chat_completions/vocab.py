"""Chat Completions' words and what they mean, each table written once and read both ways
(the providers write requests with it, the gateway reads them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.types import ToolChoice

__all__ = [
    "API",
    "MAX_TOKENS_FIELDS",
    "REASONING_FIELDS",
    "TOOL_CHOICES",
    "TOOL_CHOICE_VALUES",
    "USAGE_FIELDS",
    "read_tool_choice",
    "tool_choice",
]

API = "chat_completions"
"""This API's name (`RawTool.api`, the key of its fields in `FunctionTool`)."""

TOOL_CHOICES: dict[str, ToolChoice] = {
    "auto": ToolChoice.AUTO,
    "none": ToolChoice.NONE,
    "required": ToolChoice.REQUIRED,
}
"""The ``tool_choice`` strings; a named tool is ``{"type": "function", "function":
{"name": ...}}``."""

TOOL_CHOICE_VALUES: dict[ToolChoice, str] = {
    choice: value for value, choice in TOOL_CHOICES.items()
}


def tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    """`choice` as a ``tool_choice``."""
    if choice.name is not None:
        return {"type": "function", "function": {"name": choice.name}}
    return TOOL_CHOICE_VALUES[choice]


def read_tool_choice(value: Any) -> ToolChoice | None:
    """The choice a ``tool_choice`` says, or None when it is none of this API's."""
    if isinstance(value, str):
        return TOOL_CHOICES.get(value)
    function = value.get("function") if isinstance(value, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    return ToolChoice.named(name) if isinstance(name, str) and name else None


MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens")
"""Where a request says how many tokens to generate: OpenAI's current field, then the older
one that many compatible servers (llama.cpp, vLLM, Ollama, Azure's older API versions) read."""

REASONING_FIELDS = ("reasoning_content", "reasoning")
"""Where servers put a message's (or a delta's) reasoning text: DeepSeek and vLLM, then
OpenRouter and Ollama. The gateway writes the first."""

USAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "input_tokens": ("prompt_tokens",),
    "output_tokens": ("completion_tokens",),
    "total_tokens": ("total_tokens",),
    "cache_read_tokens": ("prompt_tokens_details", "cached_tokens"),
    "cache_write_tokens": ("prompt_tokens_details", "cache_write_tokens"),
    "reasoning_tokens": ("completion_tokens_details", "reasoning_tokens"),
}
"""Where ``usage`` keeps each `UsageDetails` count (`pipeline.wire._common.UsageFields`)."""
