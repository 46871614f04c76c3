"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol, with deadlines and a
bound on connections.

uvicorn (httptools) gives a connection no deadline until its first response: a client
that opens connections and sends nothing, or trickles a request head or body a byte at a
time, holds the connection (and, before this layer, a request slot) for ever. Here each
connection of a worker has:

* a head deadline (`ConnectionLimits.header_timeout`): from the connection's opening, or
  from the first read of a request after an idle keep-alive period, to the end of the
  request head. Past it: ``408`` (a connection that sent nothing is closed silently). A
  head larger than `ConnectionLimits.max_head_bytes` is ``431``;
* a body deadline (`ConnectionLimits.body_timeout`), armed only when a body did not
  arrive with its head: past it, ``408``. The app sees its client gone (its read returns
  ``http.disconnect``) and the scope marked `READ_TIMED_OUT`, so it logs a 408, not a
  client that left (see `pipeline.gateway._body`);
* keep-alive: an idle connection stays open ``timeout_keep_alive`` seconds (uvicorn's own
  timer, set from ``[gateway] keep_alive_timeout``), then ends as an answer of this layer's
  does (below), as does an idle connection closed to make room or a silent one past its
  head deadline: a request the client sent just as it ended is read for nothing, and the
  client sees the connection end without an answer (which it may retry), never a reset;
* a response sent before its request's body was all read (a refusal: 401, 405, 413, 415,
  429 ...) says what becomes of the connection, as RFC 9110 asks: when at most
  `DISCARD_BYTES` of the body are still to come (by its ``Content-Length``), the rest is
  read for nothing and the connection stays open for the client's next request (a pooled
  client's next request on it is answered); when more are, or the length is unknown
  (chunked), or the client waits for ``100 Continue``, the response says
  ``connection: close`` and the connection ends as an answer of this layer's does
  (below). Either way the body deadline bounds the wait for the rest;
* a bound (`ConnectionLimits.max_connections`): a connection beyond it closes the
  connection idle the longest (between requests, or opened and silent), as nginx reuses
  its idle keep-alive connections; when none is idle, the new connection is answered
  ``503`` with ``Retry-After`` (which the SDKs retry).

An answer given here (408, 431, 503) carries an OpenAI error body, an ``x-request-id`` and
``connection: close``; then the connection shuts its sending side and reads what the
client still sends, for nothing, `LINGER` seconds at most, before it closes: closed at
once, it would reset the connection under a client still sending, and the client could
lose the answer. At most ``max_connections`` connections linger at once (each holds a
file descriptor); past that, one is closed at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from pipeline.gateway._exchange import EXCHANGE, REQUEST_ID_HEADER, request_id_of
from pipeline.gateway._shared import ON_DISCONNECT, READ_TIMED_OUT

__all__ = ["DISCARD_BYTES", "LINGER", "ConnectionLimits", "GatewayProtocol", "protocol_factory"]

LINGER = 2.0
"""Seconds a connection that answered and ends reads what its client still sends."""
DISCARD_BYTES = 1024 * 1024
"""The most of a refused request's body still to come that is read for nothing to keep
its connection open (more, and the refusal says ``connection: close``)."""

_logger = logging.getLogger("chat_pipeline.gateway")
_lingering = 0  # connections lingering in this process


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one worker allows its connections (see the module docstring)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024
    max_head_bytes: int = 64 * 1024
    retry_after: float = 1.0


def _answer(
    status: int, reason: bytes, message: str, code: str, extra: bytes = b""
) -> tuple[bytes, bytes]:
    """A response that ends the connection, with an OpenAI error body: its head up to the
    request id's value, and its body."""
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n%s%s: " % (status, reason, len(body), extra, REQUEST_ID_HEADER)
    ), body


_HEAD_LATE = _answer(
    408, b"Request Timeout", "the request head did not arrive in time", "request_timeout"
)
_BODY_LATE = _answer(
    408, b"Request Timeout", "the request body did not arrive in time", "request_timeout"
)
_HEAD_TOO_LARGE = _answer(
    431,
    b"Request Header Fields Too Large",
    "the request head is too large",
    "request_header_fields_too_large",
)


def _too_many(limits: ConnectionLimits) -> tuple[bytes, bytes]:
    return _answer(
        503,
        b"Service Unavailable",
        "the gateway has too many connections open; retry later",
        "too_many_connections",
        b"retry-after: %d\r\n" % max(1, math.ceil(limits.retry_after)),
    )


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the bound of the module
    docstring. uvicorn makes one per connection (through `protocol_factory`).

    The parser's callbacks, called several times a request, call the base class's by name:
    Python 3.11's ``super()`` makes an object per call, about as dear as the call itself."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = False  # bytes of a request head arrived, the head is not complete
        self._head_bytes = 0
        self._in_body = False  # the head is complete, the body is not
        self._answered_early = False  # the response went out before the body was all read
        self._body_seen = 0  # bytes of the current request's body received
        self._watched: Any = None  # the cycle whose response start is watched (see below)
        self._ended = False  # answered here: what comes in is read for nothing
        self._lingers = False  # counted in `_lingering`
        # When the connection became idle (opened, or its last response sent): the
        # connection idle the longest is the one a new connection closes at the bound.
        self._idle_since: float | None = None

    # -- connections -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections and not self._make_room():
            self.connections.discard(self)  # it serves nothing: the bound counts the others
            _warn_refusal(len(self.connections))
            self._answer_and_end(*_too_many(self._limits))
            return
        self._idle_since = time.monotonic()
        self._deadline = self.loop.call_later(self._limits.header_timeout, self._head_late)

    def _make_room(self) -> bool:
        """Close the connection idle the longest; False when none is idle."""
        oldest: GatewayProtocol | None = None
        since = math.inf
        for connection in self.connections:
            if (
                connection is not self
                and isinstance(connection, GatewayProtocol)
                and connection._idle_since is not None
                and connection._idle_since < since
                and not connection.transport.is_closing()
            ):
                oldest, since = connection, connection._idle_since
        if oldest is None:
            return False
        _logger.debug("closing the connection idle the longest to accept a new one")
        oldest._end()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        global _lingering
        self._cancel_deadline()
        self._idle_since = None
        if self._lingers:
            self._lingers = False
            _lingering -= 1
        super().connection_lost(exc)
        cycle = self.cycle
        if cycle is not None and cycle.disconnected:
            scope: Any = cycle.scope
            on_disconnect = scope.get(ON_DISCONNECT)
            if on_disconnect is not None:
                on_disconnect()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _answer_and_end(self, head: bytes, body: bytes, request_id: str | None = None) -> None:
        """Send an answer of this layer's, then end the connection (see the module
        docstring: it lingers, reading for nothing, when it may)."""
        transport = self.transport
        if transport.is_closing():
            return
        request_id = request_id or request_id_of(None)
        transport.write(head + request_id.encode() + b"\r\n\r\n" + body)
        self._end()

    def _end(self) -> None:
        """End the connection once what was written is sent: lingering, reading for
        nothing, when it may (see the module docstring)."""
        global _lingering
        transport = self.transport
        if transport.is_closing() or self._ended:
            return
        self._ended = True
        self._in_head = self._in_body = False
        self._idle_since = None
        self._cancel_deadline()
        self._unset_keepalive_if_required()  # (made room for another: it ends once)
        if _lingering < self._limits.max_connections and transport.can_write_eof():
            _lingering += 1
            self._lingers = True
            transport.write_eof()
            self._deadline = self.loop.call_later(LINGER, self._abort)
        else:
            transport.close()

    def _abort(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        # Closed at once, a connection whose client sent a request just as the timer fired
        # would be reset under it (its request unread); ended this way, the client reads
        # the end of the connection and knows its request was not served.
        self.timeout_keep_alive_task = None
        self._end()

    # -- reading -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return  # read for nothing while the answer reaches the client
        HttpToolsProtocol.data_received(self, data)
        # Deadlines are armed only for what this chunk left incomplete: a request whose
        # head and body come in one read (most) arms none.
        if self._in_head:
            # Only chunks that left the head incomplete are counted: the chunk that
            # completes it is at most one read.
            self._head_bytes += len(data)
            if self._head_bytes > self._limits.max_head_bytes:
                self._answer_and_end(*_HEAD_TOO_LARGE)
            elif self._deadline is None:  # a head begun after an idle keep-alive period
                self._deadline = self.loop.call_later(self._limits.header_timeout, self._head_late)
        elif self._in_body and self._deadline is None and not self.pipeline:
            # The body did not come with its head: from now on it has a deadline, and a
            # response may start before the rest of it arrived. (A pipelined request waiting
            # for the answers before its own is not read meanwhile: its deadline starts when
            # it does, `on_response_complete`.)
            self._body_deadline()

    def _body_deadline(self) -> None:
        self._deadline = self.loop.call_later(self._limits.body_timeout, self._body_late)
        self._watch_early_answer()

    def eof_received(self) -> None:
        if self._ended:
            self._abort()  # the client is done sending: the linger is over
        super().eof_received()

    def on_message_begin(self) -> None:
        HttpToolsProtocol.on_message_begin(self)
        # Not idle any more. uvicorn stops the keep-alive timer as a read begins; one armed
        # within this read (the end of a refused body, see `on_message_complete`, then this
        # request) would otherwise end the connection under this request's answer.
        self._unset_keepalive_if_required()
        self._idle_since = None
        self._answered_early = False
        self._in_head = True
        self._head_bytes = 0
        self._body_seen = 0

    def on_body(self, body: bytes) -> None:
        self._body_seen += len(body)
        HttpToolsProtocol.on_body(self, body)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        if self._deadline is not None:
            self._cancel_deadline()
        # The app may leave a callable here: it is called if the client leaves early.
        self.scope[ON_DISCONNECT] = None  # type: ignore[literal-required]
        HttpToolsProtocol.on_headers_complete(self)

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._deadline is not None:
            self._cancel_deadline()
        HttpToolsProtocol.on_message_complete(self)
        if self._answered_early:
            # The rest of the body came in, read for nothing: the connection is idle and
            # open, as its response said (it did not say ``connection: close``).
            self._answered_early = False
            self._idle_since = time.monotonic()
            if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def on_response_complete(self) -> None:
        # Starts the next pipelined request, if one waits.
        HttpToolsProtocol.on_response_complete(self)
        if self.transport.is_closing() or self._ended:
            return
        if not self.cycle.response_complete:
            # A pipelined request is served now (or waits behind another): not idle, and
            # not answered early. Its body, when incomplete, is read from now on.
            if self._in_body and self._deadline is None and not self.pipeline:
                self._body_deadline()
            return
        if self._in_body:
            # Answered before its body was all read (a refusal), without ``connection:
            # close``: the rest is read for nothing (uvicorn drops it), within the body
            # deadline (not the keep-alive timer: the connection is not idle yet).
            self._answered_early = True
            self._unset_keepalive_if_required()
            if self._deadline is None:
                self._deadline = self.loop.call_later(self._limits.body_timeout, self._abort)
            return
        self._idle_since = time.monotonic()

    # -- early answers -----------------------------------------------------------------------

    def _watch_early_answer(self) -> None:
        """The current request's body did not all come with its head: if its response
        starts before the rest arrived, decide then whether the rest is read for nothing
        (the connection stays open) or the response says ``connection: close`` (see the
        module docstring). Only such requests pay for the watch."""
        cycle = self.cycle
        if cycle is None or self._watched is cycle or cycle.response_started:
            return
        self._watched = cycle
        declared: int | None = None
        for name, value in self.headers:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        send = cycle.send

        async def send_watching(message: Any) -> None:
            if (
                message["type"] == "http.response.start"
                and self.cycle is cycle
                and self._in_body
                and (
                    declared is None
                    or declared - self._body_seen > DISCARD_BYTES
                    or self.expect_100_continue
                )
            ):
                # uvicorn then says ``connection: close`` and closes the transport after
                # the response: through `_Ending`, which lingers instead of resetting the
                # connection under a client still sending its body.
                cycle.keep_alive = False
                cycle.transport = _Ending(self)  # type: ignore[assignment]  # what the cycle uses
            await send(message)

        cycle.send = send_watching  # type: ignore[method-assign]

    # -- deadlines ---------------------------------------------------------------------------

    def _head_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if not self._in_head:
            # Opened and silent (the head of a request that began arrives with its bytes).
            _logger.debug("closing a connection that sent no request in time")
            self._end()
            return
        _logger.debug("a request head did not arrive in time: 408")
        self._answer_and_end(*_HEAD_LATE)

    def _body_late(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if self.transport.is_closing() or not self._in_body or cycle is None:
            return
        if self._answered_early or cycle.response_started:
            self._abort()  # answered already: the rest of the body is not waited for
            return
        _logger.debug("a request body did not arrive in time: 408")
        # The app's read returns http.disconnect (its sends are dropped from now on), and
        # the mark tells it why; the 408 is this layer's.
        scope: Any = cycle.scope
        scope[READ_TIMED_OUT] = True
        cycle.disconnected = True
        cycle.message_event.set()
        exchange = scope.get(EXCHANGE)
        self._answer_and_end(*_BODY_LATE, getattr(exchange, "request_id", None))


class _Ending:
    """A connection's transport as a response that ends it sees it: closing it ends the
    connection as this layer's answers do (`GatewayProtocol._end`: lingering, reading for
    nothing), never with a reset."""

    __slots__ = ("_protocol",)

    def __init__(self, protocol: GatewayProtocol) -> None:
        self._protocol = protocol

    def write(self, data: bytes) -> None:
        self._protocol.transport.write(data)

    def is_closing(self) -> bool:
        return self._protocol.transport.is_closing()

    def close(self) -> None:
        self._protocol._end()


def protocol_factory(limits: ConnectionLimits) -> Any:
    """What uvicorn's ``http`` setting takes to make a `GatewayProtocol` per connection (a
    picklable callable, so worker processes get it too)."""
    return functools.partial(GatewayProtocol, limits=limits)


_last_refusal_warning = -math.inf


def _warn_refusal(open_connections: int) -> None:
    global _last_refusal_warning
    # One warning a minute at most: a flood would otherwise log a line per connection.
    now = time.monotonic()
    if now - _last_refusal_warning >= 60:
        _last_refusal_warning = now
        _logger.warning(
            "%d connections open, none idle: new connections are answered 503",
            open_connections,
        )
