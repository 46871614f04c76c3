"""The configuration reference page, generated from the settings classes.

Every key a pipeline's TOML file may hold, one row per key path (``routes.<name>.model``,
``[gateway] max_body_bytes`` as ``gateway.max_body_bytes``), with its type, default, bounds
and description. The descriptions are the fields' attribute docstrings (the string literal
right after each field), so the page cannot drift from the code: the docs build runs
`render()` (through ``scripts/gen_docs.py``), and the test suite fails on a field without a
description (`undocumented`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types
import pydantic
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = ["Row", "Table", "render", "tables", "undocumented"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One key of a table: its path, the class and field that define it."""

    path: str
    owner: type[pydantic.BaseModel]
    name: str
    field: FieldInfo
    tag: bool = False  # the key that picks the table's class in a tagged union


@dataclasses.dataclass(frozen=True)
class Table:
    """A table of the file (``routes.<name>`` with ``provider = "openai"``, say)."""

    title: str
    anchor: str
    intro: str
    rows: list[Row]


def _members(annotation: Any) -> list[Any]:
    """The members of `annotation` with ``Annotated`` and ``None`` taken off."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        found: list[Any] = []
        for member in get_args(annotation):
            if member is not type(None):
                found.extend(_members(member))
        return found
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _nested(field: FieldInfo) -> list[type[pydantic.BaseModel]]:
    """The settings classes a field's value is a table of (several: a tagged union)."""
    return [member for member in _members(field.annotation) if _is_model(member)]


def _is_code(owner: type[pydantic.BaseModel], name: str, field: FieldInfo) -> bool:
    """Fields a file cannot set: code (callables, clients), refused by the loader."""
    if name in getattr(owner, "code_only", frozenset()):
        return True
    members = _members(field.annotation)
    return any(
        member is Any or get_origin(member) is Callable or member is Callable for member in members
    )


def _fields(model: type[pydantic.BaseModel]) -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        if not _is_code(model, name, field):
            yield name, field


def _rows(model: type[pydantic.BaseModel], prefix: str, *, skip: frozenset[str]) -> list[Row]:
    """`model`'s keys under `prefix`, scalar keys first; nested tables are their own."""
    return [
        Row(f"{prefix}.{name}", model, name, field)
        for name, field in _fields(model)
        if name not in skip
    ]


def _tag_first(rows: list[Row], key: str) -> list[Row]:
    """`rows` of a tagged union's member, the tag (``provider``, ``kind``) first."""
    tagged = [dataclasses.replace(row, tag=row.name == key) for row in rows]
    return sorted(tagged, key=lambda row: not row.tag)


def _type_name(annotation: Any) -> str:
    members = _members(annotation)
    names = []
    for member in members:
        origin = get_origin(member)
        if origin is Literal:
            names.append(" | ".join(f'`"{value}"`' for value in get_args(member)))
        elif member is bool:
            names.append("boolean")
        elif member is int:
            names.append("integer")
        elif member is float:
            names.append("number")
        elif member is str:
            names.append("string")
        elif origin in (list, tuple, frozenset, set) or member in (list, frozenset):
            inner = get_args(member)
            names.append(f"list of {_type_name(inner[0])}s" if inner else "list")
        elif origin in (dict, Mapping):
            inner = get_args(member)
            names.append(f"table of {_type_name(inner[-1])}s" if inner else "table")
        elif _is_model(member):
            names.append("table")
        else:
            names.append(getattr(member, "__name__", str(member)))
    return " or ".join(dict.fromkeys(names))


def _constraints(annotation: Any, metadata: list[Any]) -> list[Any]:
    found = list(metadata)
    origin = get_origin(annotation)
    if origin is Annotated:
        _, *extra = get_args(annotation)
        for item in extra:
            if isinstance(item, FieldInfo):
                found.extend(item.metadata)
            else:
                found.append(item)
        found.extend(_constraints(get_args(annotation)[0], []))
    elif origin in (typing.Union, types.UnionType):
        for member in get_args(annotation):
            found.extend(_constraints(member, []))
    return found


def _bounds(field: FieldInfo) -> str:
    parts = []
    for item in _constraints(field.annotation, field.metadata):
        if isinstance(item, annotated_types.Ge):
            parts.append(f"≥ {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            parts.append(f"≤ {item.le}")
        elif isinstance(item, annotated_types.Lt):
            parts.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.MinLen) and item.min_length > 1:
            parts.append(f"at least {item.min_length} long")
        elif isinstance(item, annotated_types.MinLen):
            parts.append("not empty")
        elif isinstance(item, annotated_types.MaxLen):
            parts.append(f"at most {item.max_length} long")
    return ", ".join(dict.fromkeys(parts))


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, int | float):
        return f"`{value:,}`" if isinstance(value, int) and value >= 10_000 else f"`{value}`"
    if isinstance(value, dict | Mapping):
        return "`{}`" if not value else f"`{dict(value)}`"
    if isinstance(value, list | tuple | set | frozenset):
        return "`[]`" if not value else "`[" + ", ".join(f'"{v}"' for v in sorted(value)) + "]`"
    return f"`{value!r}`"


def _default(field: FieldInfo, tag: bool = False) -> str:
    if tag:
        return "**required**"  # it picks the table's class, so it is always given
    if field.default_factory is not None:
        factory = typing.cast(Callable[[], Any], field.default_factory)
        return _toml(factory())
    if field.default is PydanticUndefined:
        return "**required**"
    return _toml(field.default)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _tag(model: type[pydantic.BaseModel], key: str) -> str:
    return str(get_args(model.model_fields[key].annotation)[0])


def _union(alias: Any) -> list[type[pydantic.BaseModel]]:
    return [member for member in _members(alias) if _is_model(member)]


def _nested_tables(
    model: type[pydantic.BaseModel], prefix: str, anchor: str, seen: set[str]
) -> list[Table]:
    """The tables nested in `model` (``retry = {...}``, ``[router.health]``...)."""
    found = []
    for name, field in _fields(model):
        for nested in _nested(field):
            path = f"{prefix}.{name}"
            key = f"{path}:{nested.__name__}"
            if key in seen:
                continue
            seen.add(key)
            tag = ""
            if "provider" in nested.model_fields:
                tag = f' with `provider = "{_tag(nested, "provider")}"`'
            found.append(
                Table(
                    f"`{path}`{tag}",
                    f"{anchor}-{name}" + (f"-{_tag(nested, 'provider')}" if tag else ""),
                    _doc(nested),
                    _tag_first(_rows(nested, path, skip=frozenset()), "provider"),
                )
            )
    return found


def _doc(model: type[Any]) -> str:
    text = (model.__doc__ or "").strip()
    return text.split("\n\n")[0] if text else ""


def tables() -> list[Table]:
    """Every table of a pipeline's TOML file, in the order of the reference page."""
    from pipeline.config import GroupConfig, LayersConfig, RouteConfig, RouterConfig, SpendConfig
    from pipeline.gateway.settings import GatewaySettings

    found: list[Table] = []
    seen: set[str] = set()

    routes = _union(RouteConfig)
    common = set.intersection(*(set(dict(_fields(model))) for model in routes))
    nested_common = {name for name in common if _nested(routes[0].model_fields[name])}
    found.append(
        Table(
            "`[routes.<name>]`: every route",
            "routes",
            "A route: one provider's client, with its facts and its own layers. `provider` "
            "picks the class; these keys are taken by every provider.",
            [
                Row(f"routes.<name>.{name}", routes[0], name, field)
                for name, field in _fields(routes[0])
                if name in common and name not in nested_common and name != "provider"
            ],
        )
    )
    for model in routes:
        tag = _tag(model, "provider")
        found.append(
            Table(
                f'`[routes.<name>]` with `provider = "{tag}"`',
                f"routes-{tag}",
                _doc(model),
                _tag_first(
                    _rows(model, "routes.<name>", skip=frozenset(common - {"provider"})),
                    "provider",
                ),
            )
        )
    found.extend(_nested_tables(routes[0], "routes.<name>", "routes", seen))

    found.append(
        Table(
            "`[groups.<name>]`",
            "groups",
            _doc(GroupConfig),
            _rows(GroupConfig, "groups.<name>", skip=frozenset()),
        )
    )
    found.extend(_nested_tables(GroupConfig, "groups.<name>", "groups", seen))

    for model in _union(RouterConfig):
        tag = _tag(model, "kind")
        found.append(
            Table(
                f'`[router]` with `kind = "{tag}"`',
                f"router-{tag}",
                _doc(model),
                _tag_first(_rows(model, "router", skip=frozenset()), "kind"),
            )
        )
    for model in _union(RouterConfig):
        found.extend(_nested_tables(model, "router", "router", seen))

    found.append(
        Table(
            "`[layers]`",
            "layers",
            _doc(LayersConfig),
            _rows(LayersConfig, "layers", skip=frozenset()),
        )
    )
    found.append(
        Table(
            "`[gateway]`",
            "gateway",
            _doc(GatewaySettings),
            _rows(GatewaySettings, "gateway", skip=frozenset()),
        )
    )
    found.append(
        Table(
            "`[spend]`", "spend", _doc(SpendConfig), _rows(SpendConfig, "spend", skip=frozenset())
        )
    )
    from pipeline.keys._settings import BudgetsSettings, KeysSettings

    found.append(
        Table("`[keys]`", "keys", _doc(KeysSettings), _rows(KeysSettings, "keys", skip=frozenset()))
    )
    found.append(
        Table(
            "`[budgets]`",
            "budgets",
            _doc(BudgetsSettings),
            _rows(BudgetsSettings, "budgets", skip=frozenset()),
        )
    )
    return found


def undocumented() -> list[str]:
    """The key paths whose field has no description (the test suite wants none)."""
    return [
        f"{row.path} ({row.owner.__name__}.{row.name})"
        for table in tables()
        for row in table.rows
        if not (row.field.description or "").strip()
    ]


_HEAD = """\
# Configuration reference

Every key of a pipeline's TOML file (`ChatPipeline.from_config`, `chat-pipeline ask`,
`eval` and `serve`), generated from the settings classes that validate it: one row per key
path, with its type, its default, its bounds and what it does. `<name>` is a name you
choose (a route's, a group's). How the file fits together (tables, environments, secrets,
errors) is on [configuration files](../configuration.md).

Values are strict: `"3"` is not 3, NaN is refused, an unknown key is an error that names
its key path and suggests the closest known key. Secrets and URLs that may hold a password
are never values: a key ending in `_env` names the environment variable that holds them.

`[environments.<name>]` holds any of the tables below, merged over the rest of the file
(tables key by key, other values replaced; a route whose `provider` an environment changes
is replaced whole) when that environment is chosen (the `environment` argument, `--env`, or
`CHAT_PIPELINE_ENV`). The variables the library reads are listed on
[environment variables](environment.md).
"""


def render() -> str:
    """The reference page, as Markdown."""
    out = [_HEAD]
    for table in tables():
        out.append(f"## {table.title} {{#{table.anchor}}}\n")
        if table.intro:
            out.append(_cell(table.intro) + "\n")
        if not table.rows:
            continue
        out.append("| key | type | default | bounds | description |")
        out.append("|---|---|---|---|---|")
        for row in table.rows:
            description = row.field.description or "**undocumented**"
            out.append(
                f"| `{row.path}` | {_cell(_type_name(row.field.annotation))} | "
                f"{_cell(_default(row.field, row.tag))} | {_cell(_bounds(row.field))} | "
                f"{_cell(description)} |"
            )
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render())
