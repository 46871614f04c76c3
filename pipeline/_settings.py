"""One frozen settings class per layer, validated in one place.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Self, get_args, get_origin

import pydantic
from pydantic import ConfigDict
from pydantic.fields import FieldInfo

__all__ = ["Settings", "collecting_problems", "problems_of", "settings_error", "suggest"]

# While set, settings classes raise pydantic's own `ValidationError` (locations intact), so a
# loader validating a whole file can report every problem with its key path.
_collecting: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "chat_pipeline_collecting_problems", default=False
)


@contextlib.contextmanager
def collecting_problems() -> Iterator[None]:
    """Validate nested settings with pydantic's errors (for a loader collecting problems)."""
    token = _collecting.set(True)
    try:
        yield
    finally:
        _collecting.reset(token)


_TYPE_ERRORS = frozenset(
    {
        "int_type",
        "int_parsing",
        "int_from_float",
        "float_type",
        "float_parsing",
        "bool_type",
        "bool_parsing",
        "string_type",
        "callable_type",
        "is_instance_of",
        "list_type",
        "tuple_type",
        "set_type",
        "frozen_set_type",
        "dict_type",
        "model_type",
        "dataclass_type",
    }
)


class Settings(pydantic.BaseModel):
    """Base of every layer's settings: frozen, strict, complete, validated at construction.

    `code_only` names the fields that take code (callables, clients, providers); the TOML
    loader refuses them as settings.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        arbitrary_types_allowed=True,
        allow_inf_nan=False,
        hide_input_in_errors=True,
        # A string literal right after a field describes it: the configuration reference is
        # generated from these descriptions.
        use_attribute_docstrings=True,
    )

    code_only: ClassVar[frozenset[str]] = frozenset()

    @pydantic.model_validator(mode="before")
    @classmethod
    def _code_stays_in_code(cls, data: Any) -> Any:
        # Configuration files carry values, never code: a callable setting named in one is
        # refused by name instead of failing as "expected a callable".
        if _collecting.get() and isinstance(data, Mapping):
            code = sorted(key for key in data if key in cls.code_only)
            if code:
                raise ValueError(
                    f"{', '.join(code)}: takes code; set it in Python, not in configuration"
                )
        return data

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as exc:
            if _collecting.get():
                raise  # a configuration loader reports it with its key path
            raise settings_error(problems_of(exc, type(self))) from None

    @classmethod
    def from_options(cls, settings: Self | None, options: Mapping[str, Any]) -> Self:
        """`settings`, with `options` (field names of this class) replacing its values."""
        if settings is not None and not isinstance(settings, cls):
            raise TypeError(f"settings must be {cls.__name__}, not {type(settings).__name__}")
        if not options:
            return settings if settings is not None else cls()
        base = settings.given() if settings is not None else {}
        return cls(**{**base, **options})

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` applied, validated like a new instance."""
        return type(self)(**{**self.given(), **changes})

    def given(self) -> dict[str, Any]:
        """The values that were given (not defaulted): what a copy passes on, so a check
        about a setting given without another holds for copies too."""
        return {key: getattr(self, key) for key in self.model_fields_set}


def suggest(name: str, known: Iterable[str]) -> str:
    """``; did you mean 'x'?`` for the closest known name, or nothing."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _path(location: Sequence[int | str]) -> str:
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _unwrap(annotation: Any, discriminator: str | None = None) -> tuple[Any, str | None]:
    """`annotation` without ``Annotated`` and ``| None``, with its union's discriminator."""
    for _ in range(32):  # each step removes one layer of a finite annotation
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation, *metadata = get_args(annotation)
            for item in metadata:
                if isinstance(item, FieldInfo) and isinstance(item.discriminator, str):
                    discriminator = item.discriminator
        elif origin in (typing.Union, types.UnionType):
            members = [member for member in get_args(annotation) if member is not type(None)]
            if len(members) != 1:
                break
            annotation = members[0]
        else:
            break
    return annotation, discriminator


def _tags(union: Any, discriminator: str) -> dict[str, Any]:
    """The members of a tagged union by tag, in declaration order."""
    tagged: dict[str, Any] = {}
    for member in get_args(union):
        model, _ = _unwrap(member)
        field = getattr(model, "model_fields", {}).get(discriminator)
        if field is not None:
            for tag in get_args(field.annotation):
                tagged[str(tag)] = model
    return tagged


def _walk(
    annotation: Any, location: Sequence[int | str]
) -> tuple[list[int | str], Any, str | None]:
    """Follow `location` down `annotation`: the location as shown (a tagged union's tag
    left out), then the annotation reached and its discriminator (None when the path leaves
    what the annotation describes)."""
    current, discriminator = _unwrap(annotation)
    shown: list[int | str] = []
    for part in location:
        if discriminator is not None and isinstance(part, str):
            member = _tags(current, discriminator).get(part)
            if member is not None:
                current, discriminator = _unwrap(member)
                continue
        shown.append(part)
        fields = getattr(current, "model_fields", None)
        origin = get_origin(current)
        if isinstance(fields, dict) and part in fields:
            field = fields[part]
            tag = field.discriminator if isinstance(field.discriminator, str) else None
            current, discriminator = _unwrap(field.annotation, tag)
        elif origin in (dict, Mapping) and get_args(current):
            current, discriminator = _unwrap(get_args(current)[-1])
        elif origin in (list, tuple, set, frozenset, Sequence) and get_args(current):
            current, discriminator = _unwrap(get_args(current)[0])
        else:
            current, discriminator = None, None
    return shown, current, discriminator


def _tag_problem(error: Mapping[str, Any], union: Any, discriminator: str | None) -> str:
    tags = list(_tags(union, discriminator)) if discriminator else []
    if error["type"] == "union_tag_not_found":
        return f"is required (one of {tags})"
    given = error.get("input")
    value = given.get(discriminator) if isinstance(given, Mapping) and discriminator else None
    # A tag is a name, shown when short (a long string might be anything, a secret too).
    shown = repr(value) if isinstance(value, str) and len(value) <= 40 else type(value).__name__
    return f"expected one of {tags}, got {shown}{suggest(str(value), tags)}"


def _got(value: object) -> str:
    # Numbers and booleans are shown; strings and objects only by type (a string may be a
    # secret, an object's repr may hold anything).
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return type(value).__name__


def _expected(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    context = error.get("ctx") or {}
    expected = {
        "int_type": "an integer",
        "int_parsing": "an integer",
        "int_from_float": "an integer",
        "float_type": "a number",
        "float_parsing": "a number",
        "finite_number": "a finite number",
        "bool_type": "true or false",
        "bool_parsing": "true or false",
        "string_type": "a string",
        "callable_type": "a callable",
        "list_type": "a list",
        "dict_type": "a table",
        "model_type": "a table",
        "missing": "a value (it is required)",
    }.get(kind)
    if expected is not None:
        return expected
    if kind == "greater_than_equal":
        return f"at least {context.get('ge')}"
    if kind == "greater_than":
        return "positive" if context.get("gt") in (0, 0.0) else f"more than {context.get('gt')}"
    if kind == "less_than_equal":
        return f"at most {context.get('le')}"
    if kind == "less_than":
        return f"less than {context.get('lt')}"
    if kind == "literal_error":
        return f"one of {context.get('expected')}"
    if kind == "string_too_short":
        return "a non-empty string"
    if kind in ("string_too_long", "too_long"):
        return f"at most {context.get('max_length')} long"
    return str(error.get("msg", "a valid value"))


def problems_of(
    exc: pydantic.ValidationError,
    model: Any = None,
    prefix: Sequence[int | str] = (),
) -> list[tuple[str, str, bool]]:
    """Each problem of `exc` as ``(key path, what is wrong, is a type error)``.

    `model` is what was validated (a model class, or any annotation: a tagged union of
    models, say). Paths are prefixed with `prefix` and leave tagged unions' tags out;
    unknown names get a suggestion from the fields of the model they were given to; a
    missing or unknown tag is reported at the discriminator's key, with the tags allowed.
    """
    found: list[tuple[str, str, bool]] = []
    for error in exc.errors(include_url=False):
        location = tuple(error["loc"])
        kind = error["type"]
        shown, reached, discriminator = _walk(model, location)
        path = _path((*prefix, *shown))
        if kind in ("union_tag_not_found", "union_tag_invalid"):
            where = _path((*prefix, *shown, discriminator or "tag"))
            found.append((where, _tag_problem(error, reached, discriminator), False))
            continue
        if kind == "extra_forbidden":
            _, owner, _ = _walk(model, location[:-1])
            known = getattr(owner, "model_fields", None) or ()
            found.append((path, f"unknown setting{suggest(str(location[-1]), known)}", False))
            continue
        if kind in ("value_error", "assertion_error"):
            cause = (error.get("ctx") or {}).get("error")
            found.append((path, str(cause) if cause is not None else error["msg"], False))
            continue
        if kind == "missing":
            found.append((path, "is required", False))
            continue
        message = f"expected {_expected(error)}"
        if "input" in error:
            message += f", got {_got(error['input'])}"
        found.append((path, message, kind in _TYPE_ERRORS))
    return found


def settings_error(problems: Sequence[tuple[str, str, bool]]) -> Exception:
    """The exception a constructor raises for `problems` (see the module docstring)."""
    lines = []
    for path, message, _ in problems:
        if message.startswith("expected "):
            # "max_attempts must be at least 1, got 0": the code-facing phrasing.
            lines.append(f"{path} must be {message.removeprefix('expected ')}")
        else:
            lines.append(f"{path}: {message}" if path else message)
    text = "; ".join(lines)
    if problems and all(is_type for _, _, is_type in problems):
        return TypeError(text)
    return ValueError(text)
