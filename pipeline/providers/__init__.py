"""Real providers over httpx2: OpenAI-compatible, Azure OpenAI, Ollama, Anthropic, and
embeddings.

`HashingEmbeddingGenerator` is an offline, deterministic embedding generator for tests and
demos: it is not a semantic model.
"""

from pipeline.providers.anthropic import AnthropicChatClient
from pipeline.providers.azure import AzureOpenAIChatClient
from pipeline.providers.embeddings import OpenAIEmbeddingGenerator
from pipeline.providers.hashing import HashingEmbeddingGenerator
from pipeline.providers.ollama import OllamaChatClient
from pipeline.providers.openai import OpenAIChatClient

__all__ = [
    "AnthropicChatClient",
    "AzureOpenAIChatClient",
    "HashingEmbeddingGenerator",
    "OllamaChatClient",
    "OpenAIChatClient",
    "OpenAIEmbeddingGenerator",
]
