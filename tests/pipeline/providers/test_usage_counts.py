"""Reading a ``usage`` object (`pipeline.wire._common.read_usage`): a decoded object and any
other mapping read alike, and a count that is not an integer is unknown."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

from pipeline.types import UsageDetails
from pipeline.wire._common import read_usage
from pipeline.wire.chat_completions.outbound import parse_usage
from pipeline.wire.chat_completions.vocab import USAGE_FIELDS

USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 5,
    "total_tokens": 17,
    "prompt_tokens_details": {"cached_tokens": 4},
    "completion_tokens_details": MappingProxyType({"reasoning_tokens": 2}),
}


@pytest.mark.parametrize("wrap", [dict, MappingProxyType])
def test_usage_reads_alike_from_a_dict_and_any_mapping(wrap: Any) -> None:
    assert parse_usage(wrap(USAGE)) == UsageDetails(
        input_tokens=12,
        output_tokens=5,
        total_tokens=17,
        reasoning_tokens=2,
        cache_read_tokens=4,
        cache_write_tokens=None,
    )


def test_a_count_that_is_not_an_integer_is_unknown() -> None:
    odd = {
        "prompt_tokens": True,
        "completion_tokens": 5.0,
        "total_tokens": "17",
        "prompt_tokens_details": None,
        "completion_tokens_details": [2],
    }
    assert parse_usage(odd) == UsageDetails()
    assert parse_usage([1, 2]) is None
    assert parse_usage(None) is None


class _Count(int):
    """An integer of another type: `read_usage` reads it, as the plain reading must too."""


_COUNTS: list[Any] = [0, 7, None, True, 5.0, "3", _Count(4), 2**70]
_DETAILS: list[Any] = [
    None,
    {},
    {"cached_tokens": 3},
    {"cached_tokens": 3, "cache_write_tokens": 2},
    {"reasoning_tokens": 9, "other": 1},
    MappingProxyType({"cached_tokens": 1, "reasoning_tokens": 1}),
    [1],
    "details",
]


@pytest.mark.parametrize("count", _COUNTS)
@pytest.mark.parametrize("details", _DETAILS)
def test_the_plain_reading_counts_as_read_usage_does(count: Any, details: Any) -> None:
    """`parse_usage` reads a plain object without `read_usage`'s loops: every count and every
    details object of every type gives `read_usage`'s answer, in each place."""
    for place in range(5):
        value: dict[str, Any] = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        name = list(value)[place] if place < 3 else None
        if name is not None:
            value[name] = count
        key = "prompt_tokens_details" if place != 4 else "completion_tokens_details"
        value[key] = details
        if place == 3 and isinstance(details, dict):
            value[key] = {**details, "cached_tokens": count}
        expected = read_usage(value, USAGE_FIELDS)
        got = parse_usage(value)
        assert got == expected
        assert type(got) is UsageDetails
    del value["prompt_tokens"]
    assert parse_usage(value) == read_usage(value, USAGE_FIELDS)
