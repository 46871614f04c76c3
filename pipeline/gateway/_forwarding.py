"""The gateway's side of the forwarded path (`pipeline._forward`) for Chat Completions: a
body the route may get as the client wrote it, and the provider's own answer written back
with the gateway's ids, byte for byte what the parsed path would write where it can be.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline._forward import (
    CHAT_COMPLETIONS,
    DeltaFrame,
    EventShape,
    Forward,
    ForwardedUpdate,
    UsageShape,
)
from pipeline._json import decoded_exactly
from pipeline._json_codec import FAST, dumps, loads
from pipeline.gateway._shared import StreamEncoder
from pipeline.types import ChatResponseUpdate, FinishReason, FunctionCallContent, UsageDetails
from pipeline.wire import ChatRequest, WireError
from pipeline.wire.chat_completions.inbound import finish_reason, usage_payload

if FAST:
    from orjson import dumps as _orjson_dumps

__all__ = ["CHAT_FORWARDER", "ChatForwarder", "ForwardedChunks"]

# What `parse_request` accepts and drops: the caller's and the storage's fields.
_NOT_SENT = frozenset(
    {"store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key"}
)
# A body of only these fields (none of them null) goes as it is.
_AS_IS = frozenset({"model", "messages", "stream"})
_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_CALL_FIELDS = frozenset({"id", "type", "function"})
_FUNCTION_FIELDS = frozenset({"name", "arguments"})
_FINISH_REASONS = frozenset(reason.value for reason in FinishReason)
_EMPTY_TEXT = {"content": ""}
_DONE = b"data: [DONE]\n\n"
_PROBE = b'"\\u0000"'  # the string "\x00" as JSON, which no other string of a frame holds
# A created number in a shape's bytes, cut out there: written once, or the shape is not cut.
_CREATED_PROBE = 918_273_645_546_372_819
_CREATED_PROBE_BYTES = str(_CREATED_PROBE).encode()
_USAGE_PROBE = b'"\\u0001"'  # the string "\x01" as JSON, in a usage shape's object's place
_TEXT_PROBE = b'"\\u0002"'  # the string "\x02" as JSON, in a shared frame's delta's place


def _sent_unchanged(message: Any) -> bool:
    """Whether the parsed path would send `message` as it is (up to JSON spacing)."""
    if type(message) is not dict or not _MESSAGE_FIELDS.issuperset(message):
        return False
    if message.get("role") not in _ROLES:
        return False
    content = message.get("content")
    if type(content) is not str and not (content is None and message["role"] == "assistant"):
        return False
    name = message.get("name")
    if name is not None and (type(name) is not str or not name):
        return False
    calls = message.get("tool_calls")
    if calls is not None:
        for call in calls:
            if type(call) is not dict or not _CALL_FIELDS.issuperset(call):
                return False
            function = call.get("function")
            if type(function) is not dict or not _FUNCTION_FIELDS.issuperset(function):
                return False
            if type(function.get("arguments")) is not str or type(call.get("id")) is not str:
                return False
    return True


class ChatForwarder:
    """The forwarded path of the Chat Completions format (see the module docstring)."""

    def forward(self, request: ChatRequest) -> Forward | None:
        """The request's `Forward`, or None when its body cannot go as it came."""
        payload = request.body
        if payload is None or not decoded_exactly():
            return None
        if request.plain_messages:  # the parse saw each message was of the plain shape
            if _AS_IS.issuperset(payload) and payload.get("stream", False) is not None:
                # Nothing to leave out: the body itself (the provider sends a copy).
                return Forward(CHAT_COMPLETIONS, payload, request.messages, request.options)
        else:
            for message in payload["messages"]:
                if not _sent_unchanged(message):
                    return None
        body = {
            key: value
            for key, value in payload.items()
            if value is not None and key not in _NOT_SENT
        }
        if not body.get("tools"):  # none offered: no choice among them either
            body.pop("tools", None)
            body.pop("tool_choice", None)
        if body.get("stop") == []:
            del body["stop"]
        return Forward(CHAT_COMPLETIONS, body, request.messages, request.options)

    def completion(
        self, payload: Any, request: ChatRequest, *, response_id: str, created: int
    ) -> bytes | None:
        """The provider's answer with the gateway's id, or None to write the parsed one."""
        choices = payload.get("choices")
        if type(choices) is not list or len(choices) != 1:
            return None
        choice = choices[0]
        message = choice.get("message")
        model = payload.get("model")
        if (
            choice.get("finish_reason") not in _FINISH_REASONS
            or type(message) is not dict
            or "reasoning" in message
            or type(model) is not str
            or not model
        ):
            return None
        if "refusal" not in message:  # the parsed path always writes it, after the content
            role, content = message.pop("role", "assistant"), message.pop("content", None)
            choice["message"] = {"role": role, "content": content, "refusal": None, **message}
        payload["id"] = response_id
        payload["created"] = created
        return dumps(payload)

    def encoder(
        self,
        parsed: Callable[[], StreamEncoder],
        request: ChatRequest,
        *,
        model: str,
        response_id: str,
        created: int,
    ) -> StreamEncoder:
        """The encoder of a stream whose updates may carry the provider's events."""
        return ForwardedChunks(
            parsed,
            model=model,
            response_id=response_id,
            created=created,
            include_usage=request.include_usage,
        )


CHAT_FORWARDER = ChatForwarder()


class ForwardedChunks:
    """A Chat Completions stream of forwarded events (see the module docstring); a stream
    of parsed updates goes to the encoder `parsed` makes, made when the first such update
    comes (most forwarded streams have none)."""

    __slots__ = (
        "_called_tools",
        "_calls_primed",
        "_created",
        "_finish",
        "_finished",
        "_frame",
        "_frame_bytes",
        "_id",
        "_ids",
        "_include_usage",
        "_make_parsed",
        "_model",
        "_parsed",
        "_raw",
        "_run_bytes",
        "_usage",
        "_usage_sent",
    )

    def __init__(
        self,
        parsed: Callable[[], StreamEncoder],
        *,
        model: str,
        response_id: str,
        created: int,
        include_usage: bool,
    ) -> None:
        self._make_parsed = parsed
        self._parsed: StreamEncoder | None = None
        self._model = model
        self._id = response_id
        self._created = created
        self._include_usage = include_usage
        self._raw = False  # an update carried events
        self._finished = False  # a finish chunk was written
        self._usage_sent = False
        self._finish: str | None = None
        self._usage: UsageDetails | None = None
        self._called_tools = False
        self._calls_primed = False  # the parsed encoder knows its role chunk went out
        self._frame: DeltaFrame | None = None  # the frame of the last delta written
        self._frame_bytes: tuple[bytes, bytes] | None = None  # what goes around its strings
        # What goes before, between and after a run's strings (of no escape), once made.
        self._run_bytes: tuple[bytes, bytes, bytes] | None = None
        # The id and created as the shapes' and frames' bytes take them.
        self._ids = (dumps(response_id), b"%d" % created)

    def update(self, update: ChatResponseUpdate) -> str | bytes:
        events = update.raw_representation
        if events is None:
            return self._parsed_encoder().update(update)
        self._raw = True
        if update.finish_reason is not None:
            self._finish = update.finish_reason
        if update.usage is not None:
            self._usage = update.usage if self._usage is None else self._usage + update.usage
        if type(update) is ForwardedUpdate:
            calls = update.calls  # its contents stay unmade
        else:
            calls = [c for c in update.contents if type(c) is FunctionCallContent]
        if calls:
            self._called_tools = True
        out: list[bytes] = []
        for event in events:
            if type(event) is tuple:  # a delta of a known frame, or an event of a known shape
                text = event[1]
                # (`DeltaFrame`, text, bytes), or a run's (`DeltaFrame`, texts, bytes, strings)
                if text:
                    frame = event[0]
                    if frame is not self._frame:
                        self._learn(frame)
                    if self._frame_bytes is not None:
                        head, tail = self._frame_bytes
                        # orjson's own encoder: a frame's text is orjson's decoding (frames
                        # are read only when orjson is there): it holds no lone surrogate.
                        if type(text) is str:
                            out.append(head + _orjson_dumps(text) + tail)
                        elif event[3] is not None:  # a run's strings, as orjson writes them
                            around = self._run_bytes
                            if around is None:
                                around = self._run_bytes = (
                                    head + b'"',
                                    b'"' + tail + head + b'"',
                                    b'"' + tail,
                                )
                            out += (around[0], around[1].join(event[3]), around[2])
                        else:  # a run
                            out += (head, (tail + head).join(map(_orjson_dumps, text)), tail)
                        continue
                    if type(text) is not str:  # a run this stream cannot cut: each event
                        for part in event[2].split(b"\n\n"):  # bounded: the run's events
                            calls = self._event(loads(part[6:]), calls, out)
                        continue
                elif len(event) == 4:  # (`EventShape`, "", bytes, id)
                    shape = event[0]
                    written = shape.written
                    if written is None:
                        written = shape.written = _shape_bytes(shape)
                    if written:
                        if shape.finish is not None:
                            if calls:
                                out.append(self._whole_calls(calls))
                                calls = []
                            self._finished = True
                        ids = self._ids
                        out.append(written[0] + ids[0] + written[1] + ids[1] + written[2])
                        continue
                elif len(event) == 6:  # (`UsageShape`, "", bytes, id, usage, counts)
                    if not self._include_usage:
                        continue  # the usage chunk, which the client did not ask for
                    counted = event[0]
                    written = counted.written
                    if written is None:
                        written = counted.written = _usage_shape_bytes(counted)
                    if written:
                        self._usage_sent = True
                        ids = self._ids
                        out.append(written[0] + ids[0] + written[1] + ids[1])
                        counts = event[5]
                        if type(counts) is dict:  # orjson's decoding: its encoder writes it
                            out.append(written[2] + _orjson_dumps(counts) + written[3])
                        else:  # the digits of the counts, in the object as the shape's
                            out.append(written[4] % counts)
                        continue
                else:
                    continue  # an empty delta, which the parsed path does not write
                event = loads(event[2][6:])  # written as the parsed path writes its event
            calls = self._event(event, calls, out)
        if calls:  # calls the stream's end completed (no finish reason came)
            out.append(self._whole_calls(calls))
        return b"".join(out)

    def _event(
        self, event: Any, calls: list[FunctionCallContent], out: list[bytes]
    ) -> list[FunctionCallContent]:
        """Write a decoded event to `out` as the parsed path writes it (and the whole calls
        before a finish); the calls still to write."""
        if "usage" in event:
            if not self._include_usage:
                if event.get("choices") == []:
                    return calls  # the usage chunk, which the client did not ask for
                del event["usage"]
            else:
                self._usage_sent = True
        event["id"] = self._id
        event["created"] = self._created
        choices = event.get("choices")
        if choices:
            choice = choices[0]
            delta = choice.get("delta")
            reason = choice.get("finish_reason")
            # A text delta (most events) goes as it is; the rest is named and placed as the
            # parsed path writes it.
            if reason is not None or (
                type(delta) is dict and ("tool_calls" in delta or "reasoning" in delta)
            ):
                if type(delta) is dict and "tool_calls" in delta:
                    del delta["tool_calls"]  # a piece of a call: calls are written whole
                    if reason is None and all(
                        value is None or key == "role" for key, value in delta.items()
                    ):
                        return calls  # nothing else in it
                if reason is not None:
                    if calls:
                        out.append(self._whole_calls(calls))
                        calls = []
                    self._finished = True
                    if reason not in _FINISH_REASONS:
                        choice["finish_reason"] = finish_reason(reason, self._called_tools)
                if type(delta) is dict and "reasoning" in delta:
                    delta.setdefault("reasoning_content", delta.pop("reasoning"))
            elif delta == _EMPTY_TEXT and "usage" not in event:
                return calls  # an empty delta, which the parsed path does not write
        out.append(b"data: " + dumps(event) + b"\n\n")
        return calls

    def _learn(self, frame: DeltaFrame) -> None:
        """The bytes this stream writes around the string of `frame`'s deltas: its source
        event as `update` wrote it (which it did: the source came first), with a probe
        string in place of the delta's, cut at the probe. A frame a client's streams share
        is written once a client (`_frame_pieces`), and each stream puts its ids in."""
        self._frame = frame
        self._frame_bytes = self._run_bytes = None
        shared = frame.written
        if shared is not None:
            usage = self._include_usage
            pieces = shared.get(usage)
            if pieces is None:
                pieces = shared[usage] = _frame_pieces(frame, usage)
            if pieces:
                ids = self._ids
                self._frame_bytes = (
                    pieces[0] + ids[0] + pieces[1] + ids[1] + pieces[2],
                    pieces[3],
                )
                return
        source = frame.source
        source["id"] = self._id
        source["created"] = self._created
        if "usage" in source and not self._include_usage:
            del source["usage"]
        delta = source["choices"][0]["delta"]
        if "reasoning" in delta:
            delta.setdefault("reasoning_content", delta.pop("reasoning"))
        ((key, value),) = delta.items()
        delta[key] = "\x00"
        try:
            written = dumps(source)
        finally:
            delta[key] = value
        if written.count(_PROBE) == 1:
            head, _, tail = written.partition(_PROBE)
            self._frame_bytes = (b"data: " + head, tail + b"\n\n")

    def _whole_calls(self, calls: list[FunctionCallContent]) -> bytes:
        """The parsed path's chunks of whole tool calls."""
        parsed = self._parsed_encoder()
        if not self._calls_primed:
            self._calls_primed = True
            parsed.update(ChatResponseUpdate())  # its role chunk: written already
        return _bytes(parsed.update(ChatResponseUpdate(contents=list(calls))))

    def end(self) -> str | bytes:
        if not self._raw:
            return self._parsed_encoder().end()
        if self._finished and (self._usage_sent or not self._include_usage):
            return _DONE  # the stream's own finish (and usage) went out: only the end is left
        out = []
        head = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
        }
        if not self._finished:
            reason = finish_reason(self._finish, self._called_tools)
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
            out.append(b"data: " + dumps({**head, "choices": [choice]}) + b"\n\n")
        if self._include_usage and not self._usage_sent:
            usage = usage_payload(self._usage)
            out.append(b"data: " + dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
        out.append(_DONE)
        return b"".join(out)

    def error(self, error: WireError) -> str:
        return self._parsed_encoder().error(error)

    def _parsed_encoder(self) -> StreamEncoder:
        parsed = self._parsed
        if parsed is None:
            parsed = self._parsed = self._make_parsed()
        return parsed


def _cut(source: dict[str, Any], mark: bytes | None = None) -> tuple[bytes, ...] | None:
    """`source` written as `ForwardedChunks.update` writes an event, with a probe id and
    created in their places, cut there and at `mark` (a probe the caller put after them):
    its bytes before the id, between the id and the created, after the created (up to
    `mark`, and after it); None when a probe is not written once, in that order."""
    written = b"data: " + dumps({**source, "id": "\x00", "created": _CREATED_PROBE}) + b"\n\n"
    probes = (
        (_PROBE, _CREATED_PROBE_BYTES) if mark is None else (_PROBE, _CREATED_PROBE_BYTES, mark)
    )
    pieces = []
    start = 0
    for probe in probes:  # bounded: three at most
        at = written.find(probe, start)
        if at < 0 or written.count(probe) != 1:
            return None
        pieces.append(written[start:at])
        start = at + len(probe)
    pieces.append(written[start:])
    return tuple(pieces)


def _frame_pieces(frame: DeltaFrame, include_usage: bool) -> tuple[bytes, ...]:
    """How every stream writes the deltas of `frame` (one a client's streams share), as
    `ForwardedChunks._learn` writes a stream's own: its bytes before its id, between its id
    and its created, between its created and the delta's string, and after that string (the
    event's end included); empty when a cut is not sure (each stream then learns the frame
    itself)."""
    source = dict(frame.source)
    if "usage" in source and not include_usage:
        del source["usage"]
    choice = source["choices"][0]
    delta = dict(choice["delta"])
    if "reasoning" in delta:
        delta.setdefault("reasoning_content", delta.pop("reasoning"))
    ((key, _),) = delta.items()
    delta[key] = "\x02"
    source["choices"] = [{**choice, "delta": delta}, *source["choices"][1:]]
    return _cut(source, _TEXT_PROBE) or ()


def _shape_bytes(shape: EventShape) -> tuple[bytes, bytes, bytes] | bool:
    """How every stream writes an event of `shape` (a role's event, or a finish the parsed
    path names as it comes), as `ForwardedChunks.update` writes it: its bytes before its id,
    between its id and its created (which follows, as in every shape), and after; False when
    the finish is renamed or the cut is not sure (the event is then decoded and written as
    any other)."""
    if shape.finish is not None and shape.finish not in _FINISH_REASONS:
        return False
    pieces = _cut(shape.source)
    return False if pieces is None else (pieces[0], pieces[1], pieces[2])


def _usage_shape_bytes(shape: UsageShape) -> tuple[bytes, bytes, bytes, bytes, bytes] | bool:
    """How every stream writes a usage's event of `shape`, as `ForwardedChunks.update`
    writes it: its bytes before its id, between its id and its created, between its created
    and its usage object, after it, and (when the shape reads the counts' digits:
    `UsageShape.paths`) from its created to its end as a format of those digits; False when
    a cut is not sure (the event is then decoded and written as any other)."""
    cut = _cut({**shape.source, "usage": "\x01"}, _USAGE_PROBE)
    if cut is None:
        return False
    head, middle, between, after = cut
    # The object with a mark in each count's place (in the order the shape reads them),
    # written, and cut at the marks.
    counted = {
        key: dict(inner) if type(inner) is dict else inner
        for key, inner in shape.source["usage"].items()
    }
    marks = []
    for index, path in enumerate(shape.paths):
        holder = counted
        for key in path[:-1]:  # bounded: a path is two keys at most
            holder = holder[key]
        holder[path[-1]] = _CREATED_PROBE + index
        marks.append(str(_CREATED_PROBE + index).encode())
    pieces = [between + dumps(counted) + after]
    for mark in marks:
        if pieces[-1].count(mark) != 1:
            return False
        pieces[-1:] = pieces[-1].split(mark)
    form = b"%s".join(piece.replace(b"%", b"%%") for piece in pieces)
    return head, middle, between, after, form


def _bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else data
