"""JSON in and out at C speed: orjson when it is installed (the ``gateway`` extra brings
it), else the standard library, with the standard library's answers either way.

`loads` takes what ``json.loads`` takes and gives the same values: orjson first, and
``json.loads`` for what orjson refuses (``NaN``, lone surrogates) and for a document with a
run of 19 digits or more (orjson reads an integer beyond 64 bits as a float, a changed value
rather than an error), so the one that decides what is not JSON is always the standard
library. `dumps` writes
compact UTF-8 JSON (no spaces, no ASCII escapes), as ``json`` with ``separators=(",",
":")`` and ``ensure_ascii=False`` writes it (a float may be spelled otherwise, ``1e-05`` as
``0.00001``: the same value); values orjson cannot write (integers beyond 64
bits, keys that are not strings) go through ``json``. One difference remains: orjson writes
``NaN`` and the infinities as ``null``, which ``json`` writes as tokens no JSON parser
takes, so `dumps` is for values decoded from JSON by `loads_exact` (which never holds them)
or built from checked numbers.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

__all__ = [
    "FAST",
    "dumps",
    "dumps_strict",
    "fast_loads",
    "loads",
    "loads_exact",
    "orjson_reads",
]

_loads: Callable[[bytes | str], Any] | None
_dumps: Callable[..., bytes] | None
try:
    import orjson
except ImportError:  # pragma: no cover - the gateway extra installs it
    _loads = _dumps = None
else:
    _loads = orjson.loads
    _dumps = orjson.dumps
    # `dumps_strict` hands dataclasses, dates and subclasses of str, int, dict and list to
    # the standard library, which decides as it always did (orjson would write them its way).
    _PASSTHROUGH = (
        orjson.OPT_PASSTHROUGH_DATACLASS
        | orjson.OPT_PASSTHROUGH_DATETIME
        | orjson.OPT_PASSTHROUGH_SUBCLASS
    )

FAST = _loads is not None
"""Whether orjson does the work (else the standard library does it all)."""


# Integers of 18 digits fit in 64 bits; a longer run of digits (in a number, or in a string
# or a float, which then only take the slower way) goes to the standard library. Bytes are
# searched with every ASCII digit mapped to "0" and every other byte to " ": two passes in C,
# where the regular expression tried a match at every position (a ninth of the instructions
# for a whole answer of 400 bytes, and every streamed event pays it). `find`, not `in`: a
# bytes `in` first tries its operand as an integer, making and dropping a TypeError (some
# thousand instructions a call).
_DIGITS_ONLY = bytes(0x30 if 0x30 <= code <= 0x39 else 0x20 for code in range(256))
_LONG_RUN = b"0" * 19
_LONG_DIGITS_TEXT = re.compile(r"[0-9]{19}")


def orjson_reads(data: bytes | str) -> bool:
    """Whether orjson reads `data` as ``json.loads`` does, when it reads it at all."""
    if isinstance(data, bytes):
        return data.translate(_DIGITS_ONLY).find(_LONG_RUN) < 0
    # Text is searched as its UTF-8 bytes (a copy in C): the regular expression costs five
    # times as much, and every streamed event is text. A lone surrogate has no UTF-8, and
    # orjson refuses it anyway: the regular expression decides.
    try:
        encoded = data.encode()
    except UnicodeEncodeError:
        return _LONG_DIGITS_TEXT.search(data) is None
    return encoded.translate(_DIGITS_ONLY).find(_LONG_RUN) < 0


def fast_loads(data: bytes | str) -> Any:
    """orjson's decoder where it gives ``json.loads``'s value (`ValueError` for all it
    refuses, JSON or not, and for what it would read otherwise); only when `FAST`."""
    if _loads is None:  # pragma: no cover - the gateway extra has orjson
        raise ValueError("orjson is not installed")
    if not orjson_reads(data):
        raise ValueError("a run of digits orjson may not read exactly")
    return _loads(data)


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``'s value (`ValueError` for what is not JSON)."""
    if _loads is not None and orjson_reads(data):
        try:
            return _loads(data)
        except ValueError:
            pass  # not JSON, or JSON orjson does not take: json.loads decides
    return json.loads(data)


def loads_exact(data: bytes | str) -> tuple[Any, bool]:
    """`loads`, and whether the value holds only what `dumps` writes back as it came: True
    when orjson decoded it (no ``NaN``, no integer beyond 64 bits); without orjson, True."""
    if _loads is not None:
        if orjson_reads(data):
            try:
                return _loads(data), True
            except ValueError:
                pass
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


def _value_of(value: Any) -> Any:
    """What orjson writes for an enum or a UUID, so `dumps_strict` writes the same with it or
    without it."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_STRICT_ENCODER = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_value_of
)


def dumps_strict(value: Any) -> bytes:
    """`value` as `dumps` writes it, but the standard library's answers throughout:
    `ValueError` for NaN and the infinities, `TypeError`/`ValueError` for other objects and
    lone surrogates. Enums are written as their values and UUIDs as their strings, with
    orjson installed or not. For request bodies built from a caller's values."""
    if _dumps is not None:
        # A fifth of the standard library's cost. orjson writes NaN and the infinities as
        # null, so a document with a null in it is written again by the standard library,
        # which refuses them; what orjson refuses (big integers, keys that are no strings,
        # lone surrogates, the types passed through) goes there too, to be written or refused.
        try:
            encoded = _dumps(value, option=_PASSTHROUGH)
        except TypeError:
            pass
        else:
            if encoded.find(b"null") < 0:
                return encoded
    return _STRICT_ENCODER.encode(value).encode()
