"""The authentication layer: with ``[gateway] api_keys_env``, a request must carry one of
the keys, else it is answered 401 (before its body is read).

The key comes in ``Authorization: Bearer KEY`` or, for formats whose clients send it so
(Anthropic's), in ``x-api-key``. Every key is compared, each in constant time, so the
time taken tells nothing about which key (or how much of one) matched. A key is never
logged nor recorded: the request's `Exchange` keeps its position in the list (`NO_KEY`
without keys), which the limits layer and the log line use.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Sequence

from pipeline.gateway._exchange import EXCHANGE, JSON, ASGIApp, Exchange, Receive, Scope, Send
from pipeline.gateway._shared import NO_KEY
from pipeline.gateway.wire import WireError

__all__ = ["NO_KEY", "AuthMiddleware", "authenticate"]

_INVALID = WireError(
    401, "missing or invalid API key", type="invalid_request_error", code="invalid_api_key"
)


def authenticate(
    keys: Sequence[bytes], authorization: bytes | None, x_api_key: bytes | None = None
) -> int | None:
    """The position of the caller's key in `keys` (`NO_KEY` when there are no keys), or
    None when the request carries none of them."""
    if not keys:
        return NO_KEY
    token = b""
    if authorization is not None and authorization[:7].lower() == b"bearer ":
        token = authorization[7:].strip()
    elif x_api_key is not None:
        token = x_api_key.strip()
    if not token:
        return None
    found: int | None = None
    for index, key in enumerate(keys):
        if hmac.compare_digest(key, token) and found is None:
            found = index
    return found


class AuthMiddleware:
    """Lets a request with a valid key (or any request, without keys) through to `app`;
    answers 401 otherwise (see the module docstring). Works inside an inbound format's
    endpoint (its `Exchange` holds the headers and writes the error in the format's own
    body) and around plain endpoints (``/v1/models``)."""

    __slots__ = ("_keys", "_x_api_key", "app")

    def __init__(self, app: ASGIApp, *, keys: Sequence[bytes], x_api_key: bool = False) -> None:
        self.app = app
        self._keys = tuple(keys)
        self._x_api_key = x_api_key

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # A plain function returning what to await (the app's call, or the 401): the
        # layer adds no coroutine of its own to every request.
        exchange = scope.get(EXCHANGE)
        if not self._keys:
            if exchange is not None:
                exchange.key = NO_KEY
            return self.app(scope, receive, send)
        if exchange is not None:
            authorization, x_api_key = exchange.authorization, exchange.x_api_key
        else:
            headers = dict(scope["headers"])
            authorization, x_api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        key = authenticate(self._keys, authorization, x_api_key if self._x_api_key else None)
        if key is None:
            return _refuse(exchange, send)
        if exchange is not None:
            exchange.key = key
        return self.app(scope, receive, send)


async def _refuse(exchange: Exchange | None, send: Send) -> None:
    if exchange is not None:
        exchange.failure = _INVALID
        await exchange.error(_INVALID)
        return
    body = _INVALID.body()
    headers = [
        *JSON,
        (b"www-authenticate", b"Bearer"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
