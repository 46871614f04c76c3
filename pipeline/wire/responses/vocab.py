"""The Responses API's words and what they mean, each table written once and read both ways
(the providers write requests with it, the gateway reads them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.types import ToolChoice

__all__ = ["API", "TOOL_CHOICES", "TOOL_CHOICE_VALUES", "read_tool_choice", "tool_choice"]

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
