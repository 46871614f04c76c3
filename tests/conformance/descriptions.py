"""The vendors' API descriptions (the cuts in ``descriptions/``): request bodies drawn from
their request schemas, and their response schemas as validators.

The generator is written here: hypothesis-jsonschema 0.23 fails inside current Hypothesis
(its object strategy calls a private API Hypothesis removed), and Schemathesis, whose
generator would do, pins jsonschema-rs below the version the project's test extra has. It
covers the JSON Schema the two descriptions use (``type``, ``enum``, ``const``,
``properties``/``required``, ``items`` with their bounds, ``anyOf``/``oneOf``/``allOf``,
local ``$ref``s, ``pattern``, numeric and length bounds). Whether a drawn body is valid is
never assumed: jsonschema-rs says (`Description.violated_by`), so a draw the generator got
wrong is counted as the schema-violating request it is.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs
import yaml
from hypothesis import strategies as st

HERE = Path(__file__).parent / "descriptions"
DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Keywords the generator reads; the others (``discriminator``, ``format``, ``default``,
# ``deprecated``...) only describe, or constrain nothing a draw could break.
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# How often one component may be entered again inside itself (recursive schemas).
_RECURSION = 1
# Beyond this nesting, arrays hold at most one item and optional properties are left out.
_DEEP = 6

Json = Any


def _load(name: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with (HERE / f"{name}.yaml").open() as file:
        document: dict[str, Any] = yaml.load(file, loader)
    return document


Patch = Callable[[dict[str, Any]], None]


class Description:
    """One vendor's cut description. `repair` rewrites what JSON Schema 2020-12 cannot read
    as the description means it (for drawing requests and judging answers alike); `allow`
    makes the allowances for the description's own flaws that correct answers break (for
    judging answers only). Each allowance says which flaw, and why, where it is made."""

    def __init__(self, name: str, repair: Patch, allow: Patch) -> None:
        self.name = name
        self.document = _load(name)
        repair(self.document["components"]["schemas"])
        self.schemas: dict[str, Any] = self.document["components"]["schemas"]
        self._patched = copy.deepcopy(self.document["components"])
        allow(self._patched["schemas"])

    @functools.cache  # noqa: B019 - one per description and name, for the session
    def validator(self, name: str) -> Any:
        """A jsonschema-rs validator of component schema `name`, allowances applied."""
        root = {
            "$schema": DIALECT,
            "$ref": f"#/components/schemas/{name}",
            "components": self._patched,
        }
        return jsonschema_rs.validator_for(root)

    @functools.cache  # noqa: B019
    def _published(self, name: str) -> Any:
        root = {"$schema": DIALECT, "$ref": f"#/components/schemas/{name}"}
        return jsonschema_rs.validator_for({**root, "components": self.document["components"]})

    def errors(self, name: str, instance: Json) -> list[str]:
        """Where and why `instance` fails schema `name` (allowances applied), at most 5."""
        found = []
        for error in self.validator(name).iter_errors(instance):
            where = "/".join(str(part) for part in error.instance_path) or "(root)"
            found.append(f"{where}: {error.message[:300]}")
            if len(found) == 5:
                break
        return found

    def member(self, union: str, tag: object) -> str | None:
        """The member of union `union` whose ``type`` is `tag` (its errors tell more than
        the union's), `union` itself when it is no union of references, None when no member
        has that type."""
        schemas = self._patched["schemas"]
        members = schemas[union].get("anyOf") or schemas[union].get("oneOf")
        if not members or not all("$ref" in member for member in members):
            return union
        for member in members:
            name = member["$ref"].rsplit("/", 1)[1]
            kind = schemas[name].get("properties", {}).get("type", {})
            if tag == kind.get("const") or tag in kind.get("enum", ()):
                return name
        return None

    def violated_by(self, name: str, body: Json) -> bool:
        """Whether `body` violates request schema `name` as published."""
        return not self._published(name).is_valid(body)

    def bodies(
        self,
        name: str,
        required: list[str] | None = None,
        leave_out: Served | None = None,
    ) -> st.SearchStrategy[Json]:
        """Request bodies drawn from schema `name`, with the `required` fields too, and
        without what `leave_out` names."""
        schema: Json = {"$ref": f"#/components/schemas/{name}"}
        if required:
            schema = {"allOf": [schema, {"required": required}]}
        return _Drawer(self.schemas, leave_out or Served()).strategy(schema, (), 0)


@dataclass(frozen=True)
class Served:
    """What draws of the gateway's served subset leave out of a description: top-level
    `fields`, and the members of unions whose ``type`` is one of `types` or whose ``role``
    one of `roles`."""

    fields: frozenset[str] = frozenset()
    types: frozenset[str] = frozenset()
    roles: frozenset[str] = frozenset()

    def keeps(self, branch: Json) -> bool:
        if not isinstance(branch, dict):
            return True
        for key, left_out in (("type", self.types), ("role", self.roles)):
            tag = branch.get("properties", {}).get(key)
            if left_out and isinstance(tag, dict):
                values = [tag["const"]] if "const" in tag else tag.get("enum", [])
                if values and all(value in left_out for value in values):
                    return False
        return True


def nullable_as_null(schemas: dict[str, Any]) -> None:
    """OpenAI's description is OpenAPI 3.1 (JSON Schema 2020-12) yet marks nullable fields
    with 3.0's ``nullable: true``, which 2020-12 does not know: its null values would fail.
    Read as meant: null added to the field's ``type``."""
    for node in list(_nodes(schemas)):
        if node.pop("nullable", None) is not True:
            continue
        if "type" in node:
            kind = node["type"]
            kinds = kind if isinstance(kind, list) else [kind]
            if "null" not in kinds:
                node["type"] = [*kinds, "null"]
            if "enum" in node and None not in node["enum"]:
                node["enum"] = [*node["enum"], None]
        else:  # a reference or a union: null besides it
            rest = dict(node)
            node.clear()
            node["anyOf"] = [rest, {"type": "null"}]


def untyped_as_untyped(schemas: dict[str, Any]) -> None:
    """Anthropic's description writes ``type: null`` (YAML's null, not the string "null")
    where a schema has no type (its ``Model``: any string, or one of the names it lists),
    which is no JSON Schema: read as no ``type`` at all."""
    for node in _nodes(schemas):
        if "type" in node and node["type"] is None:
            del node["type"]


def _nodes(node: Json) -> Iterator[dict[str, Any]]:
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            yield current
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)


# -- drawing request bodies ---------------------------------------------------------------------


def _json_values() -> st.SearchStrategy[Json]:
    scalars = st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.text(max_size=8)
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=6), inner, max_size=2)
        ),
        max_leaves=4,
    )


class _Drawer:
    def __init__(self, schemas: dict[str, Any], leave_out: Served) -> None:
        self.schemas = schemas
        self.leave_out = leave_out

    def resolve(self, ref: str) -> tuple[str, Json]:
        prefix = "#/components/schemas/"
        if not ref.startswith(prefix):
            raise ValueError(f"unsupported reference {ref}")
        name = ref[len(prefix) :]
        return name, self.schemas[name]

    def flatten(self, schema: Json, stack: tuple[str, ...]) -> Json | None:
        """`schema` with its top-level ``$ref`` and ``allOf`` merged in (None: a recursion
        taken too often, which nothing may be drawn from)."""
        if not isinstance(schema, dict):
            return schema
        if "$ref" in schema:
            name, target = self.resolve(schema["$ref"])
            if stack.count(name) > _RECURSION:
                return None
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            target = self.flatten(target, (*stack, name))
            return None if target is None else _merge(target, rest)
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                flat = self.flatten(part, stack)
                if flat is None:
                    return None
                merged = _merge(merged, flat)
            return self.flatten(merged, stack)
        return schema

    def strategy(self, schema: Json, stack: tuple[str, ...], depth: int) -> st.SearchStrategy[Json]:
        if schema is True or schema == {}:
            return _json_values()
        if schema is False:
            return st.nothing()
        names = stack
        if isinstance(schema, dict) and "$ref" in schema:
            names = (*stack, self.resolve(schema["$ref"])[0])
        flat = self.flatten(schema, stack)
        if flat is None:
            return st.nothing()
        if not isinstance(flat, dict):
            return _json_values()
        stack = names
        for keyword in ("anyOf", "oneOf"):
            if keyword in flat:
                rest = {k: v for k, v in flat.items() if k != keyword}
                branches = []
                for branch in flat[keyword]:
                    merged = self.flatten(branch, stack)
                    if merged is not None and self.leave_out.keeps(merged):
                        branches.append(self.strategy(_merge(rest, merged), stack, depth))
                return st.one_of(branches)
        if "const" in flat:
            return st.just(flat["const"])
        if "enum" in flat:
            return st.sampled_from(flat["enum"])
        kind = flat.get("type")
        if kind is None:
            kind = "object" if "properties" in flat else None
        if isinstance(kind, list):
            return st.one_of([self.typed(flat, k, stack, depth) for k in kind])
        if kind is None:
            return _json_values()
        return self.typed(flat, kind, stack, depth)

    def typed(
        self, schema: dict[str, Any], kind: str, stack: tuple[str, ...], depth: int
    ) -> st.SearchStrategy[Json]:
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind in ("integer", "number"):
            low, high = _bounds(schema)
            integers = st.integers(
                None if low is None else math.ceil(low), None if high is None else math.floor(high)
            )
            if kind == "integer":
                return integers
            floats = st.floats(low, high, allow_nan=False, allow_infinity=False)
            return integers | floats
        if kind == "string":
            if "pattern" in schema:
                return st.from_regex(schema["pattern"], fullmatch=True).filter(
                    lambda s: _within(s, schema)
                )
            low = schema.get("minLength", 0)
            high = min(schema.get("maxLength", low + 24), low + 24)
            return st.text(min_size=low, max_size=high)
        if kind == "array":
            items = schema.get("items", True)
            low = schema.get("minItems", 0)
            if depth <= 1:
                # A request's own lists (its messages, input, tools): an empty one is valid
                # for the descriptions, but says little; the broken draws cover it.
                low = max(low, 1)
            high = schema.get("maxItems", low + (1 if depth >= _DEEP else 3))
            high = min(high, low + (1 if depth >= _DEEP else 3))
            elements = self.strategy(items, stack, depth + 1)
            if elements.is_empty:  # every member left out
                return st.just([]) if low == 0 else st.nothing()
            return st.lists(elements, min_size=low, max_size=high)
        if kind == "object":
            properties = schema.get("properties", {})
            if depth == 0:
                left_out = self.leave_out.fields
                properties = {p: s for p, s in properties.items() if p not in left_out}
            required = [p for p in schema.get("required", []) if p in properties]
            fixed = {p: self.strategy(properties[p], stack, depth + 1) for p in required}
            optional = {}
            if depth < _DEEP:
                optional = {
                    p: self.strategy(s, stack, depth + 1)
                    for p, s in properties.items()
                    if p not in required
                }
            if not properties and schema.get("additionalProperties", True) is not False:
                extra = schema.get("additionalProperties", True)
                values = _json_values() if extra is True else self.strategy(extra, stack, depth + 1)
                return st.dictionaries(st.text(min_size=1, max_size=8), values, max_size=2)
            return st.fixed_dictionaries(fixed, optional=optional)
        return _json_values()


def _bounds(schema: dict[str, Any]) -> tuple[float | None, float | None]:
    low = schema.get("minimum")
    high = schema.get("maximum")
    if isinstance(schema.get("exclusiveMinimum"), int | float):
        low = schema["exclusiveMinimum"] + 1e-6
    if isinstance(schema.get("exclusiveMaximum"), int | float):
        high = schema["exclusiveMaximum"] - 1e-6
    return low, high


def _within(text: str, schema: dict[str, Any]) -> bool:
    return schema.get("minLength", 0) <= len(text) <= schema.get("maxLength", len(text))


def _merge(base: Json, extra: Json) -> Json:
    """Two schemas that must both hold, as one (for the keywords the generator reads)."""
    if extra is False or base is False:
        return False
    if not isinstance(base, dict) or not extra:
        return extra if isinstance(extra, dict) and extra else base
    if not isinstance(extra, dict):
        return base
    merged = dict(base)
    for key, value in extra.items():
        if key not in merged:
            merged[key] = value
        elif key == "properties":
            properties = dict(merged[key])
            for name, schema in value.items():
                properties[name] = (
                    {"allOf": [properties[name], schema]} if name in properties else schema
                )
            merged[key] = properties
        elif key == "required":
            merged[key] = list(dict.fromkeys([*merged[key], *value]))
        elif key == "type" and merged[key] != value:
            mine = merged[key] if isinstance(merged[key], list) else [merged[key]]
            theirs = value if isinstance(value, list) else [value]
            common = [k for k in mine if k in theirs]
            merged[key] = common if len(common) != 1 else common[0]
        else:
            merged[key] = value
    return merged


def dumps(value: Json) -> str:
    return json.dumps(value, ensure_ascii=False)[:400]
