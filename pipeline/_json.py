"""Request bodies as JSON: UTF-8 only, nesting bounded before anything recurses over it.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import contextvars
import json
import re
from typing import Any

from pipeline._json_codec import FAST, fast_loads

__all__ = ["MAX_JSON_DEPTH", "decoded_exactly", "json_body"]

MAX_JSON_DEPTH = 128
"""How deep a request body may nest objects and arrays (tool schemas nest a dozen)."""

# A JSON string, escapes included (the unrolled form: linear, no backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))

# Set (in the request's own context) once a body of the request was JSON that `dumps` would
# not write back as it came: its forwarded path is off.
_inexact: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "chat_pipeline_inexact_json", default=False
)


def decoded_exactly() -> bool:
    """Whether every JSON document `json_body` decoded in this context (the request's task)
    holds only what `pipeline._json_codec.dumps` writes back as it came."""
    return not _inexact.get()


def json_body(body: bytes) -> Any:
    """The JSON document of a request body; `ValueError` when it is not JSON in UTF-8 or
    nests deeper than `MAX_JSON_DEPTH`."""
    # A body no longer than the bound cannot hold more brackets than it: no count at all
    # (two counts cost some 3 thousand instructions on a short body).
    if len(body) > MAX_JSON_DEPTH and body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:
        _text(body)  # not UTF-8 is said first
        # Fewer brackets than the bound cannot nest deeper (most bodies): no call at all.
        if too_deep(body, MAX_JSON_DEPTH):
            raise ValueError(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep")
    if FAST:
        try:
            return fast_loads(body)  # UTF-8 only: anything else is left to the checks below
        except ValueError:
            pass
    text = _text(body)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("the request body is not valid JSON") from None
    if FAST:
        _inexact.set(True)  # JSON orjson refused: NaN, an integer beyond 64 bits
    return value


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the request body is not valid JSON in UTF-8") from None


def too_deep(body: bytes, limit: int) -> bool:
    """Whether the objects and arrays of a JSON document nest deeper than `limit` (outside
    its strings; for a document that is not valid JSON, a bound that may be high)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # fewer brackets than the bound: nothing can nest deeper
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:
        return False
    import numpy as np

    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return bool(np.cumsum(steps).max() > limit)
