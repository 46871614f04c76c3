"""`pipeline._settings`: the base of every layer's frozen settings class, and how its
problems are reported (in code: `TypeError`/`ValueError`; to a loader: key paths)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, ClassVar

import pydantic
import pytest
from pydantic import Field

from pipeline._settings import (
    Settings,
    collecting_problems,
    problems_of,
    settings_error,
    suggest,
)

SECRET = "sk-canary-5d1e"


class Limits(Settings):
    ceiling: Annotated[int, Field(ge=1)] = 10


class Example(Settings):
    code_only: ClassVar[frozenset[str]] = frozenset({"hook"})

    count: Annotated[int, Field(ge=1)] = 1
    ratio: Annotated[float, Field(gt=0)] = 1.0
    name: str = "example"
    enabled: bool = True
    sizes: list[int] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    hook: Callable[[], None] | None = None


def problem(**values: object) -> str:
    with pytest.raises((TypeError, ValueError)) as raised:
        Example(**values)  # type: ignore[arg-type]
    return str(raised.value)


# -- frozen, strict, complete -----------------------------------------------------------------


def test_settings_are_frozen() -> None:
    settings = Example(count=2)
    with pytest.raises(pydantic.ValidationError):
        settings.count = 3  # type: ignore[misc]
    assert settings.count == 2


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"count": "3"}, "count must be an integer, got str"),
        ({"count": True}, "count must be an integer, got true"),
        ({"count": 2.0}, "count must be an integer, got 2.0"),
        ({"enabled": 1}, "enabled must be true or false, got 1"),
        ({"name": 7}, "name must be a string, got 7"),
    ],
    ids=["string-for-int", "bool-for-int", "float-for-int", "int-for-bool", "int-for-string"],
)
def test_nothing_is_coerced_and_a_wrong_type_is_a_type_error(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(TypeError) as raised:
        Example(**values)  # type: ignore[arg-type]
    assert str(raised.value) == message


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_no_nan_or_infinity(bad: float) -> None:
    with pytest.raises(ValueError, match="ratio must be a finite number"):
        Example(ratio=bad)


def test_a_bad_value_is_a_value_error_in_our_words() -> None:
    with pytest.raises(ValueError) as raised:
        Example(count=0)
    assert str(raised.value) == "count must be at least 1, got 0"
    assert problem(ratio=0.0) == "ratio must be positive, got 0.0"


def test_an_unknown_name_is_refused_with_a_suggestion() -> None:
    assert problem(cuont=2) == "cuont: unknown setting; did you mean 'count'?"
    assert problem(zzz=2) == "zzz: unknown setting"


def test_every_problem_is_named_and_a_mix_is_a_value_error() -> None:
    with pytest.raises(ValueError) as raised:
        Example(count="3", ratio=-1.0)  # type: ignore[arg-type]
    assert (
        str(raised.value) == "count must be an integer, got str; ratio must be positive, got -1.0"
    )
    with pytest.raises(TypeError) as typed:
        Example(count="3", name=7)  # type: ignore[arg-type]
    assert str(typed.value) == "count must be an integer, got str; name must be a string, got 7"


def test_a_string_value_is_never_echoed() -> None:
    message = problem(count=SECRET, sizes=[1, SECRET], hook=SECRET)
    assert SECRET not in message
    assert "count must be an integer, got str" in message
    assert "sizes[1] must be an integer, got str" in message


def test_nested_settings_name_their_owner() -> None:
    # In code, the nested class reports its own problem; a loader gets the whole key path
    # (see test_problems_of_gives_key_paths_under_a_prefix).
    assert problem(limits={"ceiling": 0}) == "limits: ceiling must be at least 1, got 0"
    assert problem(limits={"celing": 2}) == (
        "limits: celing: unknown setting; did you mean 'ceiling'?"
    )


# -- code stays in code -----------------------------------------------------------------------


def test_code_is_accepted_in_python() -> None:
    def hook() -> None:
        return None

    assert Example(hook=hook).hook is hook


def test_a_configuration_naming_a_code_setting_is_refused_by_name() -> None:
    with collecting_problems(), pytest.raises(pydantic.ValidationError) as raised:
        Example(hook="package.module:function")  # type: ignore[arg-type]
    problems = problems_of(raised.value, Example)
    assert problems == [("", "hook: takes code; set it in Python, not in configuration", False)]


def test_collecting_problems_raises_pydantics_error_and_ends_with_its_block() -> None:
    with collecting_problems(), pytest.raises(pydantic.ValidationError):
        Example(count=0)
    with pytest.raises(ValueError) as raised:
        Example(count=0)
    assert not isinstance(raised.value, pydantic.ValidationError)


# -- from_options and replace ---------------------------------------------------------------


def test_from_options_builds_defaults_or_keeps_the_given_settings() -> None:
    assert Example.from_options(None, {}) == Example()
    given = Example(count=4)
    assert Example.from_options(given, {}) is given


def test_from_options_replaces_the_named_values_and_validates_them() -> None:
    given = Example(count=4, name="n")
    changed = Example.from_options(given, {"count": 5})
    assert (changed.count, changed.name) == (5, "n")
    assert given.count == 4
    with pytest.raises(ValueError, match="count must be at least 1"):
        Example.from_options(given, {"count": 0})


def test_from_options_refuses_another_settings_class() -> None:
    with pytest.raises(TypeError, match="settings must be Example, not Limits"):
        Example.from_options(Limits(), {"count": 2})  # type: ignore[arg-type]


def test_replace_is_a_validated_copy() -> None:
    original = Example(count=2)
    copy = original.replace(name="copy")
    assert (copy.count, copy.name, original.name) == (2, "copy", "example")
    with pytest.raises(ValueError, match="count must be at least 1, got 0"):
        original.replace(count=0)
    with pytest.raises(ValueError, match="unknown setting"):
        original.replace(cuont=3)


# -- suggest, problems_of, settings_error ------------------------------------------------------


def test_suggest_names_the_closest_known_name_or_nothing() -> None:
    assert suggest("request_timout", ["request_timeout", "attempt_timeout"]) == (
        "; did you mean 'request_timeout'?"
    )
    assert suggest("zzz", ["request_timeout"]) == ""


def test_problems_of_gives_key_paths_under_a_prefix() -> None:
    with collecting_problems(), pytest.raises(pydantic.ValidationError) as raised:
        Example(sizes=[1, "x"], limits={"celing": 1}, count=0)  # type: ignore[arg-type]
    problems = problems_of(raised.value, Example, prefix=("layers", "example"))
    assert sorted(problems) == [
        ("layers.example.count", "expected at least 1, got 0", False),
        ("layers.example.limits.celing", "unknown setting; did you mean 'ceiling'?", False),
        ("layers.example.sizes[1]", "expected an integer, got str", True),
    ]


def test_a_missing_value_is_required() -> None:
    class Needs(Settings):
        url: str

    with collecting_problems(), pytest.raises(pydantic.ValidationError) as raised:
        Needs()  # type: ignore[call-arg]
    assert problems_of(raised.value, Needs) == [("url", "is required", False)]
    with pytest.raises(ValueError, match=r"^url: is required$"):
        Needs()  # type: ignore[call-arg]


def test_settings_error_is_a_type_error_only_when_every_problem_is_a_type() -> None:
    typed = settings_error([("a", "expected an integer, got str", True)])
    assert isinstance(typed, TypeError) and str(typed) == "a must be an integer, got str"
    mixed = settings_error(
        [("a", "expected an integer, got str", True), ("b", "unknown setting", False)]
    )
    assert type(mixed) is ValueError
    assert str(mixed) == "a must be an integer, got str; b: unknown setting"
    assert str(settings_error([("", "takes code", False)])) == "takes code"
