"""Reading a ``usage`` object (`pipeline.wire._common.read_usage`): a decoded object and any
other mapping read alike, and a count that is not an integer is unknown."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

from pipeline.types import UsageDetails
from pipeline.wire.chat_completions.outbound import parse_usage

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
