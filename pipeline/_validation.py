"""Checking a response's shape: the one implementation behind the response-validation
layer (`middleware.response_validation`) and the eval runner (`pipeline.evals`).

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import pydantic
import pydantic_core

from pipeline.errors import ResponseValidationError
from pipeline.types import ChatResponse

__all__ = ["MAX_PROBLEMS", "ShapeCheck", "strip_fence"]

MAX_PROBLEMS = 20  # problems kept on an error; the message lists the first few
_LISTED = 5

_FENCE = re.compile(r"\A\s*```[\w+.-]*[ \t]*\r?\n(.*?)\r?\n?[ \t]*```\s*\Z", re.DOTALL)


def strip_fence(text: str) -> str:
    """The contents of `text` when it is exactly one markdown code fence, else `text`."""
    if "```" not in text:
        return text
    match = _FENCE.match(text)
    return match.group(1) if match is not None else text


def _location(parts: Iterable[int | str], known: frozenset[str]) -> str:
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            name = part if part in known else "*"
            path += f".{name}" if path else name
    return path or "$"


def _model_names(model: type[pydantic.BaseModel]) -> frozenset[str]:
    """Every field name and alias of `model` and of the models its fields hold."""
    names: set[str] = set()
    seen: set[type[Any]] = set()

    def visit(annotation: Any, depth: int) -> None:
        if depth > 32:  # bounded: annotations can be deeply (but never infinitely) nested
            return
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            if annotation in seen:
                return
            seen.add(annotation)
            for name, info in annotation.model_fields.items():
                names.add(name)
                for alias in (info.alias, info.validation_alias):
                    if isinstance(alias, str):
                        names.add(alias)
                visit(info.annotation, depth + 1)
            return
        for argument in typing.get_args(annotation):
            visit(argument, depth + 1)

    visit(model, 0)
    return frozenset(names)


def _schema_names(schema: Any) -> frozenset[str]:
    """Every property name a JSON schema declares (in ``properties`` or ``required``)."""
    names: set[str] = set()
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:  # bounded by the size of the schema
        node, depth = stack.pop()
        if depth > 64:
            continue
        if isinstance(node, Mapping):
            properties = node.get("properties")
            if isinstance(properties, Mapping):
                names.update(str(key) for key in properties)
            required = node.get("required")
            if isinstance(required, list):
                names.update(str(key) for key in required)
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
    return frozenset(names)


def _summary(problems: Sequence[tuple[str, str]]) -> str:
    listed = "; ".join(f"{where}: {what}" for where, what in problems[:_LISTED])
    more = len(problems) - _LISTED
    if more > 0:
        listed += f"; and {more} more"
    count = f"{len(problems)} problem" + ("" if len(problems) == 1 else "s")
    return f"{count} ({listed})"


class ShapeCheck:
    """A validator made ready once (see the module docstring).

    Calling it with a response returns the value, or an awaitable of it for a callable that
    returned one (`may_await` says whether that can happen); it raises
    `ResponseValidationError` when the response is invalid. `name` describes the validator
    in messages (a model's class name, ``JSON schema``, a callable's name).
    """

    __slots__ = (
        "_check",
        "_known",
        "_schema_problems",
        "_validate_json",
        "may_await",
        "name",
        "strip_fences",
    )

    def __init__(self, validator: Any, *, strip_fences: bool = False) -> None:
        if not isinstance(strip_fences, bool):
            raise TypeError("strip_fences must be true or false")
        self.strip_fences = strip_fences
        self.may_await = False
        self._validate_json: Callable[[str], Any] | None = None
        self._schema_problems: Callable[[Any], list[tuple[str, str]]] | None = None
        self._known: frozenset[str] = frozenset()
        if isinstance(validator, type) and issubclass(validator, pydantic.BaseModel):
            self.name = validator.__name__
            self._known = _model_names(validator)
            self._validate_json = validator.model_validate_json
            self._check: Callable[[ChatResponse], Any] = self._check_model
        elif isinstance(validator, Mapping):
            self.name = "JSON schema"
            self._known = _schema_names(validator)
            self._schema_problems = _schema_validator(validator)
            self._check = self._check_schema
        elif isinstance(validator, type):
            raise TypeError(
                f"validator {validator.__name__} is a class but not a pydantic model: give a "
                "pydantic BaseModel subclass, a JSON schema (a dict) or a callable taking "
                "the ChatResponse"
            )
        elif callable(validator):
            self.name = getattr(validator, "__qualname__", None) or type(validator).__name__
            self.may_await = True
            self._check = self._calling(validator)
        else:
            raise TypeError(
                "validator must be a pydantic model class, a JSON schema (a dict) or a "
                f"callable taking the ChatResponse, not {type(validator).__name__}"
            )

    def __call__(self, response: ChatResponse) -> Any:
        return self._check(response)

    def _text(self, response: ChatResponse) -> str:
        text = response.text
        return strip_fence(text) if self.strip_fences else text

    def _fail(self, problems: Sequence[tuple[str, str]], what: str) -> ResponseValidationError:
        return ResponseValidationError(f"{what}: {_summary(problems)}", problems=problems)

    def _check_model(self, response: ChatResponse) -> Any:
        assert self._validate_json is not None
        try:
            return self._validate_json(self._text(response))
        except pydantic.ValidationError as exc:
            problems = [
                (_location(error["loc"], self._known), error["type"])
                for error in exc.errors(
                    include_url=False, include_context=False, include_input=False
                )[:MAX_PROBLEMS]
            ]
        raise self._fail(problems, f"response is not a valid {self.name}") from None

    def _check_schema(self, response: ChatResponse) -> Any:
        assert self._schema_problems is not None
        try:
            instance = pydantic_core.from_json(self._text(response), allow_inf_nan=False)
        except ValueError:
            problems = [("$", "json_invalid")]
        else:
            problems = self._schema_problems(instance)
            if not problems:
                return instance
        raise self._fail(problems, "response does not match the JSON schema") from None

    def _calling(self, check: Callable[[ChatResponse], Any]) -> Callable[[ChatResponse], Any]:
        def run(response: ChatResponse) -> Any:
            try:
                value = check(response)
            except ResponseValidationError:
                raise
            except Exception as exc:
                # Not chained: the check's own message may quote the response.
                raise self._rejected(exc) from None
            if inspect.isawaitable(value):
                return self._awaiting(value)
            return value

        return run

    async def _awaiting(self, pending: Awaitable[Any]) -> Any:
        try:
            return await pending
        except ResponseValidationError:
            raise
        except Exception as exc:
            raise self._rejected(exc) from None

    def _rejected(self, exc: Exception) -> ResponseValidationError:
        problems = [("$", type(exc).__name__)]
        return ResponseValidationError(
            f"response rejected by {self.name} ({type(exc).__name__})", problems=problems
        )


def _refuse_retrieval(uri: str) -> Any:
    # A response check never reaches the network or the file system.
    raise ValueError("references are resolved only within the schema")


def _schema_validator(schema: Mapping[str, Any]) -> Callable[[Any], list[tuple[str, str]]]:
    """A function returning the problems of an instance under `schema` (empty when valid)."""
    try:
        import jsonschema_rs
    except ImportError:
        raise ImportError(
            "a JSON schema validator needs the jsonschema-rs package: "
            "pip install 'chat-pipeline[jsonschema]'"
        ) from None
    try:
        checker = jsonschema_rs.validator_for(dict(schema), retriever=_refuse_retrieval)
    except jsonschema_rs.ValidationError as exc:
        if type(exc.kind).__name__ == "Referencing":
            raise ValueError(
                "invalid JSON schema: a $ref points outside the schema (references are "
                "resolved only within it)"
            ) from None
        where = "/".join(str(part) for part in exc.instance_path) or "the top level"
        keyword = exc.schema_path[-1] if exc.schema_path else "schema"
        raise ValueError(f"invalid JSON schema: at {where}, the {keyword!r} rule fails") from None
    except (TypeError, ValueError):
        raise ValueError("invalid JSON schema: it must hold only JSON values") from None
    known = _schema_names(schema)

    def problems(instance: Any) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        for error in checker.iter_errors(instance):
            path = list(error.instance_path)
            keyword = str(error.schema_path[-1]) if error.schema_path else "schema"
            missing = getattr(error.kind, "property", None)
            if keyword == "required" and isinstance(missing, str):
                # The missing name comes from the schema, never from the response.
                path.append(missing)
            found.append((_location(path, known), keyword))
            if len(found) >= MAX_PROBLEMS:
                break
        return found

    return problems
