"""The limits layer: how many requests one caller may have in flight in this worker
(`Slots`: the endpoint takes a slot and gives it back).

A caller is its API key (its identity, `Exchange.key`) or, on a gateway without keys, its
client address (``scope["client"]``, which uvicorn takes from ``X-Forwarded-For`` when the
connection comes from a trusted proxy), so one client cannot take every other client's
slots. One request more than ``max_concurrent_per_key`` is 429 with ``Retry-After``.

The slot is taken after the body arrived (the endpoint reads the body first): a client
sending its body slowly holds a connection until ``body_timeout``, never a slot that a
complete request could use.
"""

from __future__ import annotations

from pipeline.gateway._exchange import Exchange, Scope
from pipeline.gateway.wire import WireError

__all__ = ["Slots"]


class Slots:
    """Requests in flight per caller (`in_flight`: a key's identity, or a client address),
    shared by every endpoint of a worker; `limit` per caller (None: no limit)."""

    __slots__ = ("in_flight", "limit", "retry_after")

    def __init__(self, limit: int | None, retry_after: float) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.in_flight: dict[str, int] = {}

    def take(self, exchange: Exchange, scope: Scope) -> str:
        """Take one of the exchange's caller's slots (only with a `limit`): the caller, to
        `give_back` once the request ended; `WireError` 429 when it has none left."""
        limit = self.limit
        key = exchange.key
        if key:
            caller = key
        else:
            client = scope.get("client")
            # An address can never equal an identity (identities have a prefix and a colon).
            caller = "@" + client[0] if client else "@"
        in_flight = self.in_flight
        count = in_flight.get(caller, 0)
        if limit is not None and count >= limit:
            raise WireError(
                429,
                "too many requests in flight for this "
                + ("API key" if key else "client")
                + "; retry later",
                type="rate_limit_error",
                code="concurrency_limit_exceeded",
                retry_after=self.retry_after,
            )
        in_flight[caller] = count + 1
        return caller

    def give_back(self, caller: str) -> None:
        """Give back a slot `take` took."""
        in_flight = self.in_flight
        count = in_flight[caller] - 1
        if count:
            in_flight[caller] = count
        else:
            del in_flight[caller]
