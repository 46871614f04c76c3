"""The forwarded path: a request sent on as its client wrote it, and the provider's own
answer sent back, when the client's API and the route's are the same and every layer in
between keeps answers whole. A forwarded whole answer (`ForwardedResponse`), a forwarded
stream's updates (`ForwardedUpdate`) and the shape of its text deltas (`DeltaFrame`) live
here, where the providers that make them and the gateway that writes them both reach.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pipeline.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    Content,
    FunctionCallContent,
    UsageDetails,
    checked_text,
)

if TYPE_CHECKING:
    from pipeline.types import ChatOptions

__all__ = [
    "CHAT_COMPLETIONS",
    "DeltaFrame",
    "EventShape",
    "Forward",
    "ForwardedResponse",
    "ForwardedUpdate",
    "UsageShape",
    "current_forward",
    "enter_forward",
    "exit_forward",
    "forwarding_clients",
]

CHAT_COMPLETIONS = "chat_completions"
"""The API name of OpenAI's Chat Completions (`Forward.api`, a provider's ``forward_api``)."""


class Forward:
    """One request's client body (`body`: a JSON object, checked and without what the
    gateway drops; its ``model`` is the route's to set) and what the gateway parsed from it
    (`messages`, `options`): a provider forwards the body only when it is handed those."""

    __slots__ = ("api", "body", "messages", "options")

    def __init__(
        self, api: str, body: dict[str, Any], messages: list[ChatMessage], options: ChatOptions
    ) -> None:
        self.api = api
        self.body = body
        self.messages = messages
        self.options = options

    def matches(self, messages: Any, options: ChatOptions | None) -> bool:
        """Whether `messages` and `options` are what the body says (the same, or equal:
        routers copy the list and clone the options)."""
        return (options is self.options or options == self.options) and (
            messages is self.messages or messages == self.messages
        )


_forward: contextvars.ContextVar[Forward | None] = contextvars.ContextVar(
    "chat_pipeline_forward", default=None
)
current_forward = _forward.get
"""The current request's `Forward`, or None (the parsed path)."""
enter_forward = _forward.set
exit_forward = _forward.reset


def forwarding_clients(roots: Iterable[Any]) -> list[Any]:
    """The clients below `roots` that speak an API of their own (a ``forward_api``) and
    that every path from a root reaches through layers keeping raw answers only
    (``keeps_raw_answers``): those may forward. A client reached through any other layer,
    or through a router whose routes are not known (``owned_clients`` empty), is left out."""
    safe: dict[int, tuple[Any, bool]] = {}
    pending: list[tuple[Any, bool]] = [(root, True) for root in roots]
    seen: set[tuple[int, bool]] = set()
    while pending:  # bounded: each (client, safety) is visited once
        client, ok = pending.pop()
        if (id(client), ok) in seen:
            continue
        seen.add((id(client), ok))
        if getattr(client, "forward_api", None) is not None:
            known = safe.get(id(client))
            safe[id(client)] = (client, ok and (known is None or known[1]))
            continue
        passes = ok and getattr(client, "keeps_raw_answers", False) is True
        below: list[Any] = []
        for name in ("client", "inner"):
            child = getattr(client, name, None)
            if child is not None:
                below.append(child)
        owned = getattr(client, "owned_clients", None)
        if callable(owned):
            below.extend(owned())
        pending.extend((child, passes) for child in below)
    return [client for client, ok in safe.values() if ok]


# -- what a provider hands the gateway of a forwarded stream -------------------------------


class DeltaFrame:
    """What the text (or reasoning) deltas of one stream share: the bytes of an event (with
    its ``data: ``) before the string of its delta's one field (`head`) and after it
    (`tail`). An event of these bytes around another JSON string is that event with that
    string (a JSON string is one token, whatever it holds), so `ForwardedEvents` decodes
    the string alone and passes ``(frame, text, event bytes)`` on.

    `text` says whether the field is ``content`` (else reasoning); `ids` holds the event's
    ``id`` and ``model``; `source` is the decoded event the frame was learned from, which
    came before every event of the frame (the gateway writes their bytes around it).
    `written` is shared by the frames of a client's streams made from one learned frame
    (`EventShapes.frame`; None for a frame a stream learned itself): the gateway keeps there
    how every stream writes the frame, around its own id and created."""

    __slots__ = ("head", "ids", "run", "source", "tail", "text", "written")

    def __init__(
        self,
        head: bytes,
        tail: bytes,
        text: bool,
        ids: dict[str, Any],
        source: dict[str, Any],
        written: dict[Any, Any] | None = None,
    ) -> None:
        self.head = head
        self.tail = tail
        self.text = text
        self.ids = ids
        self.source = source
        self.written = written
        self.run: Any = None  # how a provider reads a run of the frame's deltas, once made


class EventShape:
    """An event that is not a delta (a role's, a finish's) which an upstream writes alike in
    every stream but for its ``id`` string and its ``created`` number: `ForwardedEvents`
    passes an event of these bytes on as ``(shape, "", event bytes, id)`` without decoding
    it. `finish` is its finish reason (None: it carries nothing the layers read), `model` its
    model, `source` the decoded event it was learned from (any event of the shape decodes as
    it, but for those two fields). `written` is the gateway's, made by the first stream that
    writes the shape: its bytes around the gateway's own id and created."""

    __slots__ = ("finish", "model", "size", "source", "written")

    def __init__(self, finish: str | None, model: Any, source: dict[str, Any], size: int) -> None:
        self.finish = finish
        self.model = model if type(model) is str else None
        self.source = source
        self.size = size  # its bytes after the created number
        self.written: Any = None


class UsageShape:
    """The usage's event (no choices, a ``usage`` object) which an upstream writes alike in
    every stream but for its ``id`` string, its ``created`` number and its ``usage`` object:
    the bytes from after ``created``'s digits to that object (`before`) and after it
    (`after`). `ForwardedEvents` passes an event of these bytes on as ``(shape, "", event
    bytes, id, usage, counts)``: its `UsageDetails`, and the counts' digits (read by
    `counts`, a pattern of the bytes after ``created`` whose groups are the counts, where
    the object is of the learned one's bytes but for its counts) or else the usage object
    (decoded alone). `slots` are the groups of `UsageDetails`' counts in its order (-1:
    unknown);
    `paths` are the object's counts in order (`source` holds the object with each 0).

    `model` is the event's model, `source` the decoded event it was learned from, with no
    id, created or counts; `written` is the gateway's, made by the first stream that writes
    the shape: its bytes around the gateway's own id, created and usage."""

    __slots__ = ("after", "before", "counts", "model", "paths", "slots", "source", "written")

    def __init__(self, before: bytes, after: bytes, model: Any, source: dict[str, Any]) -> None:
        self.before = before
        self.after = after
        self.model = model if type(model) is str else None
        self.source = source
        self.counts: re.Pattern[bytes] | None = None
        self.slots: tuple[int, ...] = ()
        self.paths: tuple[tuple[str, ...], ...] = ()
        self.written: Any = None


_CONTENTS = ChatResponseUpdate.__dict__["contents"]  # the dataclass's own slot
_get_contents = _CONTENTS.__get__
_set_contents = _CONTENTS.__set__


class ForwardedUpdate(ChatResponseUpdate):
    """A `ChatResponseUpdate` of one forwarded read whose `contents` are made the first time
    they are read (from the texts and contents the read's events gave, in order), then kept:
    every other field is set at once. Equal to a `ChatResponseUpdate` with the same fields."""

    __slots__ = ("_calls", "_pieces")
    _calls: list[FunctionCallContent]
    _pieces: list[Any]  # texts (made `TextContent`s when read) and contents, in order

    @property
    def contents(self) -> list[Content]:
        try:
            return _get_contents(self)  # type: ignore[no-any-return]
        except AttributeError:  # not made yet
            contents = [
                checked_text(piece) if type(piece) is str else piece for piece in self._pieces
            ]
            _set_contents(self, contents)
            return contents

    @contents.setter
    def contents(self, value: list[Content]) -> None:
        _set_contents(self, value)
        self._calls = [content for content in value if type(content) is FunctionCallContent]

    @property
    def calls(self) -> list[FunctionCallContent]:
        """The tool calls among the contents (read without making the contents)."""
        return self._calls

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChatResponseUpdate):
            return NotImplemented
        return _fields(self) == _fields(other)


def _fields(update: ChatResponseUpdate) -> tuple[Any, ...]:
    return (
        update.role,
        update.contents,
        update.response_id,
        update.model_id,
        update.finish_reason,
        update.usage,
        update.value,
    )


# -- what a provider hands the gateway of a forwarded whole answer -------------------------

_MESSAGES = ChatResponse.__dict__["messages"]  # the dataclass's own slot
_get_messages = _MESSAGES.__get__
_set_messages = _MESSAGES.__set__
_new_object = object.__new__
_ASSISTANT = ChatRole.ASSISTANT


class ForwardedResponse(ChatResponse):
    """A `ChatResponse` of a forwarded whole answer of one assistant message of text, whose
    `messages` are made the first time they are read (the message of `_text`, with no
    contents when it is empty), then kept: every other field is set at once (`of`). Equal
    to a `ChatResponse` with the same fields."""

    __slots__ = ("_text",)
    _text: str | None

    @classmethod
    def of(
        cls,
        text: str | None,
        *,
        response_id: str | None,
        model_id: str | None,
        finish_reason: str | None,
        usage: UsageDetails | None,
        raw: Any,
    ) -> ForwardedResponse:
        """The response of an answer whose message says `text` (checked: a str or None), and
        the provider's decoded answer (`raw`) as its ``raw_representation``."""
        response: ForwardedResponse = _new_object(cls)  # no init: the fields are set here
        response._text = text
        response.response_id = response_id
        response.model_id = model_id
        response.finish_reason = finish_reason
        response.usage = usage
        response.value = None
        response.raw_representation = raw
        return response

    @property
    def messages(self) -> list[ChatMessage]:
        try:
            return _get_messages(self)  # type: ignore[no-any-return]
        except AttributeError:  # not made yet
            text = self._text
            messages = [ChatMessage(_ASSISTANT, [checked_text(text)] if text else [])]
            _set_messages(self, messages)
            return messages

    @messages.setter
    def messages(self, value: list[ChatMessage]) -> None:
        _set_messages(self, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChatResponse):
            return NotImplemented
        return _response_fields(self) == _response_fields(other)


def _response_fields(response: ChatResponse) -> tuple[Any, ...]:
    return (
        response.messages,
        response.response_id,
        response.model_id,
        response.finish_reason,
        response.usage,
        response.value,
    )
