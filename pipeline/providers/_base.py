"""What every HTTP chat client shares: keys, the transport, deadlines and the stream loop.

A format (Chat Completions, Anthropic Messages) supplies the URL, headers, request body,
response parser and a stream reader; the failure boundaries are this class's, so they are
the same for every provider (see `pipeline.providers.openai`).
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import httpx2

from pipeline._forward import Forward, current_forward
from pipeline.client import AsyncClosing, ChatClientMetadata, check_options
from pipeline.errors import (
    FailureKind,
    ProviderError,
    RequestRefusedError,
    UnsendableRequestError,
    provider_error,
)
from pipeline.providers._forwarding import EventShapes, ForwardedReads
from pipeline.providers._http import (
    DEFAULT_MAX_RESPONSE_BYTES,
    Deadline,
    StreamBody,
    TransportName,
    drain,
    encode_json,
    endpoint,
    positive_bytes,
    positive_or_none,
    service_url,
    status_error_of,
    traced,
    transport_error,
)
from pipeline.providers._transports import make_transport
from pipeline.types import (
    PROVIDER_EXTRAS,
    UNTRANSLATED,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    Messages,
)
from pipeline.wire.sse import Payloads, SSEPayloads, next_payloads

if TYPE_CHECKING:
    import aiohttp

__all__ = ["HTTPChatClient", "StreamReader"]


class StreamReader(Protocol):
    """Turns a stream's JSON payloads into updates, for one response."""

    def feed(self, payload: Any) -> ChatResponseUpdate | None:
        """The update for one payload, or None when it carries nothing for the caller."""

    def finish(self) -> ChatResponseUpdate | None:
        """What is still pending once the stream said it is complete."""


class HTTPChatClient(AsyncClosing):
    """A chat client over HTTP. Subclasses say what the wire format is.

    The API key comes from `api_key` or the class's `api_key_env` variable; it is required
    only for the class's `default_base_url` and never appears in `repr`, errors, logs or
    telemetry. `transport` picks the HTTP client library, ``"aiohttp"`` (the default) or
    ``"httpx2"``; a given `http_client` (an ``httpx2.AsyncClient`` or an
    ``aiohttp.ClientSession``) picks its own, and is used as is and left open; otherwise the
    client owns one (closed by `aclose`, or by leaving ``async with client:``). Errors,
    timeouts, limits and stream semantics are the same whichever transport runs.

    Each request carries the current trace context (W3C ``traceparent``, through the
    globally configured OpenTelemetry propagators), so the provider's spans join the trace
    of the attempt that called it; nothing is added when no span is current.
    """

    provider_name: ClassVar[str] = ""
    api_key_env: ClassVar[str | None] = None
    default_base_url: ClassVar[str] = ""
    # How a complete stream ends: its last payload's ``type`` is one of these (none: a
    # ``[DONE]`` line).
    stream_end_types: ClassVar[frozenset[str]] = frozenset()
    # A stream without an end event (Gemini's): the body's end ends it, and the reader's
    # `finish` says whether it was complete.
    stream_ends_with_body: ClassVar[bool] = False
    # The `ChatOptions.additional_properties` scope (`pipeline.types.PROVIDER_EXTRAS`) this
    # format reads; the other scopes are left out of its requests.
    extras_scope: ClassVar[str | None] = None
    # The API in words, for the errors that name it ("the OpenAI Responses API").
    api_name: ClassVar[str] = ""
    # The API whose requests this format may forward as a client wrote them
    # (`pipeline._forward`); None: it never forwards.
    forward_api: ClassVar[str | None] = None

    def __init__(
        self,
        model: str | None,
        *,
        api_key: str | None,
        base_url: str,
        http_client: httpx2.AsyncClient | aiohttp.ClientSession | None,
        timeout: float | httpx2.Timeout,
        headers: Mapping[str, str],
        first_chunk_timeout: float | None,
        stream_idle_timeout: float | None,
        name: str | None,
        transport: TransportName | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("model must be a non-empty string or None")
        if self.api_key_env and api_key is None:
            api_key = os.environ.get(self.api_key_env) or None
        if api_key is None and base_url.rstrip("/") == self.default_base_url:
            raise ValueError(
                f"an API key is needed for {self.default_base_url}: pass api_key= or set "
                f"{self.api_key_env}"
            )
        self.model = model
        self._api_key = api_key
        self._base_url, basic_auth = service_url(base_url)
        # Built once: a static key makes the same headers for every request. Credentials
        # written into the URL become a Basic header unless a key already authorizes.
        auth = self._static_auth_headers()
        if basic_auth is not None and "Authorization" not in auth:
            auth = {"Authorization": basic_auth, **auth}
        self._headers = {**headers, **auth, "Content-Type": "application/json"}
        self.first_chunk_timeout = positive_or_none(first_chunk_timeout, "first_chunk_timeout")
        self.stream_idle_timeout = positive_or_none(stream_idle_timeout, "stream_idle_timeout")
        self._metadata = ChatClientMetadata(
            provider_name=self.provider_name,
            model_id=model,
            server_address=self._base_url.host or None,
            server_port=self._base_url.port or (443 if self._base_url.scheme == "https" else 80),
            name=name,
        )
        self._transport = make_transport(
            transport,
            http_client,
            timeout,
            self._base_url,
            positive_bytes(max_response_bytes, "max_response_bytes"),
            self._status_error,
        )
        self._dynamic_headers = type(self)._request_headers is not HTTPChatClient._request_headers
        # Set by the gateway for a client below layers that keep raw answers only
        # (`pipeline._forward.forwarding_clients`): it forwards the requests it may.
        self.forwarding = False
        self._signs = type(self)._signed is not HTTPChatClient._signed
        # A stream of plain server-sent events (what `ForwardedReads` may read from bytes).
        self._plain_sse = (
            type(self)._stream_payloads is HTTPChatClient._stream_payloads
            and not self.stream_end_types
        )
        self._closed = False
        self._event_shapes = EventShapes()  # what its forwarded streams repeat
        # Built once: parsing URLs costs more than the rest of a request's own work.
        self._url = self._chat_url()
        self._endpoint = endpoint(self._url)
        self._target = self._transport.target(self._url)
        stream_url = self._stream_url()
        self._stream_endpoint = self._endpoint if stream_url is self._url else endpoint(stream_url)
        self._stream_target = (
            self._target if stream_url is self._url else self._transport.target(stream_url)
        )

    @property
    def transport(self) -> TransportName:
        """The HTTP client library the calls go through: ``"aiohttp"`` or ``"httpx2"``."""
        return self._transport.name

    @property
    def metadata(self) -> ChatClientMetadata:
        return self._metadata

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.model!r}, "
            f"server={self._metadata.server_address}:{self._metadata.server_port})"
        )

    # -- what a format supplies ---------------------------------------------------------------

    def _chat_url(self) -> httpx2.URL:
        raise NotImplementedError

    def _stream_url(self) -> httpx2.URL:
        """Where streamed requests go (by default where the others go)."""
        return self._url

    def _static_auth_headers(self) -> dict[str, str]:
        return {}

    async def _request_headers(self) -> dict[str, str]:
        """The headers of one request (async: a subclass may fetch a fresh token)."""
        return self._headers

    async def _signed(self, url: str, body: bytes, headers: dict[str, str]) -> dict[str, str]:
        """`headers` for a request with `body` to `url`: a format whose requests are signed
        (AWS SigV4) adds the signature here (before the trace context, which stays
        unsigned)."""
        return headers

    def _destination(self, options: ChatOptions | None, stream: bool) -> tuple[Any, str]:
        """Where one request goes: the transport's target and the endpoint (by default the
        client's URL, or `_stream_url` when streaming; an API that names the model or the call
        shape in the path says)."""
        if stream:
            return self._stream_target, self._stream_endpoint
        return self._target, self._endpoint

    def _status_error(
        self, status: int, headers: Mapping[str, str], body: bytes, provider: str, where: str
    ) -> ProviderError:
        """The `ProviderError` of an error status (`pipeline.providers._http.StatusError`):
        a format whose errors say more in their headers reads those."""
        return status_error_of(status, headers, body, provider, where)

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _parse_response(self, payload: Any) -> ChatResponse:
        raise NotImplementedError

    def _extra_headers(self, options: ChatOptions | None) -> Mapping[str, str] | None:
        """Headers one request's options add (none by default)."""
        return None

    def _stream_reader(self) -> StreamReader:
        raise NotImplementedError

    def _parse_response_for(self, payload: Any, options: ChatOptions | None) -> ChatResponse:
        """`_parse_response` for a request's options (a format whose reading depends on
        them, such as which tools are custom, overrides this)."""
        return self._parse_response(payload)

    def _stream_reader_for(self, options: ChatOptions | None) -> StreamReader:
        """`_stream_reader` for a request's options."""
        return self._stream_reader()

    def _stream_payloads(self) -> Payloads:
        """The decoder of one stream's body: server-sent events, ending as
        `stream_end_types` says (a binary framing brings its own)."""
        return SSEPayloads(self.provider_name, end_types=self.stream_end_types)

    @classmethod
    def stream_end(cls) -> str:
        """What ends a complete stream, in words (for errors)."""
        return " or ".join(sorted(cls.stream_end_types)) or "[DONE]"

    # -- calls --------------------------------------------------------------------------------

    def _prepare(self, messages: Messages, options: ChatOptions | None, stream: bool) -> bytes:
        """The request body as JSON bytes, or `UnsendableRequestError` (nothing is sent)."""
        check_options(options)
        if options is not None and not PROVIDER_EXTRAS.isdisjoint(options.additional_properties):
            self._refuse_untranslated(options.additional_properties.get(UNTRANSLATED))
            # Another format's fields are dropped here, not refused by the provider.
            extras = {
                key: value
                for key, value in options.additional_properties.items()
                if key not in PROVIDER_EXTRAS or key == self.extras_scope
            }
            if len(extras) != len(options.additional_properties):
                options = options.with_(additional_properties=extras)
        try:
            return encode_json(self._body(messages, options, stream))
        except (ProviderError, RequestRefusedError):
            raise
        except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
            # The messages come from our builders or the JSON encoder: types and field
            # names, never the values they refused.
            raise UnsendableRequestError(
                f"the request cannot be sent: {exc}", provider=self.provider_name
            ) from exc

    def _forward_for(self, messages: Messages, options: ChatOptions | None) -> Forward | None:
        """The current request's `Forward` when this client forwards it: of its API, and
        handed what the gateway parsed (no layer above changed it)."""
        forward = current_forward()
        if forward is None or forward.api != self.forward_api:
            return None
        return forward if forward.matches(messages, options) else None

    def _forwarded_body(self, forward: Forward, options: ChatOptions | None, stream: bool) -> bytes:
        """The body of a forwarded request (a format with a `forward_api` says)."""
        raise NotImplementedError

    def _refuse_untranslated(self, untranslated: Any) -> None:
        """Refuse values only another API's routes can take (`UNTRANSLATED`): this API has
        no word for them, and dropping them would change what the caller asked."""
        if not isinstance(untranslated, Mapping):
            return
        for scope, fields in untranslated.items():
            if scope == self.extras_scope or not isinstance(fields, Mapping):
                continue
            for field, value in fields.items():
                api = self.api_name or f"the API of provider {self.provider_name}"
                raise RequestRefusedError.untranslatable(str(field), value, api)

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        forward = self._forward_for(messages, options) if self.forwarding else None
        if forward is None:
            body = self._prepare(messages, options, stream=False)
        else:
            body = self._forwarded_body(forward, options, False)
        # Static headers skip the coroutine: this is per request.
        headers = await self._request_headers() if self._dynamic_headers else self._headers
        extra = self._extra_headers(options)
        if extra:
            headers = {**headers, **extra}
        target, where = self._destination(options, False)
        if self._signs:
            headers = await self._signed(where, body, headers)
        payload = await self._transport.post_json(
            target, body, traced(headers), self.provider_name, where
        )
        if forward is None:
            return self._parse_response_for(payload, options)
        return self._forwarded_response(payload, options)

    def _forwarded_response(self, payload: Any, options: ChatOptions | None) -> ChatResponse:
        """The response of a forwarded request's answer (`payload`, decoded), which it keeps
        as ``raw_representation``: the parsed one, unless the format reads it for less."""
        response = self._parse_response_for(payload, options)
        response.raw_representation = payload
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        forward = self._forward_for(messages, options) if self.forwarding else None
        if forward is None:
            return self._stream(
                self._prepare(messages, options, stream=True),
                self._stream_reader_for(options),
                self._extra_headers(options),
                self._destination(options, True),
            )
        reader = self._stream_reader_for(options)
        return self._stream(
            self._forwarded_body(forward, options, True),
            reader,
            self._extra_headers(options),
            self._destination(options, True),
            ForwardedReads(
                reader, self._stream_payloads, sse=self._plain_sse, shapes=self._event_shapes
            ),
        )

    async def _stream(
        self,
        body: bytes,
        reader: StreamReader,
        extra: Mapping[str, str] | None = None,
        destination: tuple[Any, str] | None = None,
        forwarded: ForwardedReads | None = None,
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        transport = self._transport
        errors = transport.errors
        target, where = destination or (self._stream_target, self._stream_endpoint)
        provider = self.provider_name
        headers = await self._request_headers() if self._dynamic_headers else self._headers
        headers = {**headers, **extra} if extra else headers
        if self._signs:
            headers = await self._signed(where, body, headers)
        headers = traced(headers)
        payloads = self._stream_payloads() if forwarded is None else forwarded.events
        stream: StreamBody | None = None
        try:
            try:
                async with Deadline(self.first_chunk_timeout, provider, "first chunk"):
                    stream = await transport.open_stream(target, body, headers, provider, where)
                    read = stream.read
                    batch = await next_payloads(read, payloads)
            except errors as exc:
                raise transport_error(exc, provider, where) from exc
            idle = self.stream_idle_timeout
            while batch is not None:
                if forwarded is None:
                    for payload in batch:
                        update = reader.feed(payload)
                        if update is not None:
                            yield update
                else:  # one update a read, keeping its events
                    update, failure = forwarded.read(batch)
                    if update is not None:
                        yield update
                    if failure is not None:
                        raise failure
                if payloads.done:
                    break
                if payloads.failure is not None:
                    raise payloads.failure  # after the payloads its chunk completed before it
                try:
                    if idle is None:
                        # `next_payloads` inline for the common read, which completes
                        # events (one coroutine less a read); a read that completes none
                        # goes to it.
                        chunk = await read()
                        if chunk:
                            batch = payloads.feed(chunk) or await next_payloads(read, payloads)
                        else:
                            batch = payloads.finish() or None
                    else:
                        async with Deadline(idle, provider, "next chunk"):
                            batch = await next_payloads(read, payloads)
                except errors as exc:
                    raise transport_error(exc, provider, where) from exc
            if not payloads.done and not self.stream_ends_with_body:
                raise provider_error(
                    FailureKind.TRANSIENT,
                    f"the stream ended before {self.stream_end()}",
                    provider=provider,
                    code="incomplete_stream",
                    url=where,
                )
            try:
                async with Deadline(idle, provider, "the end of the body"):
                    await drain(read)
            except errors as exc:
                raise transport_error(exc, provider, where) from exc
            tail = reader.finish() if forwarded is None else forwarded.finish()
            if tail is not None:
                yield tail
        finally:
            if stream is not None:
                await stream.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._transport.aclose()
