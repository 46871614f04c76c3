"""Server-sent events: lines in, event data out (the subset Chat Completions uses)."""

from __future__ import annotations

__all__ = ["SSEDecoder"]

_KNOWN_FIELDS = frozenset({"data", "event", "id", "retry"})


class MalformedSSE(ValueError):
    """A line that is not server-sent events."""


class SSEDecoder:
    """Feed it lines (without line endings); it returns an event's data when one completes.

    Follows the SSE rules: ``data`` lines of one event are joined with newlines, a blank
    line dispatches the event, comment lines (``:``) are skipped. A line naming no known
    field raises `MalformedSSE`, since an OpenAI-compatible stream never sends one.
    """

    __slots__ = ("_data", "event")

    def __init__(self) -> None:
        self._data: list[str] = []
        self.event = ""

    def feed(self, line: str) -> str | None:
        if not line:
            if not self._data:
                self.event = ""
                return None
            data = "\n".join(self._data)
            self._data.clear()
            return data
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if not colon and name not in _KNOWN_FIELDS:
            raise MalformedSSE("a line that is not a server-sent event field")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self.event = value
        elif name not in _KNOWN_FIELDS:
            raise MalformedSSE("an unknown server-sent event field")
        return None
