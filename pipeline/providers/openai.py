"""`OpenAIChatClient`: the Chat Completions API over httpx2, for OpenAI and compatible servers.

Failure boundaries, for `get_response` and `get_streaming_response` alike:

* HTTP error statuses become `ProviderError`s of the matching kind, with `status_code`,
  `retry_after` (from ``Retry-After``) and the provider's error `code`; connection failures,
  timeouts and resets become `TransientProviderError`;
* an in-band ``error`` object on a 200 stream becomes a `ProviderError` of its kind: before
  any content it is a pre-output failure a router may fail over; after content it is
  terminal like any failure after output;
* no first chunk within `first_chunk_timeout` is a transient (pre-output) failure; no chunk
  within `stream_idle_timeout` after output is a transient failure after output;
* a stream that ends without ``[DONE]`` is transient; malformed SSE or JSON is a
  `ProviderError` (kind `UNKNOWN`, code ``malformed``), never a `KeyError`/`JSONDecodeError`;
* error messages never contain the provider's body, prompt text or the API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import httpx2

from pipeline.client import ChatClientMetadata, check_options
from pipeline.errors import FailureKind, provider_error
from pipeline.providers._chat_completions import (
    StreamAssembler,
    build_request,
    error_from_payload,
    malformed,
    parse_response,
)
from pipeline.providers._http import endpoint, post_json, status_error, transport_error
from pipeline.providers._sse import MalformedSSE, SSEDecoder
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages, as_messages

__all__ = ["DEFAULT_BASE_URL", "OpenAIChatClient"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
_DEFAULT_TIMEOUT = httpx2.Timeout(60.0, connect=10.0)


def _positive_or_none(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None")
    return float(value)


class OpenAIChatClient:
    """A Chat Completions client. See the module docstring for its failure boundaries.

    The API key comes from `api_key` or ``OPENAI_API_KEY``; it is required only for the
    default OpenAI endpoint and never appears in `repr`, errors, logs or telemetry. A given
    `http_client` is used as is and left open; otherwise the client owns one.
    """

    provider_name = "openai"
    api_key_env: str | None = "OPENAI_API_KEY"
    max_tokens_field = "max_completion_tokens"

    def __init__(
        self,
        model: str | None = None,
        *,
        api_key: str | None = None,
        base_url: str = DEFAULT_BASE_URL,
        http_client: httpx2.AsyncClient | None = None,
        timeout: float | httpx2.Timeout = _DEFAULT_TIMEOUT,
        organization: str | None = None,
        default_headers: Mapping[str, str] | None = None,
        first_chunk_timeout: float | None = None,
        stream_idle_timeout: float | None = None,
        name: str | None = None,
    ) -> None:
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("model must be a non-empty string or None")
        if self.api_key_env and api_key is None:
            api_key = os.environ.get(self.api_key_env) or None
        if api_key is None and base_url.rstrip("/") == DEFAULT_BASE_URL:
            raise ValueError(
                f"an API key is needed for {DEFAULT_BASE_URL}: pass api_key= or set "
                f"{self.api_key_env}"
            )
        self.model = model
        self._api_key = api_key
        self._base_url = httpx2.URL(base_url.rstrip("/") + "/")
        self._owns_http_client = http_client is None
        self._http = http_client or httpx2.AsyncClient(timeout=timeout)
        headers: dict[str, str] = dict(default_headers or {})
        if organization:
            headers["OpenAI-Organization"] = organization
        # Built once: a static key makes the same headers for every request.
        self._headers = {**headers, **self._static_auth_headers()}
        self.first_chunk_timeout = _positive_or_none(first_chunk_timeout, "first_chunk_timeout")
        self.stream_idle_timeout = _positive_or_none(stream_idle_timeout, "stream_idle_timeout")
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

    # -- what subclasses change -------------------------------------------------------------

    def _chat_url(self) -> httpx2.URL:
        return self._base_url.join("chat/completions")

    def _static_auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _body_model(self, options: ChatOptions | None) -> str | None:
        return (options.model_id if options else None) or self.model

    # -- requests ---------------------------------------------------------------------------

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        options = check_options(options)
        model = self._body_model(options)
        if model is None and self._requires_model():
            raise ValueError("no model: pass model= to the client or set ChatOptions.model_id")
        return build_request(
            as_messages(messages),
            options,
            model=model,
            stream=stream,
            max_tokens_field=self.max_tokens_field,
        )

    def _requires_model(self) -> bool:
        return True

    async def _request_headers(self) -> dict[str, str]:
        """The headers of one request (async: a subclass may fetch a fresh token)."""
        return self._headers

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        body = self._body(messages, options, stream=False)
        payload = await post_json(
            self._http,
            self._url,
            body,
            await self._request_headers(),
            provider=self.provider_name,
            where=self._endpoint,
        )
        return parse_response(payload, self.provider_name)

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(self._body(messages, options, stream=True))

    async def _stream(self, body: dict[str, Any]) -> AsyncGenerator[ChatResponseUpdate, None]:
        url = self._url
        where = self._endpoint
        provider = self.provider_name
        headers = await self._request_headers()
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with _deadline(self.first_chunk_timeout, provider, "first chunk"):
                    response = await stack.enter_async_context(
                        self._http.stream("POST", url, json=body, headers=headers)
                    )
                    if response.status_code >= 400:
                        raise await status_error(response, provider, where)
                    events = _events(response.aiter_lines(), provider)
                    stack.push_async_callback(events.aclose)
                    first = await anext(events, None)
            except httpx2.HTTPError as exc:
                raise transport_error(exc, provider, where) from exc
            assembler = StreamAssembler(provider)
            payload = first
            idle = self.stream_idle_timeout
            while payload is not None:
                if payload is _DONE:
                    break
                update = assembler.feed(payload)
                if update is not None:
                    yield update
                try:
                    if idle is None:
                        payload = await anext(events, None)
                    else:
                        async with _deadline(idle, provider, "next chunk"):
                            payload = await anext(events, None)
                except httpx2.HTTPError as exc:
                    raise transport_error(exc, provider, where) from exc
            else:
                raise provider_error(
                    FailureKind.TRANSIENT,
                    "the stream ended before [DONE]",
                    provider=provider,
                    code="incomplete_stream",
                    url=where,
                )
            tail = assembler.finish()
            if tail is not None:
                yield tail

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_http_client:
            await self._http.aclose()


_DONE: Any = object()


async def _events(lines: AsyncIterator[str], provider: str) -> AsyncGenerator[Any, None]:
    """Decoded JSON payloads of an SSE stream; `_DONE` for ``[DONE]``."""
    decoder = SSEDecoder()
    async for line in lines:
        try:
            data = decoder.feed(line)
        except MalformedSSE:
            raise malformed(provider, "a line that is not server-sent events") from None
        if data is None:
            continue
        if data.strip() == "[DONE]":
            # Read to the end of the body (normally just the chunked terminator), so the
            # connection goes back to the pool instead of being closed half-read.
            drained = 0
            async for _ in lines:
                drained += 1
                if drained > 100:
                    break
            yield _DONE
            return
        try:
            payload = json.loads(data)
        except ValueError:
            raise malformed(provider, "an event's data is not JSON") from None
        if decoder.event == "error":
            raise error_from_payload(
                payload.get("error", payload) if isinstance(payload, dict) else None, provider
            )
        yield payload


@contextlib.asynccontextmanager
async def _deadline(seconds: float | None, provider: str, what: str) -> AsyncIterator[None]:
    if seconds is None:
        yield
        return
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise provider_error(
            FailureKind.TRANSIENT,
            f"no {what} within {seconds:g} s",
            provider=provider,
            code="stream_timeout",
        ) from None
