"""The typed tool boundary every wire API shares: the core's tool types (re-exported here),
what a codec reads of a tool definition, and the one reader of the untyped tool mappings
older callers pass in `ChatOptions.tools`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard, cast

from pipeline.types import (
    ChatTool,
    CustomTool,
    FunctionTool,
    RawTool,
    ToolChoice,
    ToolDefinition,
    as_tool_choice,
)
from pipeline.wire.chat_completions.vocab import API as CHAT_COMPLETIONS
from pipeline.wire.messages.vocab import API as MESSAGES
from pipeline.wire.responses.vocab import API as RESPONSES

__all__ = [
    "ChatTool",
    "CustomTool",
    "FunctionTool",
    "RawTool",
    "ToolChoice",
    "ToolDefinition",
    "as_tool",
    "as_tool_choice",
    "custom_tool_names",
    "function_definition",
    "openai_function_fields",
    "raw_body",
]


def function_definition(
    tool: ToolDefinition, api: str, schema_key: str, *, kind: str | None = None
) -> dict[str, Any]:
    """`tool` as the API called `api` declares a function: ``{"type": kind, "name",
    "description", <schema_key>: parameters}`` (no type without a `kind`, no description
    when it has none), then the fields only that API has (a `FunctionTool`'s), never
    replacing those. Any object with a `name`, a `description` and `parameters` (or
    `json_schema`) is a tool; one without a name is a `TypeError`."""
    name: Any
    description: Any
    parameters: Any
    fields: Mapping[str, Any] | None = None
    if type(tool) is FunctionTool:  # the usual one, read directly
        name, description, parameters = tool.name, tool.description, tool.parameters
        fields = tool.additional_properties.get(api)
    else:
        name = getattr(tool, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"tools must be tool definitions or RawTools, not {type(tool).__name__}"
            )
        description = getattr(tool, "description", None)
        parameters = getattr(tool, "parameters", None) or getattr(tool, "json_schema", None)
    definition: dict[str, Any] = {"name": name} if kind is None else {"type": kind, "name": name}
    if description and isinstance(description, str):
        definition["description"] = description
    definition[schema_key] = (
        dict(parameters) if parameters else {"type": "object", "properties": {}}
    )
    if fields:
        for key, value in fields.items():
            definition.setdefault(key, value)
    return definition


def raw_body(tool: RawTool, api: str) -> dict[str, Any]:
    """A raw tool's body, for a route speaking `api`; `ValueError` when the tool is another
    API's (the request cannot be sent without changing what it asks)."""
    if tool.api != api:
        raise ValueError(f"a tool in the {tool.api} API's own shape cannot be sent to {api}")
    return dict(tool.body)


def openai_function_fields(fields: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """A function's fields besides its name, description and parameters (``strict``...),
    as `FunctionTool.additional_properties`: Chat Completions' function object and a
    Responses function tool take the same fields, so both APIs' routes send them."""
    return {CHAT_COMPLETIONS: fields, RESPONSES: fields} if fields else {}


_TYPED = frozenset({FunctionTool, CustomTool, RawTool})
_FUNCTION_FIELDS = frozenset({"type", "name", "description", "parameters"})
_MESSAGES_FIELDS = frozenset({"type", "name", "description", "input_schema"})


def _name(spec: Mapping[str, Any]) -> str:
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise TypeError("a tool mapping needs a non-empty name")
    return name


def _read(tool: Mapping[str, Any]) -> ToolDefinition | None:
    """The tool a mapping in a provider's shape describes, or None for another shape."""
    kind = tool.get("type")
    function = tool.get("function")
    if kind == "function" and isinstance(function, Mapping):  # Chat Completions
        return FunctionTool(
            _name(function),
            function.get("description"),
            function.get("parameters") or {"type": "object", "properties": {}},
            openai_function_fields(
                {k: v for k, v in function.items() if k not in _FUNCTION_FIELDS}
            ),
        )
    if kind == "custom":
        spec = tool.get("custom", tool)  # Chat Completions nests it; Responses does not
        if isinstance(spec, Mapping) and "input_schema" not in spec:
            return CustomTool(_name(spec), spec.get("description"), spec.get("format"))
    if "input_schema" in tool and kind in (None, "custom"):  # Messages
        fields = {k: v for k, v in tool.items() if k not in _MESSAGES_FIELDS}
        return FunctionTool(
            _name(tool),
            tool.get("description"),
            tool["input_schema"],
            {MESSAGES: fields} if fields else {},
        )
    if kind == "function" and "name" in tool:  # Responses
        return FunctionTool(
            _name(tool),
            tool.get("description"),
            tool.get("parameters") or {"type": "object", "properties": {}},
            openai_function_fields({k: v for k, v in tool.items() if k not in _FUNCTION_FIELDS}),
        )
    return None


def as_tool(tool: object, api: str) -> ToolDefinition | RawTool:
    """A tool of `ChatOptions.tools`, for a route speaking `api`, as the typed tool it is: a
    `RawTool` or a tool definition as it is. A mapping (the deprecated untyped form, with a
    `DeprecationWarning`) in a provider's shape is the function or custom tool it describes;
    one of no shape known here is taken, as it always was, for a tool in `api`'s own shape
    (say so with a `RawTool`, which no route of another API sends)."""
    if not _untyped(tool):
        return cast("ToolDefinition | RawTool", tool)  # a definition: checked where it is read
    warnings.warn(
        "tools as mappings are deprecated: use FunctionTool, CustomTool or RawTool",
        DeprecationWarning,
        stacklevel=2,
    )
    read = _read(tool)
    return RawTool(api, tool) if read is None else read


def custom_tool_names(tools: Iterable[object] | None) -> frozenset[str]:
    """The names of the custom tools among `tools` (`CustomTool`s, and custom tools in a
    provider's shape), whose calls a codec reads back as custom calls."""
    names: set[str] = set()
    for tool in tools or ():
        if _untyped(tool):
            try:
                tool = _read(tool)
            except (TypeError, ValueError):
                continue  # the request's encoding refuses it
        if type(tool) is CustomTool:
            names.add(tool.name)
    return frozenset(names)


def _untyped(tool: object) -> TypeGuard[Mapping[str, Any]]:
    """Whether a tool is a mapping (the deprecated untyped form): told cheaply, since tool
    definitions have a name and mappings none (a per-request check, for every tool)."""
    kind = type(tool)
    if kind is dict:
        return True
    if kind in _TYPED or hasattr(tool, "name"):
        return False
    return isinstance(tool, Mapping)
