"""A forwarded stream's reads (`pipeline.providers._forwarding`) against the parsed path's:
the same events decoded (`ForwardedEvents` against `SSEPayloads`), the same failures at the
same event, and one update a read whose fields and contents are what the Chat Completions
stream reader gives for those events, whatever the chunks the bytes come in."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from pipeline._forward import ForwardedUpdate
from pipeline.errors import ProviderError
from pipeline.providers._forwarding import EventShapes, ForwardedReads
from pipeline.types import (
    ChatResponseUpdate,
    FunctionCallContent,
    ReasoningContent,
    TextContent,
    UsageDetails,
)
from pipeline.wire.chat_completions.outbound import StreamAssembler, parse_usage
from pipeline.wire.sse import SSEPayloads

HEAD = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**HEAD, "choices": [choice], **extra}


def sse(events: list[Any], *, compact: bool = False, done: bool = True) -> bytes:
    separators = (",", ":") if compact else (", ", ": ")
    lines = [
        f"data: {e if isinstance(e, str) else json.dumps(e, separators=separators)}\n\n"
        for e in events
    ]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


USAGE = {**HEAD, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
TEXT = [chunk({"role": "assistant", "content": ""})] + [
    chunk({"content": piece}) for piece in ["Hello ", "wörld ", 'say "hi"\\n', "✓", ""]
]
STREAMS: dict[str, bytes] = {
    "text": sse([*TEXT, chunk({}, "stop"), USAGE]),
    "text-compact": sse([*TEXT, chunk({}, "stop"), USAGE], compact=True),
    "reasoning": sse(
        [
            chunk({"reasoning_content": "Think "}),
            chunk({"reasoning_content": "more."}),
            chunk({"reasoning": "Other "}),
            chunk({"content": "Hi."}),
            chunk({}, "stop"),
        ]
    ),
    "tool-calls": sse(
        [
            chunk({"role": "assistant", "content": None}),
            chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f"}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
            chunk({"content": "and text"}),
            chunk({}, "tool_calls"),
            USAGE,
        ]
    ),
    "calls-ended-by-the-stream": sse(
        [chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "g"}}]})]
    ),
    "length": sse([chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk({}, "length")]),
    "usage-null-everywhere": sse(
        [chunk({"content": "a"}, usage=None), chunk({"content": "b"}, usage=None), USAGE]
    ),
    "a-lookalike-after-the-delta": sse(
        [
            chunk({"content": "x"}, extra={"content": "x"}),
            chunk({"content": "x"}, extra={"content": "y"}),
        ]
    ),
    "first-delta-escaped-otherwise": sse(
        [chunk({"content": "wörld"}), chunk({"content": "a"}), chunk({"content": "ö"})]
    ),
    "first-delta-text-also-after-it": sse(
        [chunk({"content": "x"}, note="x"), chunk({"content": "y"}, note="x")]
    ),
    "carriage-returns": sse([chunk({"content": "a"})]).replace(b"\n", b"\r\n"),
    "comments-and-fields": b": ping\n\nevent: message\n" + sse([chunk({"content": "a"})]),
    "multi-line-data": b'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "x"}}]}\n\n'
    + sse([chunk({"content": "y"})]),
    "long-digits": sse(
        [chunk({"content": "a"}, n=12345678901234567890123), chunk({"content": "b"})]
    ),
    "nul-in-text": sse(
        [chunk({"content": "a\u0000"}), chunk({"content": "b"}), chunk({"content": "c"})]
    ),
    "other-choice": sse(
        [chunk({"content": "a"}), {**HEAD, "choices": [{"index": 1, "delta": {"content": "z"}}]}]
    ),
    "malformed-json-mid-stream": sse(
        [chunk({"content": "a"}), chunk({"content": "b"}), '{"choices": [', chunk({"content": "c"})]
    ),
    "not-an-object": sse([chunk({"content": "a"}), "[1, 2]"]),
    "content-not-a-string": sse([chunk({"content": "a"}), chunk({"content": 5})]),
    "in-band-error": sse(
        [chunk({"content": "a"}), {"error": {"message": "boom", "code": "server_error"}}]
    ),
    "not-utf8": sse([chunk({"content": "a"})]) + b'data: {"x": "\xff"}\n\n',
    "after-done": sse([chunk({"content": "a"})]) + b"data: garbage\n\n",
    "no-done": sse([chunk({"content": "a"}), chunk({"content": "b"})], done=False),
    "unfinished-last-event": sse([chunk({"content": "a"})], done=False) + b'data: {"choices": []}',
    # Deltas after the first come as runs, read at once; a run that is not one of plain
    # deltas is read event by event.
    "runs": sse(
        [chunk({"role": "assistant", "content": ""})]
        + [chunk({"content": t}) for t in ["a", "b", "ö", 'q"\\', "✓"]]
        + [chunk({}, "stop"), USAGE]
    ),
    "a-run-with-an-empty-delta": sse(
        [chunk({"content": t}) for t in ["a", "b", "c", "", "d", "e", "f", "g"]]
    ),
    "a-run-with-a-line-end": sse([chunk({"content": t}) for t in ["a", "b", "c", "d"]])
    + b'data: {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m",'
    b' "choices": [{"index": 0, "delta": {"content": "c"}\n, "logprobs": null, "finish_reason":'
    b" null}]}\n\n" + sse([chunk({"content": "d"})]),
    "a-run-broken-by-another-event": sse(
        [chunk({"content": t}) for t in ["a", "b", "c", "d", "e"]]
        + [chunk({"content": "f"}, note="x")]
        + [chunk({"content": t}) for t in ["g", "h", "i", "j", "k"]]
    ),
    "a-run-with-a-malformed-delta": sse([chunk({"content": t}) for t in ["a", "b", "c", "d"]])
    + b'data: {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m",'
    b' "choices": [{"index": 0, "delta": {"content": "c" "x"}, "logprobs": null, "finish_reason":'
    b" null}]}\n\n" + sse([chunk({"content": "d"})]),
}


def parsed(body: bytes, cuts: list[int]) -> tuple[list[Any], list[ChatResponseUpdate], Any]:
    """What the parsed path reads of `body` cut at `cuts`: the payloads, each event's update
    (in order) and the failure (its type and message), or None."""
    decoder, reader = SSEPayloads("p"), StreamAssembler("p")
    payloads: list[Any] = []
    updates: list[ChatResponseUpdate] = []
    try:
        for piece in pieces(body, cuts):
            batch = decoder.feed(piece) if piece else decoder.finish()
            for payload in batch:
                payloads.append(payload)
                update = reader.feed(payload)
                if update is not None:
                    updates.append(update)
            if decoder.failure is not None:
                raise decoder.failure
            if decoder.done:
                break
        tail = reader.finish()
        if tail is not None:
            updates.append(tail)
    except ProviderError as exc:
        return payloads, updates, (type(exc), str(exc))
    return payloads, updates, None


def forwarded(
    body: bytes, cuts: list[int], shapes: EventShapes | None = None
) -> tuple[list[Any], list[ChatResponseUpdate], Any]:
    """The same through `ForwardedReads` (with the client's `shapes`, when given): payloads
    (deltas of a frame and events of a shape decoded back into their events), the updates
    of every read, the failure."""
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True, shapes=shapes)
    payloads: list[Any] = []
    updates: list[ChatResponseUpdate] = []
    try:
        for piece in pieces(body, cuts):
            batch = reads.events.feed(piece) if piece else reads.events.finish()
            payloads += decoded(batch)
            update, failure = reads.read(batch)
            if update is not None:
                updates.append(update)
            if failure is not None:
                raise failure
            if reads.events.failure is not None:
                raise reads.events.failure
            if reads.events.done:
                break
        tail = reads.finish()
        if tail is not None:
            updates.append(tail)
    except ProviderError as exc:
        return payloads, updates, (type(exc), str(exc))
    return payloads, updates, None


def decoded(batch: list[Any]) -> list[Any]:
    """A read's payloads with its deltas of a frame, its runs of those and its events of a
    shape decoded back into their events."""
    events: list[Any] = []
    for payload in batch:
        if type(payload) is tuple:
            events += [json.loads(part[6:]) for part in payload[2].split(b"\n\n")]
        else:
            events.append(payload)
    return events


def pieces(body: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(bounds) if b > a] + [b""]


def merged(updates: list[ChatResponseUpdate]) -> tuple[Any, ...]:
    """What the layers read of a stream: contents in order, the last finish reason, usage
    summed, the last ids."""
    contents = [c for u in updates for c in u.contents]
    finish = [u.finish_reason for u in updates if u.finish_reason is not None]
    usages = [u.usage for u in updates if u.usage is not None]
    usage = None
    for more in usages:
        usage = more if usage is None else usage + more
    ids = [(u.response_id, u.model_id) for u in updates]
    return contents, finish[-1:], usage, ids[-1:]


@pytest.mark.parametrize("name", list(STREAMS))
def test_a_forwarded_stream_reads_as_the_parsed_path_in_any_chunks(name: str) -> None:
    body = STREAMS[name]
    # Whole, cut into single bytes' worth at every point, and a few splits at once.
    cut_sets = [[], *([at] for at in range(1, len(body))), list(range(7, len(body), 23))]
    for cuts in cut_sets:  # bounded: the body's length plus two
        want_payloads, want_updates, want_failure = parsed(body, cuts)
        got_payloads, got_updates, got_failure = forwarded(body, cuts)
        assert got_failure == want_failure, cuts
        assert got_payloads == want_payloads, cuts
        assert merged(got_updates) == merged(want_updates), cuts
        # An update comes at the read where the parsed path's first does, never earlier.
        assert bool(got_updates) == bool(want_updates), cuts


def test_forwarded_contents_are_made_when_read_and_equal_the_parsed_ones() -> None:
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True)
    batch = reads.events.feed(STREAMS["reasoning"])
    update, failure = reads.read(batch)
    assert failure is None and isinstance(update, ForwardedUpdate)
    assert sum(type(p) is tuple for p in batch) == 1  # a delta of a learned frame
    assert update.calls == []
    expected = [
        ReasoningContent("Think "),
        ReasoningContent("more."),
        ReasoningContent("Other "),
        TextContent("Hi."),
    ]
    assert update.contents == expected
    assert update.contents is update.contents  # made once
    assert update.text == "Hi."
    assert update == ChatResponseUpdate(
        contents=expected, response_id="chatcmpl-up", model_id="m", finish_reason="stop"
    )
    update.contents = [TextContent("changed")]
    assert update.text == "changed"


def test_forwarded_tool_calls_are_told_without_making_the_contents() -> None:
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True)
    update, failure = reads.read(reads.events.feed(STREAMS["tool-calls"]))
    assert failure is None and isinstance(update, ForwardedUpdate)
    assert [call.name for call in update.calls] == ["f"]
    assert [type(c) for c in update.contents] == [TextContent, FunctionCallContent]
    assert update.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "first",
    [
        chunk({"content": "Hello "}),  # the string as orjson writes it: found by itself
        chunk({"content": "wörld"}),  # escaped otherwise (json's \u00f6): by the field's name
        chunk({"content": "x"}, note="x"),  # the same string after it: the name, after a probe
        chunk({"content": "m"}),  # the same string before it (the model): found last, itself
    ],
)
def test_a_frame_is_learned_wherever_the_first_delta_puts_its_text(first: Any) -> None:
    """The deltas after the first are read as their one string, and are the events the
    parsed path decodes."""
    extra = {"note": first["note"]} if "note" in first else {}
    later = [chunk({"content": text}, **extra) for text in ["a", "ö", 'q"\\', "z"]]
    body = sse([first, *later])
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True)
    batch = reads.events.feed(body)
    assert [type(p) is tuple for p in batch] == [False, True]  # a run of the four
    assert decoded(batch) == [first, *later]
    assert batch[1][1] == ["a", "ö", 'q"\\', "z"]
    # Read one at a time, each is a delta of its own.
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True)
    batches = [reads.events.feed(part + b"\n\n") for part in body.split(b"\n\n")[:5]]
    assert [[type(p) is tuple for p in batch] for batch in batches] == [[False], *[[True]] * 4]
    assert [batch[0][1] for batch in batches[1:]] == ["a", "ö", 'q"\\', "z"]


def shaped(head: dict[str, Any] | None = None, **extra: Any) -> list[dict[str, Any]]:
    """A stream's role event, a delta, a finish and its usage, with `head`'s fields first."""
    fields = head if head is not None else HEAD
    role = {**fields, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    text = {**fields, "choices": [{"index": 0, "delta": {"content": "Hi."}}]}
    finish = {**fields, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    for event in (role, finish):
        event["choices"][0]["logprobs"] = None
        event.update(extra)
    return [role, text, finish, {**fields, "choices": [], "usage": USAGE["usage"]}]


def written(events: list[dict[str, Any]]) -> bytes:
    return sse(events).replace(b'"id": "chatcmpl-up"', b'"id": "chatcmpl-the-next-one-00"')


# Streams read after the client's streams taught it the shapes of `shaped()`'s role event
# and finish: `True` when their role's event and finish are read as those shapes.
SHAPED: dict[str, tuple[bytes, bool]] = {
    "another-id-and-created": (
        written(shaped({**HEAD, "created": 1_765_000_000})).replace(b"e-00", b"e-0000000"),
        True,
    ),
    "delta-of-another-shape": (
        sse(shaped()).replace(b'{"content": "Hi."}', b'{"content": "Hi.", "refusal": null}'),
        True,
    ),
    "reasoning-delta": (
        sse(shaped()).replace(b'{"content": "Hi."}', b'{"reasoning_content": "Hm."}'),
        True,
    ),
    "delta-then-the-same-delta-escaped": (
        sse(shaped()).replace(b'{"content": "Hi."}', b'{"content": "\\u0048i."}'),
        True,
    ),
    "compact": (sse(shaped(), compact=True), False),
    "a-delta-with-a-field-of-its-own": (  # no frame kept: the field may be this answer's
        sse(shaped()).replace(b'"Hi."}}]', b'"Hi."}}], "echo": "Hi."'),
        True,
    ),  # other bytes: learned, not matched
    "fields-in-another-order": (sse(shaped({"model": "m", **HEAD})), False),
    "created-first": (sse(shaped({"created": 1, **HEAD})), False),
    "one-field-more": (sse(shaped(system_fingerprint="fp")), False),
    "another-model": (sse(shaped({**HEAD, "model": "n"})), False),
    "id-escaped": (sse(shaped()).replace(b'"chatcmpl-up"', b'"chatcmpl-\\u0075p"'), False),
    "id-quoted": (sse(shaped({**HEAD, "id": 'a"b'})), False),
    "id-not-ascii": (sse(shaped({**HEAD, "id": "chatcmpl-ü"})), False),
    "id-not-utf8": (sse(shaped()).replace(b"chatcmpl-up", b"chatcmpl-\xff"), False),
    "id-a-number": (sse(shaped({**HEAD, "id": 5})), False),
    "created-leading-zero": (sse(shaped()).replace(b'"created": 1,', b'"created": 01,'), False),
    "created-19-digits": (sse(shaped({**HEAD, "created": 10**18 + 1})), False),
    "created-negative": (sse(shaped({**HEAD, "created": -1})), False),
    "created-a-float": (sse(shaped()).replace(b'"created": 1,', b'"created": 1.5,'), False),
    "created-huge": (sse(shaped({**HEAD, "created": 10**30})), False),
    "unknown-finish": (sse(shaped()).replace(b'"stop"', b'"thought_too_long"'), True),
    "garbage-before-and-after": (
        b"data: garbage\n\n" + sse(shaped()) + b"data: more garbage\n\n",
        False,
    ),
    "tool-calls-then-finish": (
        sse(
            [
                shaped()[0],
                chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f"}}]}),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
                shaped()[2],
            ]
        ),
        True,
    ),
}


@pytest.mark.parametrize("name", list(SHAPED))
def test_events_of_a_shape_the_client_saw_read_as_the_parsed_path(name: str) -> None:
    body, matched = SHAPED[name]
    shapes = EventShapes()
    for _ in range(2):  # the first stream teaches the shapes; the second leaves them as they are
        assert forwarded(sse(shaped()), [], shapes)[2] is None
    assert len(shapes.by_tail) == 2  # the role's event and the finish
    assert shapes.delta is not None and "Hi." not in repr(shapes.delta)  # no text kept
    assert all(
        b"chatcmpl-up" not in repr(shape.source).encode() for shape in shapes.by_tail.values()
    )
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True, shapes=shapes)
    try:
        batch = reads.events.feed(body)
    except ProviderError:
        batch = []  # the stream's first event is its failure: nothing read as a shape
    assert any(type(p) is tuple and len(p) == 4 for p in batch) is matched
    if name == "another-id-and-created":  # the delta read by the frame the first taught
        assert [len(p) if type(p) is tuple else 0 for p in batch] == [4, 3, 4, 6]
    read_alike_in_any_chunks(body, shapes)
    assert len(shapes.by_tail) <= 4  # a few at most, whatever the streams


def read_alike_in_any_chunks(body: bytes, shapes: EventShapes) -> None:
    """`body` read with `shapes` as the parsed path reads it: whole, cut at every byte,
    and in pieces of 23 bytes."""
    cut_sets = [[], *([at] for at in range(1, len(body))), list(range(7, len(body), 23))]
    for cuts in cut_sets:  # bounded: the body's length plus two
        want_payloads, want_updates, want_failure = parsed(body, cuts)
        got_payloads, got_updates, got_failure = forwarded(body, cuts, shapes)
        assert got_failure == want_failure, cuts
        assert got_payloads == want_payloads, cuts
        assert merged(got_updates) == merged(want_updates), cuts
        assert bool(got_updates) == bool(want_updates), cuts


def test_a_delta_frame_is_kept_for_later_streams_only_of_fields_a_shape_has() -> None:
    own = sse(shaped()).replace(b'"Hi."}}]', b'"Hi."}}], "echo": "Hi."')
    for body, kept in [(own, False), (sse(shaped()), True)]:
        shapes = EventShapes()
        assert forwarded(body, [], shapes)[2] is None
        assert len(shapes.by_tail) == 2
        assert (shapes.delta is not None) is kept


PLAIN_USAGE = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
DETAILED_USAGE = {
    **PLAIN_USAGE,
    "prompt_tokens_details": {"cached_tokens": 2, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 4},
}
NEXT = {**HEAD, "id": "chatcmpl-the-next-one-00", "created": 1_765_000_000}


def with_usage(usage: dict[str, Any] | bytes, head: dict[str, Any] | None = None) -> bytes:
    """`shaped()`'s stream whose usage's event has `usage` (an object, or its bytes as the
    upstream writes them) and `head`'s id and created."""
    fields = {**HEAD, **(head or {})}
    events: list[Any] = [{**event, **fields} for event in shaped()[:3]]
    usage_bytes = usage if isinstance(usage, bytes) else json.dumps(usage).encode()
    last = json.dumps({**fields, "choices": [], "usage": "@"}).encode()
    return sse([*events, last.replace(b'"@"', usage_bytes).decode()])


# A usage's event read after the client's streams taught it their usage's shape: what they
# taught, the bytes of the later stream's usage object, and how it is read: "counts" (its
# digits, by the object's bytes), "object" (its object alone, decoded), None (all of it).
USAGE_READS: dict[str, tuple[dict[str, Any], bytes, str | None]] = {
    "other-counts": (
        PLAIN_USAGE,
        b'{"prompt_tokens": 123456789012345678, "completion_tokens": 0, "total_tokens": 1}',
        "counts",
    ),
    "details": (
        DETAILED_USAGE,
        b'{"prompt_tokens": 30, "completion_tokens": 50, "total_tokens": 80, '
        b'"prompt_tokens_details": {"cached_tokens": 20, "audio_tokens": 1}, '
        b'"completion_tokens_details": {"reasoning_tokens": 40}}',
        "counts",
    ),
    "details-not-taught": (
        PLAIN_USAGE,
        json.dumps(DETAILED_USAGE).encode(),
        "object",
    ),
    "a-detail-more": (
        DETAILED_USAGE,
        json.dumps(
            {**DETAILED_USAGE, "completion_tokens_details": {"reasoning_tokens": 4, "x": 1}}
        ).encode(),
        "object",
    ),
    "compact": (PLAIN_USAGE, json.dumps(PLAIN_USAGE, separators=(",", ":")).encode(), "object"),
    "counts-in-another-order": (
        PLAIN_USAGE,
        b'{"completion_tokens": 5, "prompt_tokens": 3, "total_tokens": 8}',
        "object",
    ),
    "a-key-escaped": (
        PLAIN_USAGE,
        b'{"prompt_\\u0074okens": 3, "completion_tokens": 5, "total_tokens": 8}',
        "object",
    ),
    "a-float-count": (
        PLAIN_USAGE,
        b'{"prompt_tokens": 1.5, "completion_tokens": 5, "total_tokens": 8}',
        "object",
    ),
    "a-negative-count": (
        PLAIN_USAGE,
        b'{"prompt_tokens": -3, "completion_tokens": 5, "total_tokens": 8}',
        "object",
    ),
    "a-string-count": (
        PLAIN_USAGE,
        b'{"prompt_tokens": "3", "completion_tokens": 5, "total_tokens": 8}',
        "object",
    ),
    "a-count-of-19-digits": (  # the digit guard: orjson would read it as a float
        PLAIN_USAGE,
        b'{"prompt_tokens": 1234567890123456789, "completion_tokens": 5, "total_tokens": 8}',
        None,
    ),
    "a-huge-count": (
        PLAIN_USAGE,
        json.dumps({**PLAIN_USAGE, "prompt_tokens": 10**30}).encode(),
        None,
    ),
    "a-leading-zero": (
        PLAIN_USAGE,
        b'{"prompt_tokens": 03, "completion_tokens": 5, "total_tokens": 8}',
        None,
    ),
    "usage-null": (PLAIN_USAGE, b"null", None),
    "usage-a-number": (PLAIN_USAGE, b"7", None),
    "two-objects": (PLAIN_USAGE, b'{"prompt_tokens": 3}, "usage": {"prompt_tokens": 4}', None),
    "not-closed": (PLAIN_USAGE, b'{"prompt_tokens": 3', None),
    "a-field-after-it": (PLAIN_USAGE, json.dumps(PLAIN_USAGE).encode() + b', "x": 1', None),
}


def usage_kinds(batch: list[Any]) -> list[str | None]:
    """How each event of a batch was read: by its usage's counts, its usage object, or
    otherwise (None)."""
    return [
        ("object" if type(p[5]) is dict else "counts") if type(p) is tuple and len(p) == 6 else None
        for p in batch
    ]


@pytest.mark.parametrize("name", list(USAGE_READS))
def test_a_usage_of_a_shape_the_client_saw_reads_as_the_parsed_path(name: str) -> None:
    taught, usage, how = USAGE_READS[name]
    shapes = EventShapes()
    for _ in range(2):  # the first stream teaches the shapes; the second leaves them as they are
        assert forwarded(with_usage(taught), [], shapes)[2] is None
    assert shapes.usage is not None and shapes.usage.counts is not None
    assert b"chatcmpl-up" not in repr(shapes.usage.source).encode()
    assert set(str(shapes.usage.source["usage"])) & set("123456789") == set()  # no count kept
    body = with_usage(usage, NEXT)
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True, shapes=shapes)
    try:
        batch = reads.events.feed(body)
    except ProviderError:
        batch = []
    assert usage_kinds(batch)[-1:] == [how] or (how is None and not batch)
    read_alike_in_any_chunks(body, shapes)


def test_the_usage_read_by_its_counts_is_the_parsed_one_in_every_count() -> None:
    shapes = EventShapes()
    forwarded(with_usage(DETAILED_USAGE), [], shapes)
    usage = USAGE_READS["details"][1]
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True, shapes=shapes)
    batch = reads.events.feed(with_usage(usage, NEXT))
    assert usage_kinds(batch) == [None, None, None, "counts"]
    update, failure = reads.read(batch)
    assert failure is None and update is not None
    assert update.usage == UsageDetails(
        input_tokens=30,
        output_tokens=50,
        total_tokens=80,
        reasoning_tokens=40,
        cache_read_tokens=20,
        cache_write_tokens=None,
    )
    assert update.usage == parse_usage(json.loads(usage))
    assert (update.response_id, update.model_id) == ("chatcmpl-the-next-one-00", "m")


def read_alike(got: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    """Whether two reads of a stream give the same payloads, layers' reads and failure."""
    return (got[0], merged(got[1]), got[2]) == (want[0], merged(want[1]), want[2])


@pytest.mark.parametrize(
    "usage",
    [
        {**PLAIN_USAGE, "note": "v2"},  # digits that are no count
        {**PLAIN_USAGE, "cost": 0.25},  # a number that is no integer
        {**PLAIN_USAGE, "prompt_tokens_details": {"cached_tokens": "2"}},  # a count not one
        {**PLAIN_USAGE, "per_choice": [1, 2]},
        {**PLAIN_USAGE, "prompt_tokens_details": {"by_kind": {"text": 3}}},
        {"prompt_tokens": True, "completion_tokens": 5},
    ],
)
def test_a_usage_the_counts_cannot_be_read_of_is_read_as_its_object(
    usage: dict[str, Any],
) -> None:
    shapes = EventShapes()
    assert forwarded(with_usage(usage), [], shapes)[2] is None
    assert shapes.usage is not None and shapes.usage.counts is None
    body = with_usage(usage, NEXT)
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True, shapes=shapes)
    assert usage_kinds(reads.events.feed(body))[-1] == "object"
    assert read_alike(forwarded(body, [], shapes), parsed(body, []))


@pytest.mark.parametrize(
    "event",
    [
        {**HEAD, "choices": [{"index": 0, "delta": {}}], "usage": PLAIN_USAGE},  # a choice
        {**HEAD, "choices": [], "usage": PLAIN_USAGE, "error": None},
        {**HEAD, "choices": [], "usage": None},
        {**HEAD, "usage": PLAIN_USAGE},  # no choices at all
    ],
)
def test_no_usage_shape_is_learned_of_another_event(event: dict[str, Any]) -> None:
    shapes = EventShapes()
    body = sse([*shaped()[:3], event])
    assert read_alike(forwarded(body, [], shapes), parsed(body, []))
    assert shapes.usage is None


def test_a_usage_shape_that_is_never_proved_is_tried_a_few_times_only() -> None:
    # A brace in a string of the object: the cut that counts braces is never the object.
    shapes = EventShapes()
    body = with_usage(b'{"note": "}", "prompt_tokens": 3}')
    tries = []
    for _ in range(8):  # bounded: eight streams
        tried = shapes._usage_tries
        assert read_alike(forwarded(body, [], shapes), parsed(body, []))
        tries.append(tried - shapes._usage_tries)
    assert shapes.usage is None
    assert tries == [1, 1, 1, 1, 0, 0, 0, 0]
