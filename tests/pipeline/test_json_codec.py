"""`pipeline._json_codec`: the standard library's answers whether orjson does the work or
not (the fallback is the module loaded with orjson made unimportable), and the gateway's
forwarded path off for a body orjson would not write back as it came."""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import importlib.util
import json
import re
import sys
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipeline._json_codec as fast
from pipeline._json import decoded_exactly, json_body
from pipeline.gateway._forwarding import CHAT_FORWARDER
from pipeline.gateway.wire import parse_request


@pytest.fixture(scope="module")
def fallback() -> ModuleType:
    """The module as it loads without orjson."""
    saved = sys.modules.get("orjson")
    sys.modules["orjson"] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        spec = importlib.util.find_spec("pipeline._json_codec")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["orjson"]
        else:
            sys.modules["orjson"] = saved
    return module


def test_orjson_does_the_work_when_installed(fallback: ModuleType) -> None:
    assert fast.FAST and not fallback.FAST
    with pytest.raises(ValueError, match="orjson is not installed"):
        fallback.fast_loads(b"{}")


# JSON values without floats: both write those byte for byte as the standard library does.
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text()
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
COMPACT = {"separators": (",", ":"), "ensure_ascii": False}


def _fits_64_bits(value: Any) -> bool:
    if type(value) is int:
        return -(2**63) <= value < 2**64
    if isinstance(value, list):
        return all(_fits_64_bits(item) for item in value)
    if isinstance(value, dict):
        return all(_fits_64_bits(item) for item in value.values())
    return True


@given(value=VALUES)
def test_dumps_writes_what_the_standard_library_writes(value: Any, fallback: ModuleType) -> None:
    for module in (fast, fallback):
        assert module.dumps(value) == json.dumps(value, **COMPACT).encode()


@given(value=VALUES)
def test_loads_reads_what_the_standard_library_reads(value: Any, fallback: ModuleType) -> None:
    text = json.dumps(value)
    for module in (fast, fallback):
        assert module.loads(text) == module.loads(text.encode()) == json.loads(text)
    decoded, exact = fast.loads_exact(text)
    assert decoded == json.loads(text) and type(decoded) is type(json.loads(text))
    if exact:  # written back as it came
        assert json.loads(fast.dumps(decoded)) == value and _fits_64_bits(value)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_float_written_reads_back_as_itself(number: float) -> None:
    assert json.loads(fast.dumps({"x": number})) == {"x": number}


@pytest.mark.parametrize(
    ("text", "exact"),
    [
        ('{"a": 1}', True),
        ('{"a": 18446744073709551616}', False),  # 2**64: orjson would read a float
        ('{"a": -9223372036854775809}', False),  # below -2**63: the same
        ('{"a": 18446744073709551615}', False),  # 20 digits: the standard library reads it
        ('{"a": NaN}', False),  # the standard library's token, which orjson refuses
        ('["\\ud800"]', False),  # a lone surrogate
    ],
)
def test_what_orjson_refuses_is_read_by_the_standard_library(text: str, exact: bool) -> None:
    value, flag = fast.loads_exact(text)
    assert flag is exact
    assert json.dumps(value) == json.dumps(json.loads(text))


@given(
    st.lists(
        st.one_of(st.binary(max_size=8), st.sampled_from([b"0", b"9", b"12345", b"\xb9", b"\x00"])),
        max_size=40,
    )
)
def test_a_run_of_19_digits_is_found_in_bytes_as_in_text(parts: list[bytes]) -> None:
    data = b"".join(parts)
    expected = re.search(rb"[0-9]{19}", data) is None
    assert fast.orjson_reads(data) is expected
    assert fast.orjson_reads(data.decode("latin-1")) is expected


@pytest.mark.parametrize(
    ("data", "reads"),
    [
        (b'{"a": 123456789012345678}', True),  # 18 digits
        (b'{"a": 1234567890123456789}', False),  # 19
        (b'"x1234567890123456789y"', False),  # in a string too
        (b"123456789012345678 9", True),
    ],
)
def test_long_runs_of_digits_go_to_the_standard_library(data: bytes, reads: bool) -> None:
    assert fast.orjson_reads(data) is reads


@pytest.mark.parametrize(
    ("text", "reads"),
    [
        ('{"a": "\u00e9", "b": 123456789012345678}', True),  # text beyond ASCII, 18 digits
        ('{"a": "\u00e9", "b": 1234567890123456789}', False),
        ('["\ud800", 12]', True),  # a lone surrogate (no UTF-8): searched as text
        ('["\ud800", 1234567890123456789]', False),
    ],
)
def test_text_is_searched_for_long_runs_of_digits_as_its_bytes_are(text: str, reads: bool) -> None:
    assert fast.orjson_reads(text) is reads


@pytest.mark.parametrize("text", ["", "{", '{"a": 1} x', "nul", "[1,]"])
def test_what_is_not_json_is_a_value_error_either_way(text: str, fallback: ModuleType) -> None:
    for module in (fast, fallback):
        with pytest.raises(ValueError):
            module.loads(text)


def test_values_orjson_cannot_write_go_through_the_standard_library(
    fallback: ModuleType,
) -> None:
    for value in ({"big": 2**70}, {1: "a key that is no string"}):
        expected = json.dumps(value, **COMPACT).encode()
        assert fast.dumps(value) == fallback.dumps(value) == expected


BODY = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": %s}'


@pytest.mark.parametrize(
    ("seed", "forwards"), [("7", True), ("18446744073709551616", False), ("NaN", False)]
)
async def test_a_body_orjson_would_not_write_back_is_not_forwarded(
    seed: str, forwards: bool
) -> None:
    async def parse() -> tuple[bool, Any]:
        body = (BODY % seed).encode()
        value = json_body(body)  # as the gateway reads it, in the request's context
        request = parse_request(body) if seed != "NaN" else None
        forwarded = request is not None and CHAT_FORWARDER.forward(request) is not None
        assert value["seed"] == json.loads(body)["seed"] or seed == "NaN"
        return decoded_exactly(), forwarded

    # A task in a fresh context, as each request has (not a copy of this test's, which an
    # earlier test may have marked inexact).
    exact, forwarded = await asyncio.create_task(parse(), context=contextvars.Context())
    assert exact is forwards
    assert forwarded is forwards
