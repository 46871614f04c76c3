"""Server-sent events: lines in, event data out (the subset the chat APIs use).

Measured against httpx2's built-in `EventSource` on the per-event path
(``benchmarks/bench_sse.py``), this decoder is the faster one, so the providers use it.
"""

from __future__ import annotations

__all__ = ["MalformedSSE", "SSEDecoder"]

_KNOWN_FIELDS = frozenset({"data", "event", "id", "retry"})


class MalformedSSE(ValueError):
    """A line that is not server-sent events."""


class SSEDecoder:
    """Feed it lines (without line endings); it returns an event's data when one completes.

    Follows the SSE rules: ``data`` lines of one event are joined with newlines, a blank
    line dispatches the event, comment lines (``:``) are skipped. After a dispatch, `event`
    is the dispatched event's type (``""`` when it named none). A line naming no known field
    raises `MalformedSSE`, since no chat API stream sends one.
    """

    __slots__ = ("_data", "_event", "event")

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""
        self.event = ""

    def feed(self, line: str) -> str | None:
        if not line:
            data = self._data
            if not data:
                self._event = ""
                return None
            self.event = self._event
            self._event = ""
            self._data = []
            return data[0] if len(data) == 1 else "\n".join(data)
        if line[0] == ":":
            return None
        name, colon, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name not in _KNOWN_FIELDS:
            raise MalformedSSE(
                "an unknown server-sent event field" if colon else "a line that is not SSE"
            )
        return None
