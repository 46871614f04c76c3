"""The SSE decoder and the chunk assembler: any input yields valid updates or raises
ProviderError, never anything else."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.errors import MalformedSSE, ProviderError
from pipeline.types import ChatResponseUpdate
from pipeline.wire.chat_completions.outbound import StreamAssembler
from pipeline.wire.sse import SSEDecoder


def test_decoder_joins_data_lines_and_skips_comments() -> None:
    decoder = SSEDecoder()
    dispatched: list[tuple[str, str]] = []
    for line in [": keepalive", "event: message", "data: a", "data:b"]:
        decoder.events([line], dispatched)
        assert dispatched == []
    decoder.events([""], dispatched)
    assert dispatched == [("message", "a\nb")]
    decoder.events([""], dispatched)  # a blank line with no data dispatches nothing
    assert dispatched == [("message", "a\nb")]
    # The same lines in one call (one network chunk) give the same events.
    together: list[tuple[str, str]] = []
    SSEDecoder().events([": keepalive", "event: message", "data: a", "data:b", "", ""], together)
    assert together == dispatched


def _decode(lines: list[str]) -> list[ChatResponseUpdate]:
    decoder = SSEDecoder()
    assembler = StreamAssembler("fuzz")
    updates = []
    for line in lines:
        dispatched: list[tuple[str, str]] = []
        try:
            decoder.events([line], dispatched)
        except MalformedSSE:
            raise ProviderError("malformed") from None
        for _, data in dispatched:
            if data == "[DONE]":
                continue
            try:
                payload = json.loads(data)
            except ValueError:
                raise ProviderError("malformed") from None
            update = assembler.feed(payload)
            if update is not None:
                updates.append(update)
    tail = assembler.finish()
    if tail is not None:
        updates.append(tail)
    return updates


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "delta",
                    "content",
                    "tool_calls",
                    "index",
                    "id",
                    "function",
                    "name",
                    "arguments",
                    "finish_reason",
                    "usage",
                    "error",
                    "prompt_tokens",
                    "x",
                ]
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@given(st.lists(st.text(max_size=30), max_size=10))
def test_arbitrary_lines_yield_updates_or_provider_error(lines: list[str]) -> None:
    try:
        updates = _decode(lines)
    except ProviderError:
        return
    assert all(isinstance(u, ChatResponseUpdate) for u in updates)


@given(st.lists(json_values, max_size=6))
def test_arbitrary_json_chunks_yield_updates_or_provider_error(payloads: list[object]) -> None:
    lines = [line for p in payloads for line in (f"data: {json.dumps(p)}", "")]
    try:
        updates = _decode(lines)
    except ProviderError:
        return
    assert all(isinstance(u, ChatResponseUpdate) for u in updates)


async def _lines_of(chunks: list[bytes]) -> list[str]:
    from pipeline.wire.sse import Utf8Lines

    splitter = Utf8Lines("fuzz")
    return [line for chunk in chunks for line in splitter.feed(chunk)] + splitter.finish()


async def test_lines_split_on_every_line_end_even_across_chunks() -> None:
    assert await _lines_of([b"data: a\r", b"\ndata: b\r\n\r", b"\n"]) == ["data: a", "data: b", ""]
    assert await _lines_of([b"x\ry\nz"]) == ["x", "y", "z"]
    # A character split between chunks is joined; U+2028 inside a line is not a line end.
    text = "data: caf\u00e9 \u2028 ok\n".encode()
    assert await _lines_of([text[:9], text[9:]]) == ["data: caf\u00e9 \u2028 ok"]


@given(st.lists(st.binary(max_size=40), max_size=12))
def test_any_bytes_are_payloads_or_a_provider_error(chunks: list[bytes]) -> None:
    from pipeline.wire.sse import SSEPayloads

    payloads = SSEPayloads("fuzz")
    try:
        for chunk in chunks:
            payloads.feed(chunk)
        payloads.finish()
    except ProviderError:
        pass


def test_payloads_end_at_done_and_keep_events_split_across_chunks() -> None:
    from pipeline.wire.sse import SSEPayloads

    payloads = SSEPayloads("test")
    assert payloads.feed(b'data: {"a"') == []
    assert payloads.feed(b": 1}\n\n: keep-alive\n\ndata: [1,") == [{"a": 1}]
    assert payloads.feed(b"2]\n\ndata: [DONE]\n\ndata: 3\n\n") == [[1, 2]]
    assert payloads.done and payloads.feed(b"data: 4\n\n") == [] and payloads.finish() == []

    messages = SSEPayloads("test", end_types=frozenset({"message_stop", "other_stop"}))
    stream = b'data: {"type": "delta"}\n\ndata: {"type": "message_stop"}\n\ndata: 5\n\n'
    # The payload that ends the stream is the last one returned (it may carry the usage).
    assert messages.feed(stream) == [{"type": "delta"}, {"type": "message_stop"}]
    assert messages.done and messages.feed(b"data: 6\n\n") == []


def test_an_unterminated_body_leaves_the_stream_not_done() -> None:
    from pipeline.wire.sse import SSEPayloads

    payloads = SSEPayloads("test")
    assert payloads.feed(b"data: 1\n\ndata: 2") == [1]
    assert payloads.finish() == [] and not payloads.done


def test_characters_split_across_many_chunks_and_bytes_that_are_not_utf8() -> None:
    from pipeline.wire.sse import Utf8Lines

    text = "data: \u00e9\u20ac\U0001f600 ok\n".encode()
    for size in (1, 2, 3):
        splitter = Utf8Lines("test")
        lines = [
            line for i in range(0, len(text), size) for line in splitter.feed(text[i : i + size])
        ]
        assert lines + splitter.finish() == ["data: \u00e9\u20ac\U0001f600 ok"]
    for bad in ([b"data: \xff\n"], [b"data: \xe2\x82", b"x\n"], [b"data: \xe2\x82"]):
        splitter = Utf8Lines("test")
        with pytest.raises(ProviderError) as raised:
            for chunk in bad:
                splitter.feed(chunk)
            splitter.finish()
        assert raised.value.code == "malformed"


def test_event_data_decodes_as_json_loads_does() -> None:
    from pipeline.wire.sse import scan_json

    for data in ('{"a": 1}', ' {"a": 1} ', "[1, 2]\t", '"x"', "3", "NaN"):
        assert scan_json(data) == json.loads(data) or data == "NaN"
    for data in ('{"a": 1} x', "", " ", "{", "nope", '{"a": "\x01"}'):
        try:
            scan_json(data)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{data!r} was taken for JSON")


def test_a_failure_keeps_the_payloads_before_it_and_is_raised_next() -> None:
    from pipeline.wire.sse import SSEPayloads

    payloads = SSEPayloads("test")
    assert payloads.feed(b"data: 1\n\ndata: 2\n\nnot sse\n\ndata: 3\n\n") == [1, 2]
    assert payloads.failure is not None and payloads.failure.code == "malformed"
    with pytest.raises(ProviderError) as raised:
        payloads.feed(b"data: 4\n\n")
    assert raised.value is payloads.failure
    # Nothing completed before the failure: raised at once.
    with pytest.raises(ProviderError):
        SSEPayloads("test").feed(b"data: {\n\n")
    # What follows the end of the stream does not count, bad or not.
    done = SSEPayloads("test")
    assert done.feed(b"data: 1\n\ndata: [DONE]\n\nnot sse\n\n") == [1]
    assert done.done and done.failure is None


def test_valid_events_before_bytes_that_are_not_utf8_come_first() -> None:
    from pipeline.wire.sse import SSEPayloads

    payloads = SSEPayloads("test")
    # One network chunk: two good events, then a byte that is no UTF-8.
    assert payloads.feed(b"data: 1\n\ndata: 2\n\ndata: \xff\n\n") == [1, 2]
    assert payloads.failure is not None and payloads.failure.code == "malformed"
    with pytest.raises(ProviderError):
        payloads.feed(b"data: 3\n\n")
    # With nothing before them, the bad bytes fail at once.
    with pytest.raises(ProviderError) as raised:
        SSEPayloads("test").feed(b"data: \xff\n\n")
    assert raised.value.code == "malformed"


def test_a_line_longer_than_the_bound_fails_as_soon_as_it_passes_it() -> None:
    import tracemalloc

    from pipeline.wire.sse import SSEPayloads

    payloads = SSEPayloads("test", max_line=1_000_000)
    piece = b"x" * 65_536
    fed = 0
    tracemalloc.start()
    try:
        with pytest.raises(ProviderError) as raised:
            payloads.feed(b"data: ")
            for _ in range(800):  # 50 MB, if nothing stopped it
                payloads.feed(piece)
                fed += len(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert raised.value.code == "malformed" and "line longer than" in str(raised.value)
    assert fed < 1_000_000  # the chunk that passed the bound failed
    assert peak < 4_000_000  # the line, about once (and never the 50 MB)


def test_an_event_longer_than_the_bound_fails() -> None:
    from pipeline.wire.sse import SSEPayloads

    payloads = SSEPayloads("test", max_event=100)
    assert payloads.feed(b"data: 1\n\n") == [1]
    with pytest.raises(ProviderError) as raised:
        for _ in range(20):
            payloads.feed(b"data: 12345678\n")
    assert "event longer than 100" in str(raised.value)


def test_lines_split_across_many_chunks_join_as_one() -> None:
    from pipeline.wire.sse import Utf8Lines

    splitter = Utf8Lines("test")
    pieces = [b"data: ", *([b"ab"] * 1000), b"\r", b"\n", b"x\r", b"y", b"\n"]
    lines = [line for piece in pieces for line in splitter.feed(piece)] + splitter.finish()
    assert lines == ["data: " + "ab" * 1000, "x", "y"]


async def test_a_body_that_completes_no_payload_still_lets_a_timeout_fire() -> None:
    import asyncio

    from pipeline.wire.sse import SSEPayloads, next_payloads

    reads = 0

    async def endless_blank_lines() -> bytes:  # never suspends, as a buffered body does
        nonlocal reads
        reads += 1
        if reads > 10_000:
            raise AssertionError("the loop never got a turn")
        return b"\n" * 65_536

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await next_payloads(endless_blank_lines, SSEPayloads("test"))
    assert reads <= 32  # a turn of the loop at least every megabyte
