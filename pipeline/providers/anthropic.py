"""`AnthropicChatClient`: the Anthropic Messages API over HTTP (the codec is
`pipeline.wire.messages.outbound`). Its failure boundaries are every HTTP provider's (see
`pipeline.providers.openai`); how its error types, stop reasons and usage map is in
docs/providers.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import httpx2

from pipeline.client import check_options
from pipeline.providers._base import HTTPChatClient, StreamReader
from pipeline.providers._http import DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_TIMEOUT, TransportName
from pipeline.types import ANTHROPIC_EXTRAS, ChatOptions, ChatResponse, Messages, as_messages
from pipeline.wire.messages.outbound import MessagesStreamReader, build_request, parse_response

if TYPE_CHECKING:
    import aiohttp

__all__ = ["DEFAULT_ANTHROPIC_URL", "AnthropicChatClient"]

DEFAULT_ANTHROPIC_URL = "https://api.anthropic.com"


class AnthropicChatClient(HTTPChatClient):
    """A Messages API client. See the module docstring for its failure boundaries.

    The API key comes from `api_key` or ``ANTHROPIC_API_KEY``; it is required only for the
    default endpoint and never appears in `repr`, errors, logs or telemetry. `base_url` is
    the server's root (requests go to ``{base_url}/v1/messages``). `transport` is the HTTP
    client library: ``"aiohttp"`` (the default) or ``"httpx2"``. A given `http_client` (an
    ``httpx2.AsyncClient`` or an ``aiohttp.ClientSession``) implies its own and is used as is
    and left open; otherwise the client owns one, with `timeout`.
    `max_tokens` is sent when `ChatOptions.max_output_tokens` is not set: the API requires
    a limit on every request.
    """

    provider_name = "anthropic"
    api_key_env: ClassVar[str | None] = "ANTHROPIC_API_KEY"
    default_base_url = DEFAULT_ANTHROPIC_URL
    stream_end_types = frozenset({"message_stop"})
    extras_scope = ANTHROPIC_EXTRAS
    api_name = "the Anthropic Messages API"

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str = DEFAULT_ANTHROPIC_URL,
        http_client: httpx2.AsyncClient | aiohttp.ClientSession | None = None,
        transport: TransportName | None = None,
        timeout: float | httpx2.Timeout = DEFAULT_TIMEOUT,
        max_tokens: int = 1024,
        anthropic_version: str = "2023-06-01",
        default_headers: Mapping[str, str] | None = None,
        first_chunk_timeout: float | None = None,
        stream_idle_timeout: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        name: str | None = None,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty string")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError("max_tokens must be a positive int (the API requires a limit)")
        if not isinstance(anthropic_version, str) or not anthropic_version:
            raise ValueError("anthropic_version must be a non-empty string, e.g. '2023-06-01'")
        self.max_tokens = max_tokens
        self.anthropic_version = anthropic_version
        headers = {"anthropic-version": anthropic_version, **(default_headers or {})}
        self._beta_header = next(
            (v for k, v in headers.items() if k.lower() == "anthropic-beta"), ""
        )
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

    def _chat_url(self) -> httpx2.URL:
        return self._base_url.join("v1/messages")

    def _static_auth_headers(self) -> dict[str, str]:
        return {"x-api-key": self._api_key} if self._api_key else {}

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        options = check_options(options)
        return build_request(
            as_messages(messages),
            options,
            model=(options.model_id if options else None) or self.model or "",
            max_tokens=self.max_tokens,
            stream=stream,
        )

    def _extra_headers(self, options: ChatOptions | None) -> Mapping[str, str] | None:
        # The caller's betas (`ANTHROPIC_EXTRAS` ``betas``, as the SDK names them), after
        # the client's own ``anthropic-beta``.
        scoped = options.additional_properties.get(ANTHROPIC_EXTRAS) if options else None
        betas = scoped.get("betas") if isinstance(scoped, Mapping) else None
        if not betas or not isinstance(betas, list):
            return None
        own = [b.strip() for b in self._beta_header.split(",") if b.strip()]
        wanted = list(dict.fromkeys([*own, *(b for b in betas if isinstance(b, str) and b)]))
        return {"anthropic-beta": ",".join(wanted)} if wanted else None

    def _parse_response(self, payload: Any) -> ChatResponse:
        return parse_response(payload, self.provider_name)

    def _stream_reader(self) -> StreamReader:
        return MessagesStreamReader(self.provider_name)
