"""The Gemini API's vocabulary: each table once, its inverse derived where it has one."""

from __future__ import annotations

from typing import Any

from pipeline.types import ChatRole, FinishReason, ToolChoice

__all__ = [
    "API",
    "EFFORT_ALIASES",
    "EFFORT_OF",
    "FILTERED_REASONS",
    "FINISH_REASONS",
    "GENERATION_EXTRAS",
    "NO_THINKING_EFFORT",
    "ROLES",
    "ROLE_OF",
    "THINKING_LEVELS",
    "THOUGHT_SIGNATURE_PLACEHOLDER",
    "TOOL_CHOICES",
    "TOOL_CHOICE_VALUES",
    "UNSENT_EXTRAS",
    "tool_config",
]

API = "gemini"
"""This API's name (`RawTool.api`, the key of its fields in `FunctionTool`)."""

ROLES: dict[ChatRole, str] = {ChatRole.USER: "user", ChatRole.ASSISTANT: "model"}
"""A content's ``role`` for each of our roles that has one: system messages are the
``systemInstruction``, tool results go back in a ``user`` content."""
ROLE_OF: dict[str, ChatRole] = {wire: role for role, wire in ROLES.items()}

TOOL_CHOICES: dict[str, ToolChoice] = {
    "AUTO": ToolChoice.AUTO,
    "NONE": ToolChoice.NONE,
    "ANY": ToolChoice.REQUIRED,
}
"""``toolConfig.functionCallingConfig.mode`` and the choice it is (a named tool is ``ANY``
with that one name in ``allowedFunctionNames``)."""
TOOL_CHOICE_VALUES: dict[ToolChoice, str] = {choice: mode for mode, choice in TOOL_CHOICES.items()}


def tool_config(choice: ToolChoice) -> dict[str, Any]:
    """`choice` as a ``toolConfig``."""
    if choice.name is not None:
        named = {"mode": TOOL_CHOICE_VALUES[ToolChoice.REQUIRED]}
        return {"functionCallingConfig": {**named, "allowedFunctionNames": [choice.name]}}
    return {"functionCallingConfig": {"mode": TOOL_CHOICE_VALUES[choice]}}


FILTERED_REASONS = frozenset(
    {
        "SAFETY",
        "RECITATION",
        "BLOCKLIST",
        "PROHIBITED_CONTENT",
        "SPII",
        "IMAGE_SAFETY",
        "IMAGE_PROHIBITED_CONTENT",
        "IMAGE_RECITATION",
    }
)
"""The candidate ``finishReason``s that say a filter stopped the answer."""

FINISH_REASONS: dict[str, FinishReason] = {
    "STOP": FinishReason.STOP,
    "MAX_TOKENS": FinishReason.LENGTH,
    **dict.fromkeys(sorted(FILTERED_REASONS), FinishReason.CONTENT_FILTER),
}
"""The finish reason each ``finishReason`` of known meaning is (``STOP`` with function calls
is `FinishReason.TOOL_CALLS`: the API has no reason of its own for it). Many reasons share
one finish reason, so the table has no inverse."""

THINKING_LEVELS: dict[str, str] = {
    "minimal": "MINIMAL",
    "low": "LOW",
    "medium": "MEDIUM",
    "high": "HIGH",
}
"""``thinkingConfig.thinkingLevel`` for each reasoning effort it has (other efforts are sent
as they are: the API's enum is open)."""
EFFORT_OF: dict[str, str] = {wire: effort for effort, wire in THINKING_LEVELS.items()}
EFFORT_ALIASES: dict[str, str] = {"xhigh": "high", "max": "high"}
"""Efforts above the API's highest level, as that level."""
NO_THINKING_EFFORT = "none"
"""The effort that turns thinking off: ``thinkingBudget`` 0."""

GENERATION_EXTRAS: dict[str, str] = {
    "top_k": "topK",
    "presence_penalty": "presencePenalty",
    "frequency_penalty": "frequencyPenalty",
}
"""Other APIs' sampling fields (in `ChatOptions.additional_properties`) that are
``generationConfig`` fields here."""

UNSENT_EXTRAS = frozenset({"parallel_tool_calls", "verbosity", "logit_bias"})
"""OpenAI fields the gateway passes on in `ChatOptions.additional_properties` that this API
has no field for: left out, since it refuses a request naming a field it does not know."""

THOUGHT_SIGNATURE_PLACEHOLDER = "skip_thought_signature_validator"
"""The signature Google documents for a function call the model did not make with one (a
conversation from another API or route): Gemini 3 refuses a turn's function call without a
signature."""
