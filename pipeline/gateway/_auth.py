"""The authentication layer: with ``[gateway] api_keys_env`` or virtual keys, a request
must carry a key, else it is answered 401 (before its body is read).

The key comes in ``Authorization: Bearer KEY`` or, for formats whose clients send it so
(Anthropic's), in ``x-api-key``. A virtual key (`pipeline.keys`) is looked up by its hash in
the replica's `KeyRing`: a revoked or expired key, or a secret rotated out after its grace,
is 401 too. An ``api_keys_env`` key is compared with every key, each in constant time, so
the time taken tells nothing about which key (or how much of one) matched.

A key is never logged nor recorded: the request's `Exchange` keeps the caller's identity
(`Exchange.key`), the same for the same key in every replica and process, so what is kept
per caller across processes (cache partitions, rate limits, budgets) follows the key, never
its position in a list: a virtual key's id, or for an ``api_keys_env`` key a keyed hash of
it (`key_identity`). Log lines show a key's name, or the start of its identity.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

from pipeline.gateway._exchange import EXCHANGE, JSON, ASGIApp, Exchange, Receive, Scope, Send
from pipeline.gateway._shared import NO_KEY
from pipeline.gateway.wire import WireError

if TYPE_CHECKING:
    from pipeline.keys import KeyRing

__all__ = ["NO_KEY", "AuthMiddleware", "Authenticator", "authenticate", "key_identity"]

_INVALID = WireError(
    401, "missing or invalid API key", type="invalid_request_error", code="invalid_api_key"
)
_REFUSED = {
    why: WireError(401, message, type="invalid_request_error", code="invalid_api_key")
    for why, message in (
        ("revoked", "this API key was revoked"),
        ("expired", "this API key expired"),
        ("rotated", "this API key's secret was rotated out; use its new secret"),
    )
}
# Identities are keyed hashes under a label of their own: equal across replicas (no shared
# secret needed), never the key, and never equal to a hash of it used elsewhere.
_IDENTITY_KEY = b"chat-pipeline: api_keys_env key identity v1"


def key_identity(key: bytes) -> str:
    """The identity of an ``api_keys_env`` key: ``k:`` and 32 hex digits of its keyed
    hash (the same in every replica; the key cannot be read back from it)."""
    return "k:" + hmac.new(_IDENTITY_KEY, key, hashlib.sha256).hexdigest()[:32]


def _token(authorization: bytes | None, x_api_key: bytes | None) -> bytes:
    if authorization is not None and authorization[:7].lower() == b"bearer ":
        return authorization[7:].strip()
    if x_api_key is not None:
        return x_api_key.strip()
    return b""


def authenticate(
    keys: Sequence[bytes], authorization: bytes | None, x_api_key: bytes | None = None
) -> int | None:
    """Which of `keys` the caller's key is (its index: it never leaves this layer; -1 when
    there are no keys), or None when the request carries none of them."""
    if not keys:
        return -1
    token = _token(authorization, x_api_key)
    if not token:
        return None
    found: int | None = None
    for index, key in enumerate(keys):
        if hmac.compare_digest(key, token) and found is None:
            found = index
    return found


class Authenticator:
    """Who a request's key says its caller is (see the module docstring): `admit` sets the
    caller's identity on its `Exchange`, or says the 401 to answer. `ring` holds the
    virtual keys; `x_api_key`: the key may come in ``x-api-key`` too."""

    __slots__ = ("_identities", "_keys", "_open", "_ring", "_x_api_key")

    def __init__(
        self, *, keys: Sequence[bytes], x_api_key: bool = False, ring: KeyRing | None = None
    ) -> None:
        self._keys = tuple(keys)
        self._identities = tuple(key_identity(key) for key in self._keys)
        self._ring = ring
        self._x_api_key = x_api_key
        self._open = not self._keys and ring is None

    def admit(self, exchange: Exchange) -> WireError | None:
        """Set the exchange's caller (`Exchange.key`, `key_name`, `virtual_key`) from its
        key; the 401 to answer when it has no valid key (the exchange is left as it was)."""
        if self._open:
            exchange.key = NO_KEY
            return None
        return self._check(exchange, exchange.authorization, exchange.x_api_key)

    def _check(
        self, exchange: Exchange | None, authorization: bytes | None, x_api_key: bytes | None
    ) -> WireError | None:
        x_api_key = x_api_key if self._x_api_key else None
        ring = self._ring
        if ring is not None:
            token = _token(authorization, x_api_key)
            if ring.looks_like_secret(token):
                found = ring.find(token)
                if found is None:
                    return _INVALID
                if found.refused is not None:
                    return _REFUSED[found.refused]
                if exchange is not None:
                    key = found.key
                    exchange.key = key.identity
                    exchange.key_name = key.name
                    exchange.virtual_key = key
                return None
        index = authenticate(self._keys, authorization, x_api_key) if self._keys else None
        if index is None or index < 0:
            return _INVALID
        if exchange is not None:
            identity = self._identities[index]
            exchange.key = identity
            exchange.key_name = identity[:10]
        return None


class AuthMiddleware:
    """Lets a request with a valid key (or any request, without keys) through to `app`;
    answers 401 otherwise (see the module docstring). Works inside an endpoint with an
    `Exchange` (which holds the headers and writes the error in the format's own body) and
    around plain endpoints (``/v1/models``). `ring` holds the virtual keys."""

    __slots__ = ("_auth", "app")

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: Sequence[bytes],
        x_api_key: bool = False,
        ring: KeyRing | None = None,
    ) -> None:
        self.app = app
        self._auth = Authenticator(keys=keys, x_api_key=x_api_key, ring=ring)

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # A plain function returning what to await (the app's call, or the 401): the
        # layer adds no coroutine of its own to every request.
        exchange = scope.get(EXCHANGE)
        if exchange is not None:
            error = self._auth.admit(exchange)
        elif self._auth._open:
            error = None
        else:
            headers = dict(scope["headers"])
            error = self._auth._check(
                None, headers.get(b"authorization"), headers.get(b"x-api-key")
            )
        if error is not None:
            return _refuse(exchange, send, error)
        return self.app(scope, receive, send)


async def _refuse(exchange: Exchange | None, send: Send, error: WireError) -> None:
    if exchange is not None:
        exchange.failure = error
        await exchange.error(error)
        return
    body = error.body()
    headers = [
        *JSON,
        (b"www-authenticate", b"Bearer"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
