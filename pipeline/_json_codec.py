"""JSON in and out at C speed: orjson when it is installed (the ``gateway`` extra brings
it), else the standard library, with the standard library's answers either way.

`loads` takes what ``json.loads`` takes and gives the same values: orjson first, and
``json.loads`` for what orjson refuses (integers beyond 64 bits, ``NaN``, lone surrogates),
so the one that decides what is not JSON is always the standard library. `dumps` writes
compact UTF-8 JSON (no spaces, no ASCII escapes), as ``json`` with ``separators=(",",
":")`` and ``ensure_ascii=False`` writes it; values orjson cannot write (integers beyond 64
bits, keys that are not strings) go through ``json``. One difference remains: orjson writes
``NaN`` and the infinities as ``null``, which ``json`` writes as tokens no JSON parser
takes, so `dumps` is for values decoded from JSON by `loads_exact` (which never holds them)
or built from checked numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["FAST", "dumps", "fast_loads", "loads", "loads_exact"]

_loads: Callable[[bytes | str], Any] | None
_dumps: Callable[[Any], bytes] | None
try:
    import orjson
except ImportError:  # pragma: no cover - the gateway extra installs it
    _loads = _dumps = None
else:
    _loads = orjson.loads
    _dumps = orjson.dumps

FAST = _loads is not None
"""Whether orjson does the work (else the standard library does it all)."""


def _unavailable(data: bytes | str) -> Any:  # pragma: no cover - the gateway extra has orjson
    raise ValueError("orjson is not installed")


fast_loads: Callable[[bytes | str], Any] = _loads or _unavailable
"""orjson's own decoder (`ValueError` for all it refuses, JSON or not); only when `FAST`."""

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``'s value (`ValueError` for what is not JSON)."""
    if _loads is not None:
        try:
            return _loads(data)
        except ValueError:
            pass  # not JSON, or JSON orjson does not take: json.loads decides
    return json.loads(data)


def loads_exact(data: bytes | str) -> tuple[Any, bool]:
    """`loads`, and whether the value holds only what `dumps` writes back as it came: True
    when orjson decoded it (no ``NaN``, no integer beyond 64 bits); without orjson, True."""
    if _loads is not None:
        try:
            return _loads(data), True
        except ValueError:
            return json.loads(data), False
    return json.loads(data), True


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON (see the module docstring); `TypeError` for what JSON
    cannot hold, `ValueError` for a string that is not Unicode text (a lone surrogate)."""
    if _dumps is not None:
        try:
            return _dumps(value)
        except TypeError:
            pass  # a big integer or a key that is no string: json writes those
    return _ENCODER.encode(value).encode()
