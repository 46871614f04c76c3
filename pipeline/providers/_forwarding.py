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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pipeline._forward import DeltaFrame, ForwardedResponse, ForwardedUpdate
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
from pipeline.wire.chat_completions.vocab import REASONING_FIELDS
from pipeline.wire.sse import MAX_LINE, Payloads

if TYPE_CHECKING:
    from pipeline._forward import Forward

if FAST:
    from orjson import dumps as _orjson_dumps
    from orjson import loads as _orjson_loads

__all__ = ["ForwardedEvents", "ForwardedReads", "chat_completions_body", "forwarded_response"]

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
    choices = event.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    if (
        type(choice) is not dict
        or choice.get("finish_reason") is not None
        or choice.get("index", 0) != 0
    ):
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


class ForwardedEvents:
    """The events of a server-sent event stream of JSON objects, read from its bytes where
    every event is one ``data: {...}`` line (a `Payloads`): each event as its decoded object,
    or, when `frames`, a delta of a shape seen before as ``(frame, text, event bytes)``
    (`DeltaFrame`).

    Anything else (a carriage return, another field, a comment, data that orjson does not
    read exactly as ``json.loads`` does, an event longer than a line may be) hands the
    stream from that event on to the decoder `general` makes (an `SSEPayloads`), whose
    answers, failures and limits are then the stream's: an event boundary is a state both
    share."""

    __slots__ = (
        "_frame",
        "_general",
        "_handed",
        "_learnable",
        "_made",
        "_rest",
        "done",
        "failure",
    )

    def __init__(self, general: Callable[[], Payloads], *, frames: bool) -> None:
        self._general = general
        self._made: Payloads | None = None  # `general`'s decoder, once handed the stream
        self._handed = False
        self._rest = b""  # the bytes of an event not complete yet
        self._frame: DeltaFrame | None = None
        self._learnable = _MAX_FRAMES if frames else 0
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
        for index, part in enumerate(parts):
            if frame is not None and part.startswith(frame.head) and part.endswith(frame.tail):
                literal = part[len(frame.head) : len(part) - len(frame.tail)]
                if literal.find(b"\n") < 0:
                    try:
                        text = _orjson_loads(literal)
                    except ValueError:
                        text = None
                    if type(text) is str:
                        payloads.append((frame, text, part))
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

    def __init__(self, reader: _Reader, events: Callable[[], Payloads], *, sse: bool) -> None:
        self._reader = reader
        self._assembler = reader if type(reader) is StreamAssembler else None
        self._held: list[Any] = []
        self.events: Payloads = (
            ForwardedEvents(events, frames=self._assembler is not None)
            if FAST and sse
            else events()
        )
        """The decoder of the stream's body (`events` makes the general one; `sse`: it is
        the plain server-sent events of JSON objects `ForwardedEvents` reads)."""

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
            if type(payload) is tuple:  # a delta of a known frame (`ForwardedEvents`)
                read += 1
                text = payload[1]
                if text:
                    frame = payload[0]
                    pieces.append(text if frame.text else ReasoningContent(text))
                    last = frame.ids
                continue
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
