"""Real providers over HTTP (aiohttp or httpx2): OpenAI-compatible, Azure OpenAI, Ollama,
Anthropic, and embeddings.

`HashingEmbeddingGenerator` is an offline, deterministic embedding generator for tests and
demos: it is not a semantic model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.providers.anthropic import AnthropicChatClient
from pipeline.providers.azure import AzureOpenAIChatClient
from pipeline.providers.ollama import OllamaChatClient
from pipeline.providers.openai import OpenAIChatClient

if TYPE_CHECKING:
    from pipeline.providers.embeddings import OpenAIEmbeddingGenerator
    from pipeline.providers.hashing import HashingEmbeddingGenerator

# The embedding generators need numpy: they are imported when first used, so chat clients
# (and configurations without a semantic router) load without it.
_EMBEDDINGS = {
    "HashingEmbeddingGenerator": "pipeline.providers.hashing",
    "OpenAIEmbeddingGenerator": "pipeline.providers.embeddings",
}

__all__ = [
    "AnthropicChatClient",
    "AzureOpenAIChatClient",
    "HashingEmbeddingGenerator",
    "OllamaChatClient",
    "OpenAIChatClient",
    "OpenAIEmbeddingGenerator",
]


def __getattr__(name: str) -> Any:
    if name in _EMBEDDINGS:
        import importlib

        value = getattr(importlib.import_module(_EMBEDDINGS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipeline.providers' has no attribute {name!r}")
