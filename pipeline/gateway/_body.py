"""The request-body layer: an inbound format's endpoint takes a JSON body by POST, read
whole and parsed by the format (a 400 naming what is wrong) before a slot is taken.

* Another method is 405; a ``Content-Type`` other than JSON (``application/json`` or
  ``application/*+json``, UTF-8: no other ``charset``) is 415, as OpenAI answers a form or
  ``text/plain``; without a ``Content-Type`` the body is taken as JSON.
* A body over ``max_body_bytes`` is 413, refused from ``Content-Length`` before it is read,
  or as soon as it grows past the limit (the connection then reads the rest for nothing,
  within ``body_timeout``, and closes: see `pipeline.gateway._protocol`).
* The body is read whole before the layers beneath run, so the limits layer takes a slot
  only for a request that has arrived. How long the body may take is the connection's
  business (``body_timeout``, enforced by `pipeline.gateway._protocol`): when it runs
  out, the connection answers 408 and ends, and this layer's read sees the client gone
  with the scope marked `READ_TIMED_OUT`: the request ends as a 408 (for the span, the
  metric and the log line), not as a client that left.
"""

from __future__ import annotations

from pipeline.gateway import _builtin_tools
from pipeline.gateway._builtin_tools import BuiltinToolPolicy
from pipeline.gateway._exchange import Exchange, Message, Receive, Scope
from pipeline.gateway._shared import READ_TIMED_OUT
from pipeline.gateway.wire import ChatRequest, WireError

__all__ = ["READ_TIMED_OUT", "BodyReader"]

_METHOD = WireError(405, "use POST", code="method_not_allowed")
_MEDIA_TYPE = WireError(
    415,
    "unsupported content type: this endpoint accepts only 'application/json' request "
    "bodies, in UTF-8",
    code="unsupported_content_type",
)
_TIMED_OUT = WireError(408, "the request body did not arrive in time", code="request_timeout")


class BodyReader:
    """Reads and parses a request's body into its `Exchange` (`Exchange.request`), or
    answers 400/405/408/413/415 (see the module docstring)."""

    __slots__ = ("_builtin_tools", "_limit")

    def __init__(self, *, max_body_bytes: int, builtin_tools: BuiltinToolPolicy = "drop") -> None:
        self._limit = max_body_bytes
        self._builtin_tools: BuiltinToolPolicy = builtin_tools

    async def read(self, exchange: Exchange, scope: Scope, receive: Receive) -> ChatRequest | None:
        """The request the body describes (also left on the exchange), or None when there is
        none: the error was answered, or the client left (`Exchange.disconnected`), or the
        body did not arrive in time (a 408 the connection answered)."""
        try:
            if scope["method"] != "POST":
                raise _METHOD
            content_type = exchange.content_type
            if (
                content_type is not None
                and content_type != b"application/json"
                and not _is_json(content_type)
            ):
                raise _MEDIA_TYPE
            limit = self._limit
            length = exchange.content_length
            if length is not None:
                try:
                    declared = int(length)
                except ValueError:
                    raise WireError(400, "invalid Content-Length", code="invalid_request") from None
                if declared > limit:
                    raise _too_large(limit)  # before reading any of it
            message = await receive()
            body: bytes | None
            if not message.get("more_body", False) and message["type"] == "http.request":
                body = message.get("body", b"")  # the whole body in one message: most
                if len(body) > limit:
                    raise _too_large(limit)
            else:
                body = await self._read(message, receive)
            if body is None:
                if READ_TIMED_OUT in scope:
                    exchange.status = 408  # answered by the connection
                    exchange.failure = _TIMED_OUT
                else:
                    exchange.disconnected = True  # the client left before its request
                return None
            request = exchange.format.parse(body, session_id=exchange.session)
            if request.builtin_tools:  # (most requests offer none: nothing to say or apply)
                policy = self._builtin_tools
                said = _builtin_tools.header_value(request, policy)
                if said is not None:
                    exchange.extra_headers.append(
                        (_builtin_tools.BUILTIN_TOOLS_HEADER, said.encode("latin-1"))
                    )
                    exchange.builtin_tools = said
                _builtin_tools.apply(request, policy)
        except WireError as error:
            exchange.failure = error
            await exchange.error(error)
            return None
        exchange.request = request
        exchange.model = request.model
        return request

    async def _read(self, message: Message, receive: Receive) -> bytes | None:
        """A body that did not come in one message, from its first (None when the client
        left), refused as soon as it grows past the limit."""
        limit = self._limit
        chunks: list[bytes] = []
        size = 0
        while True:
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
            message = await receive()


def _is_json(content_type: bytes) -> bool:
    media, _, parameters = content_type.partition(b";")
    media = media.strip().lower()
    if media != b"application/json" and not (
        media.startswith(b"application/") and media.endswith(b"+json")
    ):
        return False
    for parameter in parameters.split(b";"):
        name, _, value = parameter.partition(b"=")
        if name.strip().lower() == b"charset" and value.strip(b' "').lower() not in (
            b"utf-8",
            b"utf8",
        ):
            return False
    return True


def _too_large(limit: int) -> WireError:
    return WireError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
