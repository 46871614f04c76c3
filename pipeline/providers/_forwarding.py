"""A provider's side of the forwarded path (`pipeline._forward`): the client's body sent with
the route's own fields, and a stream's reads turned into updates that keep their events.

`chat_completions_body` is the Chat Completions request a forwarded body becomes: the
route's model and token field, and the stream fields every streamed request carries (usage
asked for, as on the parsed path). `forwarded_response` reads of a whole answer what the
layers read (ids, finish reason, usage) and leaves its message to be made when something
asks for it (`ForwardedResponse`). `ForwardedReads` makes one update of each read of a
forwarded stream that carries anything, keeping its events, and those of the reads before it
that carried nothing, in ``raw_representation``: an update comes exactly where the parsed
path's first one would, so output is committed (and failover ends) at the same event. What
the layers read of every update (finish reason, usage, ids) is read at once; its contents
are made when something asks for them (`ForwardedUpdate`). `ForwardedEvents` reads the
events of a plain server-sent event stream from its bytes, and hands any stream it does not
read exactly so to the general decoder. The details and the reasons: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from itertools import islice
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Protocol

from pipeline._forward import (
    DeltaFrame,
    EventShape,
    ForwardedResponse,
    ForwardedUpdate,
    UsageShape,
)
from pipeline._json_codec import FAST, dumps, orjson_reads
from pipeline.errors import ProviderError
from pipeline.types import (
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    ReasoningContent,
    UsageDetails,
)
from pipeline.wire.chat_completions.outbound import StreamAssembler, parse_usage
from pipeline.wire.chat_completions.vocab import REASONING_FIELDS, USAGE_FIELDS
from pipeline.wire.sse import MAX_LINE, Payloads

if TYPE_CHECKING:
    from pipeline._forward import Forward

if FAST:
    from orjson import dumps as _orjson_dumps
    from orjson import loads as _orjson_loads

__all__ = [
    "EventShapes",
    "ForwardedEvents",
    "ForwardedReads",
    "chat_completions_body",
    "forwarded_response",
]

_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens")


def chat_completions_body(
    forward: Forward,
    *,
    model: str | None,
    max_tokens_field: str,
    max_tokens: int | None,
    stream: bool,
) -> bytes:
    """The forwarded body of a Chat Completions request, as JSON bytes."""
    body = dict(forward.body)
    if model is not None:
        body["model"] = model
    else:
        body.pop("model", None)
    if "max_tokens" in body or "max_completion_tokens" in body:
        for name in _TOKEN_FIELDS:
            body.pop(name, None)
        if max_tokens is not None:
            body[max_tokens_field] = max_tokens
    body.pop("stream", None)
    body.pop("stream_options", None)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return dumps(body)


_REASONING, _OTHER_REASONING = REASONING_FIELDS


def forwarded_response(payload: Any) -> ForwardedResponse | None:
    """The response `parse_response` makes of a whole Chat Completions answer (`payload`,
    decoded), the same in every field, with its message made only when read; None for an
    answer that is not one message of text (tool calls, reasoning, an error, anything
    malformed), which the caller parses whole (and so refuses as `parse_response` does)."""
    if type(payload) is not dict or payload.get("error"):
        return None
    choices = payload.get("choices")
    if type(choices) is not list or not choices:
        return None
    choice = choices[0]
    if type(choice) is not dict:
        return None
    message = choice.get("message")
    if type(message) is not dict or message.get("tool_calls"):
        return None
    text = message.get("content")
    if (text is not None and type(text) is not str) or not (
        message.get(_REASONING) is None and message.get(_OTHER_REASONING) is None
    ):
        return None
    # `str_or_none` inline: three calls cost more than the rest of these checks.
    response_id, model_id = payload.get("id"), payload.get("model")
    finish_reason = choice.get("finish_reason")
    return ForwardedResponse.of(
        text,
        response_id=response_id if isinstance(response_id, str) else None,
        model_id=model_id if isinstance(model_id, str) else None,
        finish_reason=finish_reason if isinstance(finish_reason, str) else None,
        usage=parse_usage(payload.get("usage")),
        raw=payload,
    )


# -- the events of a stream ---------------------------------------------------------------------

_DELTA_TEXTS = {"content": True, "reasoning_content": False, "reasoning": False}
_NUL = b"\\u0000"  # how JSON writes the character a frame's probe puts in the string
_MAX_FRAMES = 4  # frames one stream may learn (its deltas change shape a few times at most)


def _past_blanks(data: bytes, at: int) -> int:
    while data[at : at + 1] == b" " or data[at : at + 1] == b"\t":  # bounded by len(data)
        at += 1
    return at


def _string_end(data: bytes, at: int) -> int:
    """Where the JSON string whose text starts at `at` ends (its closing quote), or -1."""
    while True:  # bounded: each turn starts past the quote the last one found
        end = data.find(b'"', at)
        if end < 0:
            return -1
        escapes = end
        while data[escapes - 1] == 0x5C:  # a backslash; bounded by the opening quote
            escapes -= 1
        if (end - escapes) % 2 == 0:
            return end
        at = end + 1


def _frame_of(part: bytes, event: Any) -> DeltaFrame | None:
    """The frame of a decoded event (`part`: its ``data: `` line), when it is a delta of one
    text or reasoning string and nothing else the layers read (no finish reason, no usage),
    and its bytes are proved to place that string (a probe string in its place decodes as
    the delta's); else None."""
    if type(event) is not dict or event.get("usage") is not None or event.get("error"):
        return None
    choice = _one_choice(event)
    if choice is None or choice.get("finish_reason") is not None:
        return None
    delta = choice.get("delta")
    if type(delta) is not dict or len(delta) != 1:
        return None
    ((key, value),) = delta.items()
    text = _DELTA_TEXTS.get(key)
    if text is None or type(value) is not str or part.find(_NUL) >= 0:
        return None
    # Where the upstream wrote the string as orjson writes it (most do), its last occurrence
    # is found in one search (the probe then proves it is the delta's); else, or when the
    # probe says it is not, the field's name leads to it. A decoded string holds no lone
    # surrogate, so orjson's own encoder writes it.
    written = _orjson_dumps(value)
    start = part.rfind(written)
    if start >= 0:
        end = start + len(written) - 1
        if _placed(part, key, start, end):
            return _frame(part, event, text, start, end)
    token = b'"' + key.encode() + b'"'
    found = part.rfind(token)
    if found < 0:
        return None
    at = _past_blanks(part, found + len(token))
    if part[at : at + 1] != b":":
        return None
    start = _past_blanks(part, at + 1)
    if part[start : start + 1] != b'"':
        return None
    end = _string_end(part, start + 1)
    if end < 0 or not _placed(part, key, start, end):
        return None
    return _frame(part, event, text, start, end)


def _one_choice(event: dict[str, Any]) -> dict[str, Any] | None:
    """The event's one choice, when it has one, of index 0."""
    choices = event.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    return choice if type(choice) is dict and choice.get("index", 0) == 0 else None


def _placed(part: bytes, key: str, start: int, end: int) -> bool:
    """Whether the JSON string from `start` to `end` (its quotes) in `part` is the delta's
    `key` field: a probe string in its place decodes as that field."""
    try:
        probe = _orjson_loads(part[6:start] + b'"' + _NUL + b'"' + part[end + 1 :])
        return bool(probe["choices"][0]["delta"] == {key: "\x00"})
    except (ValueError, LookupError, TypeError):
        return False


def _frame(part: bytes, event: dict[str, Any], text: bool, start: int, end: int) -> DeltaFrame:
    ids = {"id": event.get("id"), "model": event.get("model")}
    return DeltaFrame(part[:start], part[end + 1 :], text, ids, event)


# -- events of a shape every stream repeats ----------------------------------------------------

_MAX_SHAPES = 4  # shapes one client keeps (a role's event, a finish or two)
_CHOICE_FIELDS = frozenset({"index", "delta", "logprobs", "finish_reason"})
_ROLE_DELTA = {"role": "assistant", "content": ""}
# What an id's text may hold to be its own JSON string's bytes: printable ASCII but the
# quote (which ends it) and the backslash (which escapes).
_PLAIN = bytes(code for code in range(0x20, 0x7F) if code not in b'"\\')


class EventShapes:
    """The shapes (`EventShape`) one client's streams repeat, keyed by their bytes after the
    ``created`` number, and the bytes all of them share: `head` (the event up to the text of
    its ``id`` string), `middle` (from that string's closing quote to ``created``'s digits)
    and `after` (the first byte after the digits). At most a few, learned from events
    decoded whole and proved by a probe (another id and created in their places decode as
    the event with those); kept for the client's life, holding no id or number of any
    stream. Its `usage` is the usage's event of its streams (`UsageShape`), learned as its
    shapes are once a stream's bytes through its created are known (`learn_usage`)."""

    __slots__ = ("_usage_tries", "after", "by_tail", "delta", "head", "middle", "usage")

    def __init__(self) -> None:
        self.head = self.middle = self.after = b""
        self.by_tail: dict[bytes, EventShape] = {}
        self.usage: UsageShape | None = None
        """The usage's event of the client's streams, after a stream's ``created`` digits."""
        self._usage_tries = _MAX_SHAPES  # a route whose usage is never proved stops trying
        self.delta: tuple[bytes, bytes, bool, dict[str, Any], str, dict[Any, Any]] | None = None
        """The text deltas' frame of the client's streams, after a stream's ``created``
        digits: its bytes before the string and after it, whether it is text, its event
        (with no id, no created and an empty string), the string's field and what the
        gateway keeps of it (`DeltaFrame.written`)."""

    def learn(self, part: bytes, event: Any) -> EventShape | None:
        """Keep the shape of `event` (decoded from `part`, its ``data: `` line) when it is a
        role's event or a finish of nothing else, of the bytes the others share; the shape
        kept, or None."""
        if type(event) is not dict or "usage" in event or "error" in event:
            return None
        ident, created = event.get("id"), event.get("created")
        if type(ident) is not str or type(created) is not int or not 0 <= created < 10**18:
            return None
        choice = _one_choice(event)
        if (
            choice is None
            or not _CHOICE_FIELDS.issuperset(choice)
            or choice.get("logprobs") is not None
        ):
            return None
        delta, reason = choice.get("delta"), choice.get("finish_reason")
        if not ((reason is None and delta == _ROLE_DELTA) or (type(reason) is str and delta == {})):
            return None
        written = _orjson_dumps(ident)
        start = part.find(written)
        if start < 0 or written.strip(b'"').strip(_PLAIN):
            return None  # not found, or an id a later stream's could not be read as
        end = start + len(written) - 1  # the id's closing quote
        digits = str(created).encode()
        at = part.find(digits, end)
        if at < 0:
            return None
        head, middle, tail = part[: start + 1], part[end:at], part[at + len(digits) :]
        if not tail or (
            self.by_tail and (head != self.head or middle != self.middle or tail[:1] != self.after)
        ):
            return None
        other = 2 if created == 1 else 1
        try:
            probe = _orjson_loads(head[6:] + _NUL + middle + str(other).encode() + tail)
        except ValueError:
            return None
        if probe != {**event, "id": "\x00", "created": other}:
            return None
        if len(self.by_tail) >= _MAX_SHAPES:
            return None
        self.head, self.middle, self.after = head, middle, tail[:1]
        source = {**event, "id": "", "created": 0}  # no stream's own id survives it
        shape = self.by_tail[tail] = EventShape(reason, event.get("model"), source, len(tail))
        return shape

    def learn_delta(self, known: bytes, frame: DeltaFrame) -> None:
        """Keep `frame` (learned by a stream whose events begin `known`, its id and created
        as `match` read them) for the streams after it, when another id and created in their
        places decode as its event with those."""
        event = frame.source
        choice = event["choices"][0]
        ((key, _),) = choice["delta"].items()
        if not _CHOICE_FIELDS.issuperset(choice) or choice.get("logprobs") is not None:
            return
        # Its fields but the delta's are a shape's (what a route's streams share, no text).
        fields = _fields_but_ids(event)
        if all(_fields_but_ids(shape.source) != fields for shape in self.by_tail.values()):
            return
        rest = frame.head[len(known) :]
        other = 2 if event.get("created") == 1 else 1
        probe = self.head + _NUL + self.middle + str(other).encode() + rest
        try:
            decoded = _orjson_loads(probe[6:] + b'"x"' + frame.tail)
        except ValueError:
            return
        source = {**event, "id": "", "created": 0, "choices": [{**choice, "delta": {key: ""}}]}
        if decoded == {
            **source,
            "id": "\x00",
            "created": other,
            "choices": [{**choice, "delta": {key: "x"}}],
        }:
            self.delta = (rest, frame.tail, frame.text, source, key, {})

    def learn_usage(self, known: bytes, part: bytes, event: Any) -> None:
        """Keep the shape of `event` (decoded from `part`, which begins `known`, a stream's
        bytes through its created as `match` read them) when it is a usage's event (no
        choices, a usage object), for the streams after it: when its usage object's bytes
        decode alone as its usage, and a probe id, created and usage in their places decode
        as the event with those."""
        if (
            type(event) is not dict
            or event.get("choices") != []
            or "error" in event
            or type(event.get("usage")) is not dict
            or self._usage_tries <= 0
        ):
            return
        self._usage_tries -= 1
        rest = part[len(known) :]
        name = rest.rfind(b'"usage"')
        if name < 0:
            return
        at = _past_blanks(rest, name + 7)
        if rest[at : at + 1] != b":":
            return
        start = _past_blanks(rest, at + 1)
        end = _object_end(rest, start)
        if end < 0 or end == len(rest):
            return
        other = 2 if event.get("created") == 1 else 1
        before, after = rest[:start], rest[end:]
        probe = (
            self.head
            + _NUL
            + self.middle
            + str(other).encode()
            + before
            + b'"'
            + _NUL
            + b'"'
            + after
        )
        try:
            if _orjson_loads(rest[start:end]) != event["usage"]:
                return
            decoded = _orjson_loads(probe[6:])
        except ValueError:
            return
        if decoded != {**event, "id": "\x00", "created": other, "usage": "\x00"}:
            return
        source = {**event, "id": "", "created": 0, "usage": {}}  # no stream's own counts
        shape = UsageShape(before, after, event.get("model"), source)
        _learn_counts(shape, rest[start:end], event["usage"])
        self.usage = shape

    def frame(self, known: bytes, ident: str) -> DeltaFrame | None:
        """The frame of the text deltas of a stream whose events begin `known` (of the id
        `ident`), when one was learned."""
        learned = self.delta
        if learned is None:
            return None
        rest, tail, text, source, key, written = learned
        choice = source["choices"][0]
        # The gateway writes its own ids and strings into its copy of the event.
        copy = {**source, "choices": [{**choice, "delta": {key: ""}}]}
        return DeltaFrame(
            known + rest, tail, text, {"id": ident, "model": source.get("model")}, copy, written
        )

    def match(self, part: bytes) -> tuple[EventShape, str, bytes, str] | None:
        """``(shape, "", part, id)`` when `part` is an event of a known shape (its id a
        plain string, its created a number of at most 18 digits); else None."""
        at = len(self.head)
        end = part.find(b'"', at)
        if end < 0 or not part.startswith(self.middle, end):
            return None
        digits_at = end + len(self.middle)
        stop = part.find(self.after, digits_at)
        shape = self.by_tail.get(part[stop:]) if stop > 0 else None
        if shape is None:
            return None
        digits, ident = part[digits_at:stop], part[at:end]
        if (
            not digits.isdigit()
            or len(digits) > 18
            or (digits[0] == 0x30 and len(digits) > 1)
            or ident.strip(_PLAIN)
        ):
            return None
        return shape, "", part, ident.decode()


def _object_end(data: bytes, start: int) -> int:
    """Where the JSON object at `start` in `data` ends (past its closing brace), counting
    braces only (its decoding proves the cut), or -1."""
    if data[start : start + 1] != b"{":
        return -1
    depth = 0
    for at in range(start, len(data)):  # bounded by the event's length
        byte = data[at]
        if byte == 0x7B:
            depth += 1
        elif byte == 0x7D:
            depth -= 1
            if not depth:
                return at + 1
    return -1


_COUNT = rb"(0|[1-9][0-9]{0,17})"  # a count as orjson reads it exactly: 18 digits at most
_DIGIT_RUNS = re.compile(rb"[0-9]+")
_COUNT_PROBE = 10**17  # the probe's counts: 10**17 and up, each 18 digits
_COUNT_NAMES = tuple(count.name for count in dataclasses.fields(UsageDetails))
_set_input, _set_output, _set_total, _set_reasoning, _set_cache_read, _set_cache_write = (
    UsageDetails.__dict__[name].__set__  # the slots' own setters: the dataclass is frozen
    for name in _COUNT_NAMES
)


def _learn_counts(shape: UsageShape, value: bytes, usage: dict[str, Any]) -> None:
    """Set `shape`'s `counts`, `slots` and `paths` when `value` (a usage object's bytes,
    `usage` decoded) holds its counts as its only digits (integers, in objects at most one
    deep) and `parse_usage` reads each of its counts as an integer or unknown, proved by a
    probe count in each count's place."""
    paths = _count_paths(usage)
    runs = list(_DIGIT_RUNS.finditer(value))
    if paths is None or not paths or len(runs) != len(paths):
        return
    slots = []
    for name in _COUNT_NAMES:
        path = USAGE_FIELDS[name]
        found: Any = usage
        for key in path:  # bounded: a path is two keys at most
            found = found.get(key) if type(found) is dict else None
        if path in paths:
            slots.append(paths.index(path))
        elif found is None:
            slots.append(-1)  # the null after the counts
        else:
            return  # a count `parse_usage` reads otherwise: decoded as the object it is
    cuts = [0, *(at for run in runs for at in run.span()), len(value)]
    pieces = [value[cuts[at] : cuts[at + 1]] for at in range(0, len(cuts), 2)]
    probe = pieces[0]
    expected = {key: dict(inner) if type(inner) is dict else inner for key, inner in usage.items()}
    for index, (path, piece) in enumerate(zip(paths, pieces[1:], strict=True)):
        probe += str(_COUNT_PROBE + index).encode() + piece
        holder = expected
        for key in path[:-1]:
            holder = holder[key]
        holder[path[-1]] = _COUNT_PROBE + index
    try:
        if _orjson_loads(probe) != expected:
            return
    except ValueError:
        return
    pieces[0] = shape.before + pieces[0]
    pieces[-1] += shape.after
    shape.counts = re.compile(_COUNT.join(re.escape(piece) for piece in pieces))
    shape.slots = tuple(slots)
    shape.paths = tuple(paths)
    for key, inner in expected.items():
        if type(inner) is dict:
            expected[key] = {name: 0 if (key, name) in paths else v for name, v in inner.items()}
        elif (key,) in paths:
            expected[key] = 0
    shape.source["usage"] = expected


def _count_paths(usage: dict[str, Any]) -> list[tuple[str, ...]] | None:
    """The paths of `usage`'s integers, in its order, when it holds them in objects at most
    one deep and no list; else None."""
    paths: list[tuple[str, ...]] = []
    for key, value in usage.items():
        if type(value) is int:
            paths.append((key,))
        elif type(value) is dict:
            for name, count in value.items():
                if type(count) is int:
                    paths.append((key, name))
                elif type(count) is dict or type(count) is list:
                    return None
        elif type(value) is list:
            return None
    return paths


def _usage_of(rest: bytes, shape: UsageShape) -> Any:
    """The usage object of an event whose bytes after its created are `rest`, when they are
    `shape`'s around one JSON object orjson reads exactly; else None."""
    before, after = shape.before, shape.after
    if not (rest.startswith(before) and rest.endswith(after)):
        return None
    value = rest[len(before) : len(rest) - len(after)]
    if value.find(b"\n") >= 0 or not orjson_reads(value):
        return None
    try:
        usage = _orjson_loads(value)
    except ValueError:
        return None
    return usage if type(usage) is dict else None


# The fewest deltas read as a run: a run's steps cost more than the steps of two or three
# deltas read one by one (benchmarks/bench_gateway.py --words measures long runs).
_RUN = 4


def _run(parts: list[bytes], start: int, frame: DeltaFrame, whole: bool) -> Any:
    """The deltas of `frame` from ``parts[start]`` on (`_RUN` at least, each of a text that
    is not empty), read at once as ``(frame, texts, their events' bytes, strings)``, or None
    when fewer come in a row or one of them is not such a delta. `strings` are the texts'
    JSON strings without their quotes where none holds an escape (orjson writes them so,
    then), else None. `whole`: all the read's events from `start` but a few at its end are
    tried as one run first (most reads are that)."""
    made = frame.run
    if made is None:
        head, tail = frame.head + b'"', b'"' + frame.tail  # the frame's, with the quotes
        # (A string is empty where the two overlap.)
        made = frame.run = (
            head,
            tail,
            tail + b"\n\n" + head,
            itemgetter(slice(len(head), -len(tail))),
        )
    head, tail, between, cut = made
    if whole:
        # The read's events but those after the run: a finish, a usage, the end.
        end = len(parts)
        while end > start and not (  # bounded by the read's events
            parts[end - 1].startswith(head) and parts[end - 1].endswith(tail)
        ):
            end -= 1
    else:
        end = _deltas_end(parts, start, head, tail)
    while True:  # bounded: twice at most (the read's events, then the deltas one by one)
        if end - start < _RUN:
            return None
        run = parts[start:end]
        strings = list(map(cut, run))
        events = b"\n\n".join(run)
        # Every event is the frame's bytes around its string when the events are those
        # strings joined by the frame's tail and head, between its head and tail: one
        # comparison, not two tests an event (the deltas found one by one are so).
        if not whole or events == b"".join((head, between.join(strings), tail)):
            break
        whole = False  # not all of them: those from `start` on, one by one
        end = _deltas_end(parts, start, head, tail)
    inner = b'","'.join(strings)
    # No quote but the joins', no escape.
    plain = inner.count(b'"') == 2 * (end - start - 1) and inner.find(b"\\") < 0
    try:
        if plain:
            # One array of the strings, decoded at once (a control character, or bytes
            # that are not UTF-8, fail it as they fail each string).
            texts = _orjson_loads(b"".join((b'["', inner, b'"]')))
        else:  # each string by itself (each is one JSON string, then, or fails)
            texts = list(map(_orjson_loads, map(b'"%s"'.__mod__, strings)))
    except ValueError:
        return None
    if not all(texts):
        return None  # an empty one (the parsed path writes none)
    return (frame, texts, events, strings if plain else None)


def _deltas_end(parts: list[bytes], start: int, head: bytes, tail: bytes) -> int:
    """The index of the first of `parts` from `start` on that is not `head` and `tail`
    around a string."""
    end = start
    while end < len(parts) and parts[end].startswith(head) and parts[end].endswith(tail):
        end += 1  # bounded by the read's events
    return end


def _skip(items: Iterator[Any], count: int) -> None:
    """Move `items` on by `count` items."""
    next(islice(items, count, count), None)


def _fields_but_ids(event: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in event.items() if key not in ("id", "created", "choices")}


class ForwardedEvents:
    """The events of a server-sent event stream of JSON objects, read from its bytes where
    every event is one ``data: {...}`` line (a `Payloads`): each event as its decoded object,
    or, when `frames`, a delta of a shape seen before as ``(frame, text, event bytes)``
    (`DeltaFrame`; a run of them in a row as one, `_run`), and, given `shapes`, an event of
    a shape the client's streams repeat as ``(shape, "", event bytes, id)`` (`EventShape`)
    and their usage's event as ``(shape, "", event bytes, id, usage, counts)``
    (`UsageShape`).

    Anything else (a carriage return, another field, a comment, data that orjson does not
    read exactly as ``json.loads`` does, an event longer than a line may be) hands the
    stream from that event on to the decoder `general` makes (an `SSEPayloads`), whose
    answers, failures and limits are then the stream's: an event boundary is a state both
    share."""

    __slots__ = (
        "_frame",
        "_general",
        "_handed",
        "_ident",
        "_known",
        "_learnable",
        "_made",
        "_rest",
        "_shapes",
        "done",
        "failure",
    )

    def __init__(
        self,
        general: Callable[[], Payloads],
        *,
        frames: bool,
        shapes: EventShapes | None = None,
    ) -> None:
        self._general = general
        self._shapes = shapes if frames else None
        self._made: Payloads | None = None  # `general`'s decoder, once handed the stream
        self._handed = False
        self._rest = b""  # the bytes of an event not complete yet
        self._frame: DeltaFrame | None = None
        self._learnable = _MAX_FRAMES if frames else 0
        self._known = b""  # the bytes its events of a known shape begin with, through created
        self._ident = ""  # the id those hold
        self.done = False
        self.failure: ProviderError | None = None

    def feed(self, chunk: bytes) -> list[Any]:
        if self._made is not None:
            return self._from_general(self._made.feed, chunk, [])
        if self.done:
            return []
        data = self._rest + chunk if self._rest else chunk
        if data.find(b"\r") >= 0 or len(data) > MAX_LINE:
            return self._hand_over(data, [])
        parts = data.split(b"\n\n")
        self._rest = parts.pop()
        payloads: list[Any] = []
        frame = self._frame
        shapes = self._shapes
        last = len(parts) - _RUN  # the last event a run may start at (-1: no more runs)
        whole = True  # no run tried yet: the read's events tried as one
        indexed = enumerate(parts)
        for index, part in indexed:
            if frame is not None and part.startswith(frame.head):
                if index <= last and parts[index + _RUN - 1].startswith(frame.head):
                    run = _run(parts, index, frame, whole)
                    whole = False
                    if run is None:
                        last = -1  # not a run: the read's deltas from here one by one
                    else:
                        payloads.append(run)
                        _skip(indexed, len(run[1]) - 1)
                        continue
                if part.endswith(frame.tail):
                    literal = part[len(frame.head) : len(part) - len(frame.tail)]
                    if literal.find(b"\n") < 0:
                        try:
                            text = _orjson_loads(literal)
                        except ValueError:
                            text = None
                        if type(text) is str:
                            payloads.append((frame, text, part))
                            continue
            if shapes is not None and shapes.by_tail:
                known = self._known
                if known and part.startswith(known):
                    rest = part[len(known) :]
                    shape = shapes.by_tail.get(rest)
                    if shape is not None:
                        payloads.append((shape, "", part, self._ident))
                        continue
                    counted = shapes.usage
                    if counted is not None:
                        counts = counted.counts
                        found = counts.fullmatch(rest) if counts is not None else None
                        if found is not None:
                            digits = found.groups()
                            # Each count's digits as orjson reads them (18 at most), and
                            # null for the counts the object has not.
                            values = _orjson_loads(b"[%s,null]" % b",".join(digits))
                            usage = _new_object(UsageDetails)
                            at_input, at_output, at_total, at_reasoning, at_read, at_write = (
                                counted.slots
                            )
                            _set_input(usage, values[at_input])
                            _set_output(usage, values[at_output])
                            _set_total(usage, values[at_total])
                            _set_reasoning(usage, values[at_reasoning])
                            _set_cache_read(usage, values[at_read])
                            _set_cache_write(usage, values[at_write])
                            payloads.append((counted, "", part, self._ident, usage, digits))
                            continue
                        raw = _usage_of(rest, counted)
                        if raw is not None:
                            details = parse_usage(raw)  # a dict's: never None
                            payloads.append((counted, "", part, self._ident, details, raw))
                            continue
                elif part.startswith(shapes.head):
                    shaped = shapes.match(part)
                    if shaped is not None:
                        payloads.append(shaped)
                        known = self._known = part[: len(part) - shaped[0].size]
                        self._ident = shaped[3]
                        if frame is None and self._learnable:
                            frame = self._frame = shapes.frame(known, shaped[3])
                        continue
            if part[:7] == b"data: {" and part.find(b"\n") < 0 and orjson_reads(part):
                try:
                    payload = _orjson_loads(part[6:])
                except ValueError:
                    pass  # not JSON to orjson: the general decoder says what it is
                else:
                    payloads.append(payload)
                    if self._learnable:
                        learned = _frame_of(part, payload)
                        if learned is not None:
                            frame = self._frame = learned
                            self._learnable -= 1
                            if (
                                shapes is not None
                                and shapes.delta is None
                                and self._known
                                and learned.head.startswith(self._known)
                            ):
                                shapes.learn_delta(self._known, learned)
                        elif shapes is not None:
                            if len(shapes.by_tail) < _MAX_SHAPES:
                                shape = shapes.learn(part, payload)
                                if shape is not None and not self._known:
                                    self._known = part[: len(part) - shape.size]
                                    self._ident = payload["id"]
                            if (
                                shapes.usage is None
                                and self._known
                                and "usage" in payload
                                and part.startswith(self._known)
                            ):
                                shapes.learn_usage(self._known, part, payload)
                    continue
            elif part == b"data: [DONE]":
                self.done = True
                return payloads  # what follows the end does not count, bad or not
            elif not part:
                continue  # more blank lines between events
            return self._hand_over(b"\n\n".join([*parts[index:], self._rest]), payloads)
        return payloads

    def finish(self) -> list[Any]:
        if self._made is not None:
            made = self._made
            return self._from_general(lambda _: made.finish(), b"", [])
        if self.done:
            return []
        rest, self._rest = self._rest, b""
        general = self._made = self._general()
        # `rest` holds no blank line: fed, it completes no event, and its end decides.
        return self._from_general(lambda _: general.feed(rest) or general.finish(), b"", [])

    def _hand_over(self, data: bytes, payloads: list[Any]) -> list[Any]:
        self._rest = b""
        general = self._made = self._general()
        return self._from_general(general.feed, data, payloads)

    def _from_general(
        self, feed: Callable[[bytes], list[Any]], data: bytes, payloads: list[Any]
    ) -> list[Any]:
        """`payloads` and what `feed(data)` completes (`feed` is the general decoder's); a
        failure after payloads is kept in `failure`, as `SSEPayloads` keeps it."""
        try:
            payloads += feed(data)
        except ProviderError as exc:
            if not payloads:
                raise
            self.failure = exc
        else:
            self.failure = self._made.failure if self._made is not None else None
        self.done = self._made is not None and self._made.done
        return payloads


# -- the updates of a stream --------------------------------------------------------------------


class _Reader(Protocol):
    """A format's stream reader (`pipeline.providers._base.StreamReader`)."""

    def feed(self, payload: Any) -> ChatResponseUpdate | None: ...
    def finish(self) -> ChatResponseUpdate | None: ...


_new_object = object.__new__
_ASSISTANT = ChatRole.ASSISTANT
_NO_DELTA: dict[str, Any] = {}


def _update(
    pieces: list[Any],
    calls: list[FunctionCallContent],
    last: Any,
    finish: str | None,
    usage: UsageDetails | None,
    events: list[Any],
) -> ForwardedUpdate:
    update: ForwardedUpdate = _new_object(ForwardedUpdate)
    update._pieces = pieces
    update._calls = calls
    update.role = _ASSISTANT
    response_id = last.get("id")
    model_id = last.get("model")
    update.response_id = response_id if type(response_id) is str else None
    update.model_id = model_id if type(model_id) is str else None
    update.finish_reason = finish
    update.usage = usage
    update.value = None
    update.raw_representation = events
    return update


class ForwardedReads:
    """One forwarded stream's reads as updates (see the module docstring).

    With the Chat Completions stream reader (`StreamAssembler`), an event of the common
    shape (text or reasoning in its delta, a finish reason, usage) is read here, as the
    reader would read it, without making its contents; the others (tool-call pieces, a
    finish with calls pending, an error, anything the reader would refuse) go to the reader.
    With any other reader, every event does."""

    __slots__ = ("_assembler", "_held", "_reader", "events")

    def __init__(
        self,
        reader: _Reader,
        events: Callable[[], Payloads],
        *,
        sse: bool,
        shapes: EventShapes | None = None,
    ) -> None:
        self._reader = reader
        self._assembler = reader if type(reader) is StreamAssembler else None
        self._held: list[Any] = []
        self.events: Payloads = (
            ForwardedEvents(events, frames=self._assembler is not None, shapes=shapes)
            if FAST and sse
            else events()
        )
        """The decoder of the stream's body (`events` makes the general one; `sse`: it is
        the plain server-sent events of JSON objects `ForwardedEvents` reads; `shapes`:
        the client's `EventShapes`, which it learns and reads)."""

    def read(self, payloads: list[Any]) -> tuple[ChatResponseUpdate | None, Exception | None]:
        """The update of one read's events (None when they carry nothing yet), and the
        failure an event was (the events before it are the update's)."""
        assembler = self._assembler
        feed = self._reader.feed
        pieces: list[Any] = []
        calls: list[FunctionCallContent] = []
        finish: str | None = None
        usage: UsageDetails | None = None
        last: Any = None  # the last event that carried anything: the ids are its
        failure: Exception | None = None
        read = 0
        for payload in payloads:
            if type(payload) is tuple:  # a delta of a known frame, or an event of a known shape
                text = payload[1]
                if text:
                    read += 1
                    frame = payload[0]
                    if type(text) is str:
                        pieces.append(text if frame.text else ReasoningContent(text))
                    else:  # a run of the frame's deltas: their texts
                        pieces += text if frame.text else map(ReasoningContent, text)
                    last = frame.ids
                    continue
                if len(payload) == 6:  # (`UsageShape`, "", bytes, id, usage, counts)
                    read += 1
                    more = payload[4]
                    if more is not None:
                        usage = more if usage is None else usage + more
                        last = {"id": payload[3], "model": payload[0].model}
                    continue
                if len(payload) != 4 or payload[0].finish is None:
                    read += 1
                    continue  # an empty delta, or a role's event: nothing carried
                if assembler is None or not assembler.pending_calls:
                    read += 1
                    finish = payload[0].finish
                    last = {"id": payload[3], "model": payload[0].model}
                    continue
                payload = _orjson_loads(payload[2][6:])  # a finish the reader completes calls of
            if assembler is not None and type(payload) is dict and not payload.get("error"):
                choices = payload.get("choices")
                plain = True
                reasoning = text = reason = None
                if choices:
                    choice = choices[0] if type(choices) is list else None
                    if type(choice) is dict and choice.get("index", 0) == 0:
                        delta = choice.get("delta") or _NO_DELTA
                        reason = choice.get("finish_reason")
                        if (
                            type(delta) is not dict
                            or "tool_calls" in delta
                            or (
                                reason is not None
                                and (type(reason) is not str or assembler.pending_calls)
                            )
                        ):
                            plain = False  # the reader says what it is
                        else:
                            reasoning = delta.get("reasoning_content")
                            if reasoning is None:
                                reasoning = delta.get("reasoning")
                            text = delta.get("content")
                            plain = (reasoning is None or type(reasoning) is str) and (
                                text is None or type(text) is str
                            )
                    else:
                        plain = False
                elif choices is not None and type(choices) is not list:
                    plain = False
                if plain:
                    read += 1
                    carried = False
                    if reasoning:
                        pieces.append(ReasoningContent(reasoning))
                        carried = True
                    if text:
                        pieces.append(text)
                        carried = True
                    if reason is not None:
                        finish = reason
                        carried = True
                    raw_usage = payload.get("usage")
                    if raw_usage is not None:
                        more = parse_usage(raw_usage)
                        if more is not None:
                            usage = more if usage is None else usage + more
                            carried = True
                    if carried:
                        last = payload
                    continue
            try:
                update = feed(payload)
            except Exception as exc:  # a failure after the events before it, as parsed
                failure = exc
                break
            read += 1
            if update is not None:
                for content in update.contents:
                    pieces.append(content)
                    if type(content) is FunctionCallContent:
                        calls.append(content)
                if update.finish_reason is not None:
                    finish = update.finish_reason
                if update.usage is not None:
                    usage = update.usage if usage is None else usage + update.usage
                last = {"id": update.response_id, "model": update.model_id}
        held = self._held
        if read == len(payloads):
            held = payloads if not held else held + payloads
        else:
            held = held + payloads[:read]
        if last is None:
            self._held = held
            return None, failure
        self._held = []
        return _update(pieces, calls, last, finish, usage, held), failure

    def finish(self) -> ChatResponseUpdate | None:
        """What is still pending once the stream ended (the format reader's), with the
        events held for it."""
        tail = self._reader.finish()
        if tail is not None:
            tail.raw_representation = self._held
            self._held = []
        return tail
