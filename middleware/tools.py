"""Tools the model may call: `Tool` (name, description, JSON schema, validated invocation)
and the `tool` decorator.

Names, descriptions and JSON schemas come from the function (pydantic builds the schema
from the signature and validates the arguments before the call). Validation errors name the
fields and error types only, never the offending values (they may be user content).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, get_type_hints

import pydantic

from pipeline.errors import ToolArgumentsError

__all__ = ["Tool", "ToolArgumentsError", "tool"]


@dataclasses.dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: `name`, `description`, JSON-schema `parameters`.

    Build one with `Tool.from_function(fn)` or the `tool` decorator; calling `invoke`
    validates the arguments against the signature first.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]
    arguments_model: type[pydantic.BaseModel] = dataclasses.field(repr=False)

    @classmethod
    def from_function(
        cls,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
    ) -> Tool:
        """Name from the function, description from its docstring, schema from its signature.

        Parameters need type annotations; ``*args``/``**kwargs`` are not supported.
        """
        if not callable(function):
            raise TypeError("Tool.from_function needs a callable")
        tool_name = name or getattr(function, "__name__", None)
        if not tool_name or not isinstance(tool_name, str):
            raise ValueError("a tool needs a name")
        signature = inspect.signature(function)
        try:
            hints = get_type_hints(function)
        except Exception as exc:
            raise TypeError(f"tool {tool_name!r}: cannot resolve its type hints") from exc
        fields: dict[str, Any] = {}
        for parameter in signature.parameters.values():
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                raise TypeError(f"tool {tool_name!r}: *args and **kwargs are not supported")
            if parameter.name not in hints:
                raise TypeError(
                    f"tool {tool_name!r}: parameter {parameter.name!r} needs a type annotation"
                )
            default = ... if parameter.default is parameter.empty else parameter.default
            fields[parameter.name] = (hints[parameter.name], default)
        model = pydantic.create_model(f"{tool_name}_arguments", **fields)
        schema = model.model_json_schema()
        schema.pop("title", None)
        return cls(
            name=tool_name,
            description=(description or inspect.getdoc(function) or "").strip(),
            parameters=schema,
            function=function,
            arguments_model=model,
        )

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments for the function, or `ToolArgumentsError`."""
        try:
            parsed = self.arguments_model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            # Locations and error types only: the offending values may be user content.
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc']) or '(arguments)'}: {error['type']}"
                for error in exc.errors()
            )
            raise ToolArgumentsError(problems) from None
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}

    async def invoke(self, arguments: Mapping[str, Any]) -> Any:
        """Validate `arguments` and call the function (awaiting it when it is async)."""
        result = self.function(**self.validate(arguments))
        if inspect.isawaitable(result):
            result = await result
        return result


def tool(
    function: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
) -> Any:
    """Decorator: ``@tool`` or ``@tool(name=..., description=...)`` turns a function into a
    `Tool`."""
    if function is not None:
        return Tool.from_function(function, name=name, description=description)
    return lambda fn: Tool.from_function(fn, name=name, description=description)
