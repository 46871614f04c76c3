"""The shape checks behind response validation and evals: locations never quote answers."""

from __future__ import annotations

from typing import Annotated

import pydantic
import pytest

from pipeline import ChatMessage, ChatResponse
from pipeline._validation import MAX_PROBLEMS, ShapeCheck, strip_fence
from pipeline.errors import ResponseValidationError

CANARY = "CANARY-shape-55aa"


def answer(text: str) -> ChatResponse:
    return ChatResponse([ChatMessage.assistant(text)])


def problems(check: ShapeCheck, text: str) -> tuple[tuple[str, str], ...]:
    with pytest.raises(ResponseValidationError) as caught:
        check(answer(text))
    assert CANARY not in str(caught.value)
    return caught.value.problems


def test_aliases_and_nested_generic_fields_are_known_names() -> None:
    class Line(pydantic.BaseModel):
        unit_price: Annotated[float, pydantic.Field(alias="unitPrice")]

    class Order(pydantic.BaseModel):
        lines: list[Line] | None = None
        by_code: dict[str, Line] = {}

    check = ShapeCheck(Order)
    text = '{"lines": [{"unitPrice": "x"}], "by_code": {"' + CANARY + '": {}}}'
    assert problems(check, text) == (
        ("lines[0].unitPrice", "float_parsing"),
        ("by_code.*.unitPrice", "missing"),  # the key came from the answer
    )


def test_union_member_tags_are_masked() -> None:
    class Either(pydantic.BaseModel):
        v: int | list[int]

    assert problems(ShapeCheck(Either), '{"v": "' + CANARY + '"}') == (
        ("v.*", "int_parsing"),
        ("v.*", "list_type"),
    )


def test_problems_are_capped_and_the_message_lists_a_few() -> None:
    class Many(pydantic.BaseModel):
        values: list[int]

    text = '{"values": [' + ", ".join(f'"{CANARY}"' for _ in range(50)) + "]}"
    check = ShapeCheck(Many)
    with pytest.raises(ResponseValidationError) as caught:
        check(answer(text))
    assert len(caught.value.problems) == MAX_PROBLEMS
    assert str(caught.value).endswith("and 15 more)")
    assert str(caught.value).startswith("response is not a valid Many: 20 problems (values[0]")


@pytest.mark.parametrize(
    ("text", "inner"),
    [
        ('```json\n{"a": 1}\n```', '{"a": 1}'),
        ('```\n{"a": 1}\n```', '{"a": 1}'),
        ("\n ```jsonc \n[1]\n```\n", "[1]"),
        ('{"a": "```"}', '{"a": "```"}'),
        ('```json\n{"a": 1}\n```\n```json\n{"b": 2}\n```', None),
        ('```json {"a": 1}```', None),
    ],
)
def test_strip_fence(text: str, inner: str | None) -> None:
    result = strip_fence(text)
    if inner is None:
        assert result == text or "```" in result
    else:
        assert result == inner


def test_an_empty_answer_is_json_invalid() -> None:
    class Anything(pydantic.BaseModel):
        pass

    assert problems(ShapeCheck(Anything), "") == (("$", "json_invalid"),)
    assert problems(ShapeCheck({"type": "object"}), "") == (("$", "json_invalid"),)


def test_strip_fences_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="strip_fences"):
        ShapeCheck({"type": "object"}, strip_fences=1)  # type: ignore[arg-type]
