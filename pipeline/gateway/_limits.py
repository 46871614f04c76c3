"""The limits layer: how many requests one caller may have in flight in this worker.

A caller is its API key (its identity, `Exchange.key`) or, on a gateway without keys, its
client address (``scope["client"]``, which uvicorn takes from ``X-Forwarded-For`` when the
connection comes from a trusted proxy), so one client cannot take every other client's
slots. One request more than ``max_concurrent_per_key`` is 429 with ``Retry-After``.

The slot is taken after the body arrived (the body layer runs outside this one): a client
sending its body slowly holds a connection until ``body_timeout``, never a slot that a
complete request could use.
"""

from __future__ import annotations

from pipeline.gateway._exchange import EXCHANGE, ASGIApp, Exchange, Receive, Scope, Send
from pipeline.gateway.wire import WireError

__all__ = ["LimitsMiddleware", "Slots"]


class Slots:
    """Requests in flight per caller (`in_flight`: a key's identity, or a client address),
    shared by every endpoint of a worker; `limit` per caller (None: no limit)."""

    __slots__ = ("in_flight", "limit", "retry_after")

    def __init__(self, limit: int | None, retry_after: float) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.in_flight: dict[str, int] = {}


class LimitsMiddleware:
    """Runs `app` in one of the caller's slots, or answers 429 (see the module docstring)."""

    __slots__ = ("_slots", "app")

    def __init__(self, app: ASGIApp, *, slots: Slots) -> None:
        self.app = app
        self._slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange: Exchange = scope[EXCHANGE]
        slots = self._slots
        limit = slots.limit
        if limit is None:
            await self.app(scope, receive, send)
            return
        key = exchange.key
        keyed = bool(key)
        if key:
            caller = key
        else:
            client = scope.get("client")
            # An address can never equal an identity (identities have a prefix and a colon).
            caller = "@" + client[0] if client else "@"
        in_flight = slots.in_flight
        count = in_flight.get(caller, 0)
        if count >= limit:
            error = WireError(
                429,
                "too many requests in flight for this "
                + ("API key" if keyed else "client")
                + "; retry later",
                type="rate_limit_error",
                code="concurrency_limit_exceeded",
                retry_after=slots.retry_after,
            )
            exchange.failure = error
            await exchange.error(error)
            return
        in_flight[caller] = count + 1
        try:
            await self.app(scope, receive, send)
        finally:
            count = in_flight[caller] - 1
            if count:
                in_flight[caller] = count
            else:
                del in_flight[caller]
