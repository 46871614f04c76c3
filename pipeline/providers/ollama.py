"""`OllamaChatClient`: a local Ollama server through its OpenAI-compatible endpoint."""

from __future__ import annotations

from typing import Unpack

from pipeline.providers.openai import ClientOptions, OpenAIChatClient

__all__ = ["DEFAULT_OLLAMA_URL", "OllamaChatClient"]

DEFAULT_OLLAMA_URL = "http://localhost:11434/v1"


class OllamaChatClient(OpenAIChatClient):
    """Ollama's ``/v1/chat/completions``; no API key. Failure boundaries as `OpenAIChatClient`."""

    provider_name = "ollama"
    api_key_env = None
    max_tokens_field = "max_tokens"

    def __init__(
        self, model: str, *, base_url: str = DEFAULT_OLLAMA_URL, **options: Unpack[ClientOptions]
    ) -> None:
        super().__init__(model, base_url=base_url, **options)
