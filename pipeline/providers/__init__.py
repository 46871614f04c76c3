"""Real providers over HTTP (aiohttp or httpx2): OpenAI-compatible (Chat Completions and the
Responses API), Azure OpenAI, Ollama, Anthropic, Gemini, Vertex AI, Amazon Bedrock
(Converse), the OpenAI-compatible vendors by name (Groq, Mistral, DeepSeek, Together,
Fireworks, OpenRouter, xAI, vLLM), and embeddings.

`HashingEmbeddingGenerator` is an offline, deterministic embedding generator for tests and
demos: it is not a semantic model. `LocalEmbeddingGenerator` runs a local encoder (a
sentence-transformers model: the ``local`` extra) off the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.providers.anthropic import AnthropicChatClient
from pipeline.providers.azure import AzureOpenAIChatClient
from pipeline.providers.gemini import GeminiChatClient
from pipeline.providers.ollama import OllamaChatClient
from pipeline.providers.openai import OpenAIChatClient
from pipeline.providers.openai_responses import OpenAIResponsesChatClient
from pipeline.providers.vendors import (
    DeepSeekChatClient,
    FireworksChatClient,
    GroqChatClient,
    MistralChatClient,
    OpenRouterChatClient,
    TogetherChatClient,
    VLLMChatClient,
    XAIChatClient,
)
from pipeline.providers.vertex import VertexChatClient

if TYPE_CHECKING:
    from pipeline.providers.bedrock import BedrockChatClient
    from pipeline.providers.embeddings import OpenAIEmbeddingGenerator
    from pipeline.providers.hashing import HashingEmbeddingGenerator
    from pipeline.providers.local import LocalEmbeddingGenerator

# The embedding generators need numpy: they are imported when first used, so chat clients
# (and configurations without a semantic router) load without it. So is the Bedrock client,
# whose wire package reads this package's helpers.
_EMBEDDINGS = {
    "BedrockChatClient": "pipeline.providers.bedrock",
    "HashingEmbeddingGenerator": "pipeline.providers.hashing",
    "LocalEmbeddingGenerator": "pipeline.providers.local",
    "OpenAIEmbeddingGenerator": "pipeline.providers.embeddings",
}

__all__ = [
    "AnthropicChatClient",
    "AzureOpenAIChatClient",
    "BedrockChatClient",
    "DeepSeekChatClient",
    "FireworksChatClient",
    "GroqChatClient",
    "GeminiChatClient",
    "HashingEmbeddingGenerator",
    "LocalEmbeddingGenerator",
    "MistralChatClient",
    "OllamaChatClient",
    "OpenAIChatClient",
    "OpenAIEmbeddingGenerator",
    "OpenAIResponsesChatClient",
    "OpenRouterChatClient",
    "TogetherChatClient",
    "VLLMChatClient",
    "XAIChatClient",
    "VertexChatClient",
]


def __getattr__(name: str) -> Any:
    if name in _EMBEDDINGS:
        import importlib

        value = getattr(importlib.import_module(_EMBEDDINGS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipeline.providers' has no attribute {name!r}")
