"""`OpenAIChatClient`: the Chat Completions API over HTTP, for OpenAI and compatible servers.

Failure boundaries, for `get_response` and `get_streaming_response` alike (every HTTP
provider of this package shares them):

* HTTP error statuses become `ProviderError`s of the matching kind, with `status_code`,
  `retry_after` (from ``Retry-After``) and the provider's error `code`; connection failures,
  timeouts and resets become `TransientProviderError`;
* an in-band ``error`` object on a 200 stream becomes a `ProviderError` of its kind (a
  numeric code, as LiteLLM sends, is read as an HTTP status): before any content it is a
  pre-output failure a router may fail over; after content it is terminal like any failure
  after output;
* no first chunk within `first_chunk_timeout` is a transient (pre-output) failure; no chunk
  within `stream_idle_timeout` after output is a transient failure after output;
* a stream that ends without ``[DONE]`` is transient; malformed SSE or JSON is a
  `ProviderError` (kind `UNKNOWN`, code ``malformed``), never a `KeyError`/`JSONDecodeError`;
  so is a stream line or event past its bound (`pipeline.wire.sse.MAX_LINE`,
  `MAX_EVENT`), and bytes that are not UTF-8 fail after the events before them;
* a non-streamed answer whose decoded body passes `max_response_bytes` (default 64 MiB)
  is a `ProviderError` (kind `UNKNOWN`, code ``response_too_large``) as soon as it does,
  whatever its compression: the body is never held whole beyond the bound;
* error messages never contain the provider's body, prompt text or the API key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import httpx2

from pipeline._forward import CHAT_COMPLETIONS, Forward
from pipeline.client import check_options
from pipeline.providers._base import HTTPChatClient, StreamReader
from pipeline.providers._forwarding import chat_completions_body, forwarded_response
from pipeline.providers._http import DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_TIMEOUT, TransportName
from pipeline.types import ChatOptions, ChatResponse, Messages, as_messages
from pipeline.wire.chat_completions.outbound import (
    MAX_TOKENS_FIELDS,
    StreamAssembler,
    build_request,
    parse_response,
)
from pipeline.wire.tools import custom_tool_names

if TYPE_CHECKING:
    import aiohttp


class ClientOptions(TypedDict, total=False):
    """The keywords a Chat Completions client passes on to `OpenAIChatClient` (Azure and
    Ollama take them as they are: see `OpenAIChatClient` for their meaning and defaults)."""

    http_client: httpx2.AsyncClient | aiohttp.ClientSession | None
    transport: TransportName | None
    timeout: float | httpx2.Timeout
    default_headers: Mapping[str, str] | None
    first_chunk_timeout: float | None
    stream_idle_timeout: float | None
    max_response_bytes: int
    max_tokens_field: str | None
    name: str | None


__all__ = ["DEFAULT_BASE_URL", "OpenAIAPIClient", "OpenAIChatClient"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
_DEFAULT_TIMEOUT = DEFAULT_TIMEOUT


class OpenAIAPIClient(HTTPChatClient):
    """What OpenAI's APIs share, whichever format a subclass speaks: the key (`api_key` or
    ``OPENAI_API_KEY``, sent as a bearer token, required only for the default endpoint),
    the organization header, and the model a request names."""

    provider_name = "openai"
    api_key_env: ClassVar[str | None] = "OPENAI_API_KEY"
    default_base_url = DEFAULT_BASE_URL

    def __init__(
        self,
        model: str | None = None,
        *,
        api_key: str | None = None,
        base_url: str = DEFAULT_BASE_URL,
        http_client: httpx2.AsyncClient | aiohttp.ClientSession | None = None,
        transport: TransportName | None = None,
        timeout: float | httpx2.Timeout = _DEFAULT_TIMEOUT,
        organization: str | None = None,
        default_headers: Mapping[str, str] | None = None,
        first_chunk_timeout: float | None = None,
        stream_idle_timeout: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        name: str | None = None,
    ) -> None:
        headers: dict[str, str] = dict(default_headers or {})
        if organization:
            headers["OpenAI-Organization"] = organization
        super().__init__(
            model,
            api_key=api_key,
            base_url=base_url,
            http_client=http_client,
            timeout=timeout,
            headers=headers,
            first_chunk_timeout=first_chunk_timeout,
            stream_idle_timeout=stream_idle_timeout,
            max_response_bytes=max_response_bytes,
            name=name,
            transport=transport,
        )

    def _static_auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _body_model(self, options: ChatOptions | None) -> str | None:
        return (options.model_id if options else None) or self.model

    def _requires_model(self) -> bool:
        return True

    def _request_model(self, options: ChatOptions | None) -> str | None:
        """The model a request names (`ValueError` when one is needed and none is set)."""
        model = self._body_model(options)
        if model is None and self._requires_model():
            raise ValueError("no model: pass model= to the client or set ChatOptions.model_id")
        return model


class OpenAIChatClient(OpenAIAPIClient):
    """A Chat Completions client. See the module docstring for its failure boundaries.

    The API key comes from `api_key` or ``OPENAI_API_KEY``; it is required only for the
    default OpenAI endpoint and never appears in `repr`, errors, logs or telemetry.
    `transport` is the HTTP client library: ``"aiohttp"`` (the default) or ``"httpx2"``. A
    given `http_client` (an ``httpx2.AsyncClient`` or an ``aiohttp.ClientSession``) implies
    its own and is used as is and left open; otherwise the client owns one, with `timeout`.

    `max_tokens_field` names the body field that carries `ChatOptions.max_output_tokens`:
    ``"max_completion_tokens"`` (OpenAI's, the default) or ``"max_tokens"``, for compatible
    servers that ignore the newer field (llama.cpp, vLLM and others).
    """

    max_tokens_field = "max_completion_tokens"
    api_name = "the Chat Completions API"
    forward_api: ClassVar[str | None] = CHAT_COMPLETIONS

    def __init__(
        self,
        model: str | None = None,
        *,
        api_key: str | None = None,
        base_url: str = DEFAULT_BASE_URL,
        http_client: httpx2.AsyncClient | aiohttp.ClientSession | None = None,
        transport: TransportName | None = None,
        timeout: float | httpx2.Timeout = _DEFAULT_TIMEOUT,
        organization: str | None = None,
        default_headers: Mapping[str, str] | None = None,
        first_chunk_timeout: float | None = None,
        stream_idle_timeout: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_tokens_field: str | None = None,
        name: str | None = None,
    ) -> None:
        if max_tokens_field is not None:
            if max_tokens_field not in MAX_TOKENS_FIELDS:
                raise ValueError(
                    f"max_tokens_field must be one of {', '.join(map(repr, MAX_TOKENS_FIELDS))}"
                    f", not {max_tokens_field!r}"
                )
            self.max_tokens_field = max_tokens_field
        super().__init__(
            model,
            api_key=api_key,
            base_url=base_url,
            http_client=http_client,
            transport=transport,
            timeout=timeout,
            organization=organization,
            default_headers=default_headers,
            first_chunk_timeout=first_chunk_timeout,
            stream_idle_timeout=stream_idle_timeout,
            max_response_bytes=max_response_bytes,
            name=name,
        )

    # -- the format ---------------------------------------------------------------------------

    def _chat_url(self) -> httpx2.URL:
        return self._base_url.join("chat/completions")

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        options = check_options(options)
        return build_request(
            as_messages(messages),
            options,
            model=self._request_model(options),
            stream=stream,
            max_tokens_field=self.max_tokens_field,
        )

    def _forwarded_body(self, forward: Forward, options: ChatOptions | None, stream: bool) -> bytes:
        return chat_completions_body(
            forward,
            model=self._request_model(options),
            max_tokens_field=self.max_tokens_field,
            max_tokens=options.max_output_tokens if options is not None else None,
            stream=stream,
        )

    def _parse_response(self, payload: Any) -> ChatResponse:
        return parse_response(payload, self.provider_name)

    def _stream_reader(self) -> StreamReader:
        return StreamAssembler(self.provider_name)

    def _parse_response_for(self, payload: Any, options: ChatOptions | None) -> ChatResponse:
        custom = custom_tool_names(options.tools if options is not None else None)
        return parse_response(payload, self.provider_name, custom)

    def _forwarded_response(self, payload: Any, options: ChatOptions | None) -> ChatResponse:
        # A message of text is read lazily; `_parse_response_for` reads anything else (a
        # subclass reading its own dialect forwards nothing: its `forward_api` is None).
        response = forwarded_response(payload)
        if response is None:
            return super()._forwarded_response(payload, options)
        return response

    def _stream_reader_for(self, options: ChatOptions | None) -> StreamReader:
        custom = custom_tool_names(options.tools if options is not None else None)
        return StreamAssembler(self.provider_name, custom)
