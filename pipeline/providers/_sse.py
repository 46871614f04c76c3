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
    """Give it lines (without line endings); it tells the events they complete.

    Follows the SSE rules: ``data`` lines of one event are joined with newlines, a blank
    line dispatches the event, comment lines (``:``) are skipped. A line naming no known
    field raises `MalformedSSE`, since no chat API stream sends one.
    """

    __slots__ = ("_data", "_event")

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""

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
                self._event = ""
            elif line[0] == ":":
                continue
            elif line[:6] == "data: ":
                data.append(line[6:])
            else:
                name, colon, value = line.partition(":")
                if value[:1] == " ":
                    value = value[1:]
                if name == "data":
                    data.append(value)
                elif name == "event":
                    self._event = value
                elif name not in _KNOWN_FIELDS:
                    raise MalformedSSE(
                        "an unknown server-sent event field" if colon else "a line that is not SSE"
                    )
