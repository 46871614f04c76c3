"""Real providers over httpx: OpenAI-compatible, Azure OpenAI, Ollama, and embeddings."""

from pipeline.providers.azure import AzureOpenAIChatClient
from pipeline.providers.embeddings import OpenAIEmbeddingGenerator
from pipeline.providers.ollama import OllamaChatClient
from pipeline.providers.openai import OpenAIChatClient

__all__ = [
    "AzureOpenAIChatClient",
    "OllamaChatClient",
    "OpenAIChatClient",
    "OpenAIEmbeddingGenerator",
]
