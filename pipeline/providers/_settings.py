"""Provider settings: one frozen class per provider kind, what a route needs to reach its
model (and the embedding generators a semantic router uses).

`pipeline.config` validates a route's provider keys with these classes (its route tables
add the route's facts and layers to them) and builds the client with `client()`. Each
default is the provider constructor's own: a test holds them equal, and a timeout left
unset is not passed at all (the constructor's default applies). The checks are those a
configuration file needs on top of the constructors': URLs that parse and carry no
credentials, names of environment variables, finite bounded numbers.

This module imports no provider and no numpy: a configuration is validated without them.
"""

from __future__ import annotations

import abc
import re
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, TypedDict
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, StringConstraints

from pipeline._settings import Settings

if TYPE_CHECKING:
    from pipeline.client import ChatClient, EmbeddingGenerator

__all__ = [
    "AnthropicSettings",
    "AzureOpenAISettings",
    "ChatCompletionsSettings",
    "Credentials",
    "EmbeddingsSettings",
    "EnvironmentVariable",
    "HTTPProviderSettings",
    "HashingEmbeddingsSettings",
    "HttpUrl",
    "KeyedEndpoint",
    "Name",
    "OllamaSettings",
    "OpenAIEmbeddingsSettings",
    "OpenAIEndpoint",
    "OpenAIResponsesSettings",
    "OpenAISettings",
    "ProviderSettings",
    "ScriptedSettings",
    "Seconds",
]

Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
Seconds = Annotated[float, Field(gt=0, le=86_400)]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_name(value: str) -> str:
    if not _ENV_NAME.match(value):
        raise ValueError("expected the name of an environment variable (letters, digits, _)")
    return value


def _http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        raise ValueError("expected an http(s) URL; this one does not parse") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "credentials do not belong in a URL: secrets come only from environment variables"
        )
    return value


EnvironmentVariable = Annotated[str, AfterValidator(_env_name)]
"""The name of an environment variable (secrets are read from one, never written)."""
HttpUrl = Annotated[str, AfterValidator(_http_url)]
"""An http(s) URL with a host and without credentials."""


class Credentials(Settings):
    """Where an API key comes from: by default, nowhere (the service takes none)."""

    def key_variable(self) -> str | None:
        """The environment variable holding the API key (None: no key is taken)."""
        return None

    def requires_key(self) -> bool:
        """Whether that variable must be set (the vendors' own endpoints need a key)."""
        return False


class ProviderSettings(Credentials):
    """How a route reaches its model: `client()` builds the provider's client."""

    @abc.abstractmethod
    def client(self, name: str, api_key: str | None) -> ChatClient:
        """The provider's client, named `name`, authenticated with `api_key`."""


class KeyedEndpoint(Credentials):
    """An endpoint taking an API key from the variable `api_key_env` names, else from
    `default_key_variable` (the one the provider's constructor reads)."""

    default_key_variable: ClassVar[str]

    api_key_env: EnvironmentVariable | None = None

    def key_variable(self) -> str | None:
        return self.api_key_env or self.default_key_variable


class _HTTPOptions(TypedDict, total=False):
    transport: Literal["aiohttp", "httpx2"] | None
    timeout: float
    first_chunk_timeout: float | None
    stream_idle_timeout: float | None
    name: str


class _ChatCompletionsOptions(_HTTPOptions, total=False):
    max_tokens_field: str | None


class HTTPProviderSettings(ProviderSettings):
    """A provider over HTTP: `transport` (``aiohttp`` or ``httpx2``; unset: the provider's
    default), `timeout` (seconds per request; unset: the provider's default, 60 s with 10 s to
    connect), `first_chunk_timeout` and `stream_idle_timeout` (unset: none)."""

    transport: Literal["aiohttp", "httpx2"] | None = None
    timeout: Seconds | None = None
    first_chunk_timeout: Seconds | None = None
    stream_idle_timeout: Seconds | None = None

    def _http_options(self, name: str) -> _HTTPOptions:
        options: _HTTPOptions = {
            "transport": self.transport,
            "first_chunk_timeout": self.first_chunk_timeout,
            "stream_idle_timeout": self.stream_idle_timeout,
            "name": name,
        }
        if self.timeout is not None:
            options["timeout"] = self.timeout
        return options


class ChatCompletionsSettings(HTTPProviderSettings):
    """A Chat Completions server. `max_tokens_field` names the body field carrying the
    output limit (unset: the provider's own; servers that ignore ``max_completion_tokens``,
    such as llama.cpp, need ``max_tokens``)."""

    max_tokens_field: Literal["max_completion_tokens", "max_tokens"] | None = None

    def _chat_options(self, name: str) -> _ChatCompletionsOptions:
        return {**self._http_options(name), "max_tokens_field": self.max_tokens_field}


class OpenAIEndpoint(KeyedEndpoint):
    """An OpenAI-compatible endpoint: its model, URL and the variable holding its key
    (``OPENAI_API_KEY`` unless named; required on api.openai.com only)."""

    default_key_variable: ClassVar[str] = "OPENAI_API_KEY"

    model: Name
    base_url: HttpUrl = "https://api.openai.com/v1"

    def requires_key(self) -> bool:
        return self.base_url.startswith("https://api.openai.com")


class OpenAISettings(OpenAIEndpoint, ChatCompletionsSettings):
    """``provider = "openai"``: OpenAI or any Chat Completions server (`OpenAIChatClient`)."""

    provider: Literal["openai"] = "openai"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.openai import OpenAIChatClient

        return OpenAIChatClient(
            self.model, api_key=api_key, base_url=self.base_url, **self._chat_options(name)
        )


class OpenAIResponsesSettings(OpenAIEndpoint, HTTPProviderSettings):
    """``provider = "openai_responses"``: OpenAI's Responses API, or a server speaking it
    (`OpenAIResponsesChatClient`)."""

    provider: Literal["openai_responses"] = "openai_responses"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.openai_responses import OpenAIResponsesChatClient

        return OpenAIResponsesChatClient(
            self.model, api_key=api_key, base_url=self.base_url, **self._http_options(name)
        )


class AzureOpenAISettings(KeyedEndpoint, ChatCompletionsSettings):
    """``provider = "azure_openai"``: a deployment of Azure OpenAI (`AzureOpenAIChatClient`);
    its key (``AZURE_OPENAI_API_KEY`` unless named) is always required."""

    default_key_variable: ClassVar[str] = "AZURE_OPENAI_API_KEY"

    provider: Literal["azure_openai"] = "azure_openai"
    endpoint: HttpUrl
    deployment: Name
    api_version: Name = "2024-10-21"

    def requires_key(self) -> bool:
        return True

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.azure import AzureOpenAIChatClient

        return AzureOpenAIChatClient(
            endpoint=self.endpoint,
            deployment=self.deployment,
            api_version=self.api_version,
            api_key=api_key,
            **self._chat_options(name),
        )


class OllamaSettings(ChatCompletionsSettings):
    """``provider = "ollama"``: a local Ollama server (`OllamaChatClient`); no key."""

    provider: Literal["ollama"] = "ollama"
    model: Name
    base_url: HttpUrl = "http://localhost:11434/v1"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.ollama import OllamaChatClient

        return OllamaChatClient(self.model, base_url=self.base_url, **self._chat_options(name))


class AnthropicSettings(KeyedEndpoint, HTTPProviderSettings):
    """``provider = "anthropic"``: the Messages API (`AnthropicChatClient`); its key
    (``ANTHROPIC_API_KEY`` unless named) is required on api.anthropic.com. `max_tokens` is
    sent when a request sets no output limit (the API requires one)."""

    default_key_variable: ClassVar[str] = "ANTHROPIC_API_KEY"

    provider: Literal["anthropic"] = "anthropic"
    model: Name
    base_url: HttpUrl = "https://api.anthropic.com"
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    anthropic_version: Name = "2023-06-01"

    def requires_key(self) -> bool:
        return self.base_url.startswith("https://api.anthropic.com")

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.anthropic import AnthropicChatClient

        return AnthropicChatClient(
            self.model,
            api_key=api_key,
            base_url=self.base_url,
            max_tokens=self.max_tokens,
            anthropic_version=self.anthropic_version,
            **self._http_options(name),
        )


class ScriptedSettings(ProviderSettings):
    """``provider = "scripted"``: an in-process simulated model answering `reply` (for
    development, demos and tests; `ScriptedChatClient`)."""

    provider: Literal["scripted"] = "scripted"
    reply: str = "Simulated answer."
    model: Name = "scripted-model"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.testing._scripted import ScriptedChatClient, reply

        return ScriptedChatClient(reply(self.reply), name=name, model_id=self.model)


# -- embeddings (a semantic router's) ---------------------------------------------------------


class EmbeddingsSettings(Credentials):
    """How a semantic router embeds: `generator()` builds the embedding generator."""

    @abc.abstractmethod
    def generator(self, api_key: str | None) -> EmbeddingGenerator:
        """The embedding generator, authenticated with `api_key`."""


class HashingEmbeddingsSettings(EmbeddingsSettings):
    """``provider = "hashing"``: offline, deterministic n-gram hashing
    (`HashingEmbeddingGenerator`; not a semantic model)."""

    provider: Literal["hashing"] = "hashing"
    dimensions: Annotated[int, Field(ge=2, le=65_536)] = 384

    def generator(self, api_key: str | None) -> EmbeddingGenerator:
        from pipeline.providers.hashing import HashingEmbeddingGenerator

        return HashingEmbeddingGenerator(dimensions=self.dimensions)


class OpenAIEmbeddingsSettings(OpenAIEndpoint, EmbeddingsSettings):
    """``provider = "openai"``: an OpenAI-compatible embeddings endpoint
    (`OpenAIEmbeddingGenerator`)."""

    provider: Literal["openai"] = "openai"

    def generator(self, api_key: str | None) -> EmbeddingGenerator:
        from pipeline.providers.embeddings import OpenAIEmbeddingGenerator

        return OpenAIEmbeddingGenerator(self.model, api_key=api_key, base_url=self.base_url)
