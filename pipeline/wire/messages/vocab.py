"""The Messages API's words and what they mean, each table written once and read both ways
(the providers write requests with it, the gateway reads them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.types import FinishReason, ToolChoice

__all__ = [
    "API",
    "EFFORTS",
    "EFFORT_ALIASES",
    "EFFORT_OF",
    "KEPT_STOP_REASONS",
    "MAX_CACHE_BREAKPOINTS",
    "STOP_REASONS",
    "TOOL_CHOICES",
    "TOOL_CHOICE_VALUES",
    "USAGE_FIELDS",
    "read_tool_choice",
    "tool_choice",
]

API = "messages"
"""This API's name (`RawTool.api`, the key of its fields in `FunctionTool`)."""

TOOL_CHOICES: dict[str, ToolChoice] = {
    "auto": ToolChoice.AUTO,
    "none": ToolChoice.NONE,
    "any": ToolChoice.REQUIRED,
}
"""The ``tool_choice`` types; a named tool is ``{"type": "tool", "name": ...}``."""

TOOL_CHOICE_VALUES: dict[ToolChoice, str] = {
    choice: value for value, choice in TOOL_CHOICES.items()
}


def tool_choice(choice: ToolChoice) -> dict[str, Any]:
    """`choice` as a ``tool_choice``."""
    if choice.name is not None:
        return {"type": "tool", "name": choice.name}
    return {"type": TOOL_CHOICE_VALUES[choice]}


def read_tool_choice(value: Any) -> ToolChoice | None:
    """The choice a ``tool_choice`` says, or None when it is none of this API's."""
    if not isinstance(value, Mapping):
        return None
    kind = value.get("type")
    if kind == "tool":
        name = value.get("name")
        return ToolChoice.named(name) if isinstance(name, str) and name else None
    return TOOL_CHOICES.get(kind) if isinstance(kind, str) else None


STOP_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
    FinishReason.CONTENT_FILTER: "refusal",
}
"""The stop reason each finish reason is. Read back, a stop reason is its finish reason
through `FinishReason.of` (``stop_sequence`` and ``end_turn`` are both `FinishReason.STOP`)."""
KEPT_STOP_REASONS = frozenset({*STOP_REASONS.values(), "stop_sequence", "pause_turn"})
"""Stop reasons the gateway passes on as they came (no finish reason keeps ``stop_sequence``
or ``pause_turn`` apart from ``end_turn``)."""

EFFORTS: dict[str, str] = {"low": "low", "medium": "medium", "high": "high", "xhigh": "max"}
"""Each reasoning effort (`ReasoningOptions.effort`) this API has -> its
``output_config.effort``; ``none`` is thinking ``disabled``."""
EFFORT_OF: dict[str, str] = {wire: effort for effort, wire in EFFORTS.items()} | {"xhigh": "xhigh"}
"""``output_config.effort`` -> the reasoning effort it is (``xhigh``, the other APIs' word for
``max``, is taken as it is)."""
EFFORT_ALIASES: dict[str, str] = {"minimal": "low"}
"""Efforts below this API's lowest, sent as that one."""

USAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "input_tokens": ("input_tokens",),
    "cache_write_tokens": ("cache_creation_input_tokens",),
    "cache_read_tokens": ("cache_read_input_tokens",),
    "output_tokens": ("output_tokens",),
    "reasoning_tokens": ("output_tokens_details", "thinking_tokens"),
}
"""Where ``usage`` keeps each `UsageDetails` count (`pipeline.wire._common.UsageFields`), in
the order the API writes them. Its ``input_tokens`` leave out the prompt cache's reads and
writes, which `UsageDetails.input_tokens` include."""

MAX_CACHE_BREAKPOINTS = 4
"""The most blocks with ``cache_control`` one request may have (the API refuses more), a
top-level ``cache_control`` (automatic caching) included."""
