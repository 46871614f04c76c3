"""Server-sent events both ways. Reading (the providers): `SSEPayloads` turns a body's
chunks into the JSON payloads they complete (lines by `Utf8Lines`, events by `SSEDecoder`),
`next_payloads` reads chunks until some are complete. Writing (the gateway's inbound
codecs): `event`, `data`, `DONE` and the stream's `SSE_HEADERS`."""

from __future__ import annotations

import asyncio
import codecs
import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pipeline._json_codec import loads
from pipeline.errors import MalformedSSE, ProviderError
from pipeline.wire._common import error_from_payload, malformed

__all__ = [
    "DONE",
    "MAX_EVENT",
    "MAX_LINE",
    "YIELD_EVERY",
    "Payloads",
    "SSEDecoder",
    "SSEPayloads",
    "SSE_HEADERS",
    "Utf8Lines",
    "data",
    "event",
    "next_payloads",
    "scan_json",
]

_KNOWN_FIELDS = frozenset({"data", "event", "id", "retry"})
_LINE_END = re.compile(r"\r\n|\r|\n")


MAX_LINE = 8 * 1024 * 1024
"""The longest line a stream may send, in characters (a longer one is a `ProviderError`):
far above any chat API's (its final event carries the whole response on one line), and a
bound on what an endless line or a streamed decompression bomb can hold."""
MAX_EVENT = 8 * 1024 * 1024
"""The most data one event may carry, in characters, its lines together."""
YIELD_EVERY = 1024 * 1024
"""Bytes `next_payloads` reads without a payload before it gives the event loop a turn."""


class SSEDecoder:
    """Give it lines (without line endings); it tells the events they complete.

    Follows the SSE rules: ``data`` lines of one event are joined with newlines, a blank
    line dispatches the event, comment lines (``:``) are skipped. A line naming no known
    field raises `MalformedSSE`, since no chat API stream sends one; so does data passing
    `max_event` characters (with `overflowed` set).
    """

    __slots__ = ("_data", "_event", "_max_event", "_size", "overflowed")

    def __init__(self, *, max_event: int = MAX_EVENT) -> None:
        self._data: list[str] = []
        self._event = ""
        self._size = 0  # the characters of `_data`
        self._max_event = max_event
        self.overflowed = False

    def events(self, lines: list[str], dispatched: list[tuple[str, str]]) -> None:
        """Append the (type, data) of each event `lines` complete to `dispatched`, in
        order. One call per network chunk: this is the per-chunk path of every stream. On
        `MalformedSSE`, `dispatched` holds the events completed before the bad line."""
        data = self._data
        for line in lines:
            if not line:
                if data:
                    dispatched.append((self._event, data[0] if len(data) == 1 else "\n".join(data)))
                    data = self._data = []
                    self._size = 0
                self._event = ""
                continue
            if line[0] == ":":
                continue
            if line[:6] == "data: ":
                value = line[6:]
            else:
                name, colon, value = line.partition(":")
                if value[:1] == " ":
                    value = value[1:]
                if name == "event":
                    self._event = value
                    continue
                if name != "data":
                    if name in _KNOWN_FIELDS:
                        continue
                    raise MalformedSSE(
                        "an unknown server-sent event field" if colon else "a line that is not SSE"
                    )
            self._size += len(value) + 1
            if self._size > self._max_event:
                self.overflowed = True
                raise MalformedSSE("an event longer than the bound")
            data.append(value)


class Utf8Lines:
    """Splits a byte stream into lines (``\r\n``, ``\n`` or ``\r``), decoded as UTF-8
    whatever charset the response declared: server-sent events are UTF-8 by definition, and
    a declared ``base64`` or ``utf-16`` must not pick our decoder. Synchronous, so reading a
    stream costs no extra generator step per line.

    Linear in the bytes fed: an unfinished line is kept in pieces and joined once, when its
    end arrives, and only new text is searched for line ends. A line longer than
    `max_line` characters is a `ProviderError` (``malformed``) as soon as it passes it.
    Bytes that are not UTF-8 are one too: the lines completed before them are returned
    first (`failure` then holds the error, raised by the next `feed` or `finish`), and
    when there are none it is raised at once."""

    __slots__ = (
        "_cr",
        "_decoder",
        "_max_line",
        "_parts",
        "_provider",
        "_size",
        "_split_character",
        "failure",
    )

    def __init__(self, provider: str, *, max_line: int = MAX_LINE) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._split_character = False
        self._parts: list[str] = []  # the unfinished line, in pieces
        self._size = 0  # its characters
        self._cr = False  # the last text ended with a CR (maybe half of a CRLF)
        self._provider = provider
        self._max_line = max_line
        self.failure: ProviderError | None = None

    def feed(self, chunk: bytes) -> list[str]:
        """The lines `chunk` completes (the rest waits for the next chunk)."""
        if self.failure is not None:
            raise self.failure
        if self._split_character:
            text = self._decode(chunk)
        else:
            try:
                text = chunk.decode()
            except UnicodeDecodeError:
                # A character split across chunks (the incremental decoder keeps its first
                # half for the next chunk), or bytes that are not UTF-8.
                text = self._decode(chunk)
        lines = self._split(text)
        if self.failure is not None and not lines:
            raise self.failure
        return lines

    def _split(self, text: str) -> list[str]:
        if self._cr:
            text = "\r" + text
            self._cr = False
        if "\n" not in text and "\r" not in text:
            # Still inside the unfinished line: keep the piece, search nothing again.
            if text:
                self._keep(text)
            return []
        parts = self._parts
        if parts:
            parts.append(text)
            text = "".join(parts)
            parts.clear()
            self._size = 0
        if text.endswith("\r"):
            # A CR may be the first half of a CRLF that the next chunk completes.
            text = text[:-1]
            self._cr = True
        # str.split is several times cheaper than the regex, and servers send LF only.
        lines = _LINE_END.split(text) if "\r" in text else text.split("\n")
        tail = lines.pop()
        limit = self._max_line
        for line in lines:
            if len(line) > limit:
                raise self._too_long()
        if tail:
            self._keep(tail)
        return lines

    def _keep(self, piece: str) -> None:
        self._size += len(piece)
        if self._size > self._max_line:
            self._parts.clear()
            raise self._too_long()
        self._parts.append(piece)

    def _too_long(self) -> ProviderError:
        return malformed(self._provider, f"a line longer than {self._max_line} characters")

    def _decode(self, chunk: bytes) -> str:
        try:
            text = self._decoder.decode(chunk)
        except UnicodeDecodeError as exc:
            # What came before the bad bytes is text, and may complete lines: those are
            # delivered before the failure (`feed`).
            self.failure = malformed(self._provider, "the stream is not UTF-8 text")
            return bytes(exc.object[: exc.start]).decode(errors="replace")
        self._split_character = bool(self._decoder.getstate()[0])
        return text

    def finish(self) -> list[str]:
        """The last, unterminated line (if any), once the stream ended."""
        if self.failure is not None:
            raise self.failure
        try:
            tail = "".join(self._parts) + self._decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise malformed(self._provider, "the stream is not UTF-8 text") from None
        self._parts.clear()
        self._size = 0
        return [line for line in _LINE_END.split(tail) if line]


scan_json = loads
"""`json.loads(data)` (ValueError for what is not JSON), by `pipeline._json_codec`: the codec's
own function, so a payload read pays no call of ours."""


class Payloads(Protocol):
    """A stream's decoded payloads, fed its body chunk by chunk (`SSEPayloads` for server-sent
    events; a binary framing has its own): what `next_payloads` reads."""

    done: bool
    failure: ProviderError | None

    def feed(self, chunk: bytes) -> list[Any]:
        """The payloads `chunk` completes (a failure after some is kept in `failure`)."""

    def finish(self) -> list[Any]:
        """The payloads the body's end completes."""


class SSEPayloads:
    """The decoded JSON payloads of a server-sent event byte stream, fed chunk by chunk.

    `feed(chunk)` returns the payloads the chunk completes, and `finish()` those the body's
    end completes. Once the stream says it is complete, `done` is set and nothing more is
    returned: a ``[DONE]`` data line (Chat Completions) or a payload whose ``type`` is one of
    `end_types` (``message_stop`` in the Messages API; ``response.completed`` or
    ``response.incomplete`` in the Responses API, which carry the usage: that payload is
    the last one returned). An
    ``error`` event is its `ProviderError`; malformed SSE, JSON or UTF-8 is one of kind
    `UNKNOWN` (code ``malformed``). A failure never costs the payloads before it: when a
    chunk completes some, they are returned and the failure is kept in `failure` (the
    reader raises it once it has passed them on), and the next `feed` or `finish` raises
    it. Synchronous, so a stream reader pays no generator step per chunk for it.
    """

    __slots__ = ("_decoder", "_end_types", "_lines", "_max_event", "_provider", "done", "failure")

    def __init__(
        self,
        provider: str,
        *,
        end_types: frozenset[str] = frozenset(),
        max_line: int = MAX_LINE,
        max_event: int = MAX_EVENT,
    ) -> None:
        self._lines = Utf8Lines(provider, max_line=max_line)
        self._decoder = SSEDecoder(max_event=max_event)
        self._max_event = max_event
        self._provider = provider
        self._end_types = end_types
        self.done = False
        self.failure: ProviderError | None = None

    def feed(self, chunk: bytes) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        return self._payloads(self._lines.feed(chunk)) if not self.done else []

    def finish(self) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        return self._payloads(self._lines.finish()) if not self.done else []

    def _payloads(self, lines: list[str]) -> list[Any]:
        provider, end_types = self._provider, self._end_types
        events: list[tuple[str, str]] = []
        failure: ProviderError | None = None
        try:
            self._decoder.events(lines, events)
        except MalformedSSE:
            failure = malformed(
                provider,
                f"an event longer than {self._max_event} characters"
                if self._decoder.overflowed
                else "a line that is not server-sent events",
            )
        if failure is None:
            failure = self._lines.failure  # bytes that are not UTF-8, after these lines
        payloads: list[Any] = []
        for event, data in events:
            if data[:1] != "{" and data.strip() == "[DONE]":
                self.done = True
                return payloads  # what follows the end does not count, bad or not
            try:
                payload = scan_json(data)
            except ValueError:
                failure = malformed(provider, "an event's data is not JSON")
                break
            if event == "error":
                failure = error_from_payload(
                    payload.get("error", payload) if isinstance(payload, dict) else None,
                    provider,
                )
                break
            if end_types and type(payload) is dict and payload.get("type") in end_types:
                self.done = True
                payloads.append(payload)
                return payloads
            payloads.append(payload)
        if failure is not None:
            if not payloads:
                raise failure
            self.failure = failure
        return payloads


async def next_payloads(
    read: Callable[[], Awaitable[bytes]], payloads: Payloads
) -> list[Any] | None:
    """The payloads of the next chunks that complete any (None once the body ended and
    left none). `read` returns the body's next chunk, and ``b""`` at its end.

    A transport returns chunks it holds already without suspending, so a body that keeps
    arriving without completing a payload (blank lines, comments: a decompression bomb)
    would keep the loop busy and no timeout could fire: every `YIELD_EVERY` bytes without
    a payload, the loop gets a turn."""
    unyielded = 0
    while True:
        chunk = await read()
        if not chunk:
            return payloads.finish() or None
        batch = payloads.feed(chunk)
        if batch:
            return batch
        unyielded += len(chunk)
        if unyielded >= YIELD_EVERY:
            unyielded = 0
            await asyncio.sleep(0)


# -- writing ----------------------------------------------------------------------------------

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Proxies (nginx) must pass each event on as it comes, not buffer the stream.
    (b"x-accel-buffering", b"no"),
]
"""The response headers of an event stream, in every format."""

DONE = "data: [DONE]\n\n"
"""The event that ends a Chat Completions stream."""


def event(name: str, payload: str) -> str:
    """An event named `name` (its ``event:`` line) carrying `payload` (one line of JSON)."""
    return f"event: {name}\ndata: {payload}\n\n"


def data(payload: str) -> str:
    """An event without a name carrying `payload` (one line of JSON)."""
    return f"data: {payload}\n\n"
