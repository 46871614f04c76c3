"""The Messages API's words and what they mean, each table written once and read both ways
(the providers write requests with it, the gateway reads them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.types import ToolChoice

__all__ = ["API", "TOOL_CHOICES", "TOOL_CHOICE_VALUES", "read_tool_choice", "tool_choice"]

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
