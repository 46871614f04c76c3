"""`GeminiChatClient`: Google's Gemini API (``generateContent``) over HTTP (the codec is
`pipeline.wire.gemini`). Its failure boundaries are every HTTP provider's (see
`pipeline.providers.openai`); how its statuses, blocked prompts and stream ends map is in
docs/providers.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import httpx2
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GenAiProviderNameValues,
)

from pipeline.client import check_options
from pipeline.providers._base import HTTPChatClient, StreamReader
from pipeline.providers._http import DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_TIMEOUT, TransportName
from pipeline.types import (
    GEMINI_EXTRAS,
    ChatOptions,
    ChatResponse,
    Messages,
    as_messages,
)
from pipeline.wire.gemini import outbound
from pipeline.wire.tools import custom_tool_names

if TYPE_CHECKING:
    import aiohttp

__all__ = ["DEFAULT_GEMINI_URL", "GeminiChatClient"]

DEFAULT_GEMINI_URL = "https://generativelanguage.googleapis.com/v1beta"


class GeminiChatClient(HTTPChatClient):
    """A Gemini API client. See the module docstring for its failure boundaries.

    The API key comes from `api_key` or ``GEMINI_API_KEY`` and is sent as the
    ``x-goog-api-key`` header (never in the URL); it is required only for the default
    endpoint and never appears in `repr`, errors, logs or telemetry. `base_url` is the API
    version's root (requests go to ``{base_url}/models/{model}:generateContent`` and
    ``:streamGenerateContent?alt=sse``; a `model` with a ``/``, such as
    ``tunedModels/x``, is used as the path). The model is the client's:
    `ChatOptions.model_id` does not change the URL. `transport` is the HTTP client
    library, ``"aiohttp"`` (the default) or ``"httpx2"``; a given `http_client` implies its
    own and is used as is and left open.
    """

    provider_name = GenAiProviderNameValues.GCP_GEMINI.value
    api_name = "the Gemini API"
    api_key_env: ClassVar[str | None] = "GEMINI_API_KEY"
    default_base_url = DEFAULT_GEMINI_URL
    stream_ends_with_body = True
    extras_scope = GEMINI_EXTRAS

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str = DEFAULT_GEMINI_URL,
        http_client: httpx2.AsyncClient | aiohttp.ClientSession | None = None,
        transport: TransportName | None = None,
        timeout: float | httpx2.Timeout = DEFAULT_TIMEOUT,
        default_headers: Mapping[str, str] | None = None,
        first_chunk_timeout: float | None = None,
        stream_idle_timeout: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        name: str | None = None,
    ) -> None:
        if not isinstance(model, str) or not model.strip("/"):
            raise ValueError("model must be a non-empty string")
        super().__init__(
            model,
            api_key=api_key,
            base_url=base_url,
            http_client=http_client,
            timeout=timeout,
            headers=dict(default_headers or {}),
            first_chunk_timeout=first_chunk_timeout,
            stream_idle_timeout=stream_idle_timeout,
            max_response_bytes=max_response_bytes,
            name=name,
            transport=transport,
        )

    # -- where and how ------------------------------------------------------------------------

    def _model_path(self) -> str:
        """The model's resource path below `base_url`."""
        model = (self.model or "").strip("/")
        return model if "/" in model else f"models/{model}"

    def _method_url(self, method: str) -> httpx2.URL:
        base = self._base_url
        return base.copy_with(path=f"{base.path}{self._model_path()}:{method}")

    def _chat_url(self) -> httpx2.URL:
        return self._method_url("generateContent")

    def _stream_url(self) -> httpx2.URL:
        return self._method_url("streamGenerateContent").copy_merge_params({"alt": "sse"})

    def _static_auth_headers(self) -> dict[str, str]:
        return {"x-goog-api-key": self._api_key} if self._api_key else {}

    # -- the format ---------------------------------------------------------------------------

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        return outbound.build_request(as_messages(messages), check_options(options))

    def _parse_response(self, payload: Any) -> ChatResponse:
        return outbound.parse_response(payload, self.provider_name)

    def _stream_reader(self) -> StreamReader:
        return outbound.GeminiStreamReader(self.provider_name)

    def _parse_response_for(self, payload: Any, options: ChatOptions | None) -> ChatResponse:
        custom = custom_tool_names(options.tools if options is not None else None)
        return outbound.parse_response(payload, self.provider_name, custom)

    def _stream_reader_for(self, options: ChatOptions | None) -> StreamReader:
        custom = custom_tool_names(options.tools if options is not None else None)
        return outbound.GeminiStreamReader(self.provider_name, custom)
