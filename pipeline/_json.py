"""Request bodies as JSON: UTF-8 only, nesting bounded before anything recurses over it.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "json_body"]

MAX_JSON_DEPTH = 128
"""How deep a request body may nest objects and arrays (tool schemas nest a dozen)."""

# A JSON string, escapes included (the unrolled form: linear, no backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def json_body(body: bytes) -> Any:
    """The JSON document of a request body; `ValueError` when it is not JSON in UTF-8 or
    nests deeper than `MAX_JSON_DEPTH`."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the request body is not valid JSON in UTF-8") from None
    # Fewer brackets than the bound cannot nest deeper (most bodies): no call at all.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and too_deep(body, MAX_JSON_DEPTH):
        raise ValueError(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("the request body is not valid JSON") from None


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
