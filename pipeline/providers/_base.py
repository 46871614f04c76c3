"""What every HTTP chat client shares: keys, the HTTP client, deadlines and the stream loop.

A format (Chat Completions, Anthropic Messages) supplies the URL, headers, request body,
response parser and a stream reader; the failure boundaries are this class's, so they are
the same for every provider (see `pipeline.providers.openai`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncGenerator, Mapping
from typing import Any, ClassVar, Protocol

import httpx2

from pipeline.client import AsyncClosing, ChatClientMetadata, check_options
from pipeline.errors import FailureKind, ProviderError, UnsendableRequestError, provider_error
from pipeline.providers._http import (
    DEFAULT_LIMITS,
    SSEPayloads,
    deadline,
    drain,
    encode_json,
    endpoint,
    next_payloads,
    positive_or_none,
    post_json,
    service_url,
    status_error,
    transport_error,
)
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

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
    telemetry. A given `http_client` is used as is and left open; otherwise the client owns
    one (closed by `aclose`, or by leaving ``async with client:``).
    """

    provider_name: ClassVar[str] = ""
    api_key_env: ClassVar[str | None] = None
    default_base_url: ClassVar[str] = ""
    # How a complete stream ends: its last payload's ``type`` (None: a ``[DONE]`` line).
    stream_end_type: ClassVar[str | None] = None

    def __init__(
        self,
        model: str | None,
        *,
        api_key: str | None,
        base_url: str,
        http_client: httpx2.AsyncClient | None,
        timeout: float | httpx2.Timeout,
        headers: Mapping[str, str],
        first_chunk_timeout: float | None,
        stream_idle_timeout: float | None,
        name: str | None,
    ) -> None:
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("model must be a non-empty string or None")
        if http_client is not None and not isinstance(http_client, httpx2.AsyncClient):
            raise TypeError(
                f"http_client must be an httpx2.AsyncClient, not {type(http_client).__name__}"
            )
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
        self._owns_http_client = http_client is None
        self._http = http_client or httpx2.AsyncClient(timeout=timeout, limits=DEFAULT_LIMITS)
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
        self._closed = False
        # Built once: parsing URLs costs more than the rest of a request's own work.
        self._url = self._chat_url()
        self._endpoint = endpoint(self._url)

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

    def _static_auth_headers(self) -> dict[str, str]:
        return {}

    async def _request_headers(self) -> dict[str, str]:
        """The headers of one request (async: a subclass may fetch a fresh token)."""
        return self._headers

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _parse_response(self, payload: Any) -> ChatResponse:
        raise NotImplementedError

    def _stream_reader(self) -> StreamReader:
        raise NotImplementedError

    # -- calls --------------------------------------------------------------------------------

    def _prepare(self, messages: Messages, options: ChatOptions | None, stream: bool) -> bytes:
        """The request body as JSON bytes, or `UnsendableRequestError` (nothing is sent)."""
        check_options(options)
        try:
            return encode_json(self._body(messages, options, stream))
        except ProviderError:
            raise
        except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
            # The messages come from our builders or the JSON encoder: types and field
            # names, never the values they refused.
            raise UnsendableRequestError(
                f"the request cannot be sent: {exc}", provider=self.provider_name
            ) from exc

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        body = self._prepare(messages, options, stream=False)
        payload = await post_json(
            self._http,
            self._url,
            body,
            await self._request_headers(),
            provider=self.provider_name,
            where=self._endpoint,
        )
        return self._parse_response(payload)

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(self._prepare(messages, options, stream=True))

    async def _stream(self, body: bytes) -> AsyncGenerator[ChatResponseUpdate, None]:
        url = self._url
        where = self._endpoint
        provider = self.provider_name
        headers = await self._request_headers()
        payloads = SSEPayloads(provider, end_type=self.stream_end_type)
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with deadline(self.first_chunk_timeout, provider, "first chunk"):
                    response = await stack.enter_async_context(
                        self._http.stream("POST", url, content=body, headers=headers)
                    )
                    if response.status_code >= 400:
                        raise await status_error(response, provider, where)
                    chunks = response.aiter_bytes()
                    stack.push_async_callback(chunks.aclose)
                    batch = await next_payloads(chunks, payloads)
            except httpx2.HTTPError as exc:
                raise transport_error(exc, provider, where) from exc
            reader = self._stream_reader()
            idle = self.stream_idle_timeout
            while batch is not None:
                for payload in batch:
                    update = reader.feed(payload)
                    if update is not None:
                        yield update
                if payloads.done:
                    break
                if payloads.failure is not None:
                    raise payloads.failure  # after the payloads its chunk completed before it
                try:
                    if idle is None:
                        batch = await next_payloads(chunks, payloads)
                    else:
                        async with deadline(idle, provider, "next chunk"):
                            batch = await next_payloads(chunks, payloads)
                except httpx2.HTTPError as exc:
                    raise transport_error(exc, provider, where) from exc
            if not payloads.done:
                raise provider_error(
                    FailureKind.TRANSIENT,
                    f"the stream ended before {self.stream_end_type or '[DONE]'}",
                    provider=provider,
                    code="incomplete_stream",
                    url=where,
                )
            try:
                async with deadline(idle, provider, "the end of the body"):
                    await drain(chunks)
            except httpx2.HTTPError as exc:
                raise transport_error(exc, provider, where) from exc
            tail = reader.finish()
            if tail is not None:
                yield tail

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_http_client:
            await self._http.aclose()
