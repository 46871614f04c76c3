"""`middleware.tools`: a tool's name, description and JSON schema come from its function;
its arguments are validated before the call, and a validation error names fields and error
types, never the values."""

from __future__ import annotations

import functools
from typing import Literal

import pytest

from middleware.function_invocation import Tool, ToolArgumentsError, tool

CANARY = "canary-argument-8c2f"


def get_weather(city: str, unit: Literal["C", "F"] = "C", days: int = 1) -> str:
    """The forecast for `city`.

    More details nobody reads."""
    return f"{city}: sunny for {days} day(s), in {unit}"


async def book_table(restaurant: str, guests: int) -> dict[str, object]:
    """Book a table."""
    return {"restaurant": restaurant, "guests": guests}


# -- from the function ------------------------------------------------------------------------


def test_name_description_and_schema_come_from_the_function() -> None:
    weather = Tool.from_function(get_weather)
    assert weather.name == "get_weather"
    assert weather.description == "The forecast for `city`.\n\nMore details nobody reads."
    assert weather.function is get_weather
    schema = weather.parameters
    assert "title" not in schema
    assert schema["type"] == "object"
    assert schema["required"] == ["city"]
    properties = schema["properties"]
    assert properties["city"]["type"] == "string"
    assert properties["unit"]["enum"] == ["C", "F"] and properties["unit"]["default"] == "C"
    assert properties["days"]["type"] == "integer" and properties["days"]["default"] == 1


def test_name_and_description_may_be_given() -> None:
    weather = Tool.from_function(get_weather, name="weather", description="  Weather.  ")
    assert (weather.name, weather.description) == ("weather", "Weather.")


def test_a_function_without_a_docstring_has_an_empty_description() -> None:
    def ping(host: str) -> str:
        return host

    assert Tool.from_function(ping).description == ""


def test_the_decorator_takes_both_forms() -> None:
    @tool
    def plain(x: int) -> int:
        """Plain."""
        return x

    @tool(name="named", description="Named.")
    def configured(x: int) -> int:
        return x

    assert isinstance(plain, Tool) and (plain.name, plain.description) == ("plain", "Plain.")
    assert isinstance(configured, Tool)
    assert (configured.name, configured.description) == ("named", "Named.")


def test_what_cannot_be_a_tool_is_refused_with_the_reason() -> None:
    def untyped(city):  # type: ignore[no-untyped-def]
        return city

    def variadic(*cities: str) -> None:
        return None

    def keywords(**options: str) -> None:
        return None

    def unresolvable(city: NoSuchType) -> None:  # type: ignore[name-defined]  # noqa: F821
        return None

    with pytest.raises(TypeError, match="needs a callable"):
        Tool.from_function("get_weather")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="parameter 'city' needs a type annotation"):
        Tool.from_function(untyped)
    with pytest.raises(TypeError, match=r"\*args and \*\*kwargs are not supported"):
        Tool.from_function(variadic)
    with pytest.raises(TypeError, match=r"\*args and \*\*kwargs are not supported"):
        Tool.from_function(keywords)
    with pytest.raises(TypeError, match="tool 'unresolvable': cannot resolve its type hints") as e:
        Tool.from_function(unresolvable)
    assert isinstance(e.value.__cause__, NameError)
    with pytest.raises(ValueError, match="a tool needs a name"):
        Tool.from_function(functools.partial(get_weather, "Paris"))


# -- validation and invocation ----------------------------------------------------------------


def test_validate_returns_every_keyword_argument_with_defaults() -> None:
    weather = Tool.from_function(get_weather)
    assert weather.validate({"city": "Paris"}) == {"city": "Paris", "unit": "C", "days": 1}
    assert weather.validate({"city": "Oslo", "unit": "F", "days": 3}) == {
        "city": "Oslo",
        "unit": "F",
        "days": 3,
    }


def test_bad_arguments_name_fields_and_error_types_never_values() -> None:
    weather = Tool.from_function(get_weather)
    with pytest.raises(ToolArgumentsError) as raised:
        weather.validate({"unit": CANARY, "days": CANARY})
    message = str(raised.value)
    assert CANARY not in message
    assert message == "city: missing; unit: literal_error; days: int_parsing"
    assert isinstance(raised.value, ValueError)


async def test_invoke_validates_before_calling() -> None:
    calls: list[str] = []

    @tool
    def record(city: str) -> str:
        calls.append(city)
        return city

    with pytest.raises(ToolArgumentsError, match="city: string_type"):
        await record.invoke({"city": 17})
    assert calls == []
    assert await record.invoke({"city": "Paris"}) == "Paris"
    assert calls == ["Paris"]


async def test_invoke_calls_a_plain_function_and_awaits_an_async_one() -> None:
    weather, booking = Tool.from_function(get_weather), Tool.from_function(book_table)
    assert await weather.invoke({"city": "Rome", "days": 2}) == "Rome: sunny for 2 day(s), in C"
    assert await booking.invoke({"restaurant": "Chez Nous", "guests": 4}) == {
        "restaurant": "Chez Nous",
        "guests": 4,
    }


async def test_a_tools_own_error_reaches_the_caller_unchanged() -> None:
    error = RuntimeError("the booking system is down")

    @tool
    async def broken(guests: int) -> None:
        raise error

    with pytest.raises(RuntimeError) as raised:
        await broken.invoke({"guests": 2})
    assert raised.value is error
