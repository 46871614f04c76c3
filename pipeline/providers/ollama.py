"""`OllamaChatClient`: a local Ollama server through its OpenAI-compatible endpoint."""

from __future__ import annotations

from collections.abc import Mapping

import httpx2

from pipeline.providers.openai import _DEFAULT_TIMEOUT, OpenAIChatClient

__all__ = ["DEFAULT_OLLAMA_URL", "OllamaChatClient"]

DEFAULT_OLLAMA_URL = "http://localhost:11434/v1"


class OllamaChatClient(OpenAIChatClient):
    """Ollama's ``/v1/chat/completions``; no API key. Failure boundaries as `OpenAIChatClient`."""

    provider_name = "ollama"
    api_key_env = None
    max_tokens_field = "max_tokens"

    def __init__(
        self,
        model: str,
        *,
        base_url: str = DEFAULT_OLLAMA_URL,
        http_client: httpx2.AsyncClient | None = None,
        timeout: float | httpx2.Timeout = _DEFAULT_TIMEOUT,
        default_headers: Mapping[str, str] | None = None,
        first_chunk_timeout: float | None = None,
        stream_idle_timeout: float | None = None,
        max_tokens_field: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(
            model,
            base_url=base_url,
            http_client=http_client,
            timeout=timeout,
            default_headers=default_headers,
            first_chunk_timeout=first_chunk_timeout,
            stream_idle_timeout=stream_idle_timeout,
            max_tokens_field=max_tokens_field,
            name=name,
        )
