"""The typed tool boundary every wire API shares: the core's tool types (re-exported here),
what a codec reads of a tool definition, and the one reader of the untyped tool mappings
older callers pass in `ChatOptions.tools`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, cast

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
    "FunctionSpec",
    "FunctionTool",
    "RawTool",
    "ToolChoice",
    "ToolDefinition",
    "as_tool",
    "as_tool_choice",
    "custom_tool_names",
    "function_spec",
    "openai_function_fields",
    "raw_body",
]


class FunctionSpec(NamedTuple):
    """What one API sends of a tool definition: its name, description (None when it has
    none), JSON schema, and the fields only that API has (`FunctionTool`'s)."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    fields: Mapping[str, Any]

    def definition(self, schema_key: str) -> dict[str, Any]:
        """``{"name", "description", <schema_key>: parameters}`` (no description when it
        has none), with the API's own fields after, never replacing those."""
        definition: dict[str, Any] = {"name": self.name}
        if self.description:
            definition["description"] = self.description
        definition[schema_key] = self.parameters
        for key, value in self.fields.items():
            definition.setdefault(key, value)
        return definition


_NO_FIELDS: Mapping[str, Any] = {}


def function_spec(tool: ToolDefinition, api: str) -> FunctionSpec:
    """`tool` as the API called `api` sends it: any object with a `name`, a `description`
    and `parameters` (or `json_schema`); `TypeError` for one without a name."""
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"tools must be tool definitions or RawTools, not {type(tool).__name__}")
    parameters = getattr(tool, "parameters", None) or getattr(tool, "json_schema", None)
    description = getattr(tool, "description", None)
    fields = tool.additional_properties.get(api) if type(tool) is FunctionTool else None
    return FunctionSpec(
        name,
        description if isinstance(description, str) and description else None,
        dict(parameters) if parameters else {"type": "object", "properties": {}},
        fields or _NO_FIELDS,
    )


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
    if not isinstance(tool, Mapping):
        return cast("ToolDefinition | RawTool", tool)  # a definition: `function_spec` checks
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
        if isinstance(tool, Mapping):
            try:
                tool = _read(tool)
            except (TypeError, ValueError):
                continue  # the request's encoding refuses it
        if isinstance(tool, CustomTool):
            names.add(tool.name)
    return frozenset(names)
