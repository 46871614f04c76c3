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
import importlib
import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypedDict
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from pipeline._settings import Settings
from pipeline.errors import ConfigError
from pipeline.providers._vendors import VENDORS, VendorName

if TYPE_CHECKING:
    from pipeline.client import ChatClient, EmbeddingGenerator

__all__ = [
    "AnthropicSettings",
    "AzureOpenAISettings",
    "BedrockSettings",
    "ChatCompletionsSettings",
    "Credentials",
    "EmbeddingsSettings",
    "EnvironmentVariable",
    "GeminiSettings",
    "HTTPProviderSettings",
    "HashingEmbeddingsSettings",
    "HttpUrl",
    "KeyedEndpoint",
    "LocalEmbeddingsSettings",
    "Name",
    "OllamaSettings",
    "OpenAIEmbeddingsSettings",
    "OpenAIEndpoint",
    "OpenAIResponsesSettings",
    "OpenAISettings",
    "ProviderSettings",
    "ScriptedSettings",
    "Seconds",
    "VendorSettings",
    "VertexSettings",
]

Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
Seconds = Annotated[float, Field(gt=0, le=86_400)]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_name(value: str) -> str:
    if not _ENV_NAME.fullmatch(value):
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

    client_class_path: ClassVar[str | None] = None
    """The dotted path of the client class `client()` builds, when one class serves every
    route of the kind (imported only when asked for: a provider's extra may be missing)."""

    def gen_ai_provider_name(self) -> str | None:
        """The ``gen_ai.provider.name`` this route's client reports (what a price book prices
        it by); None for a client that names no provider."""
        path = self.client_class_path
        if path is None:
            return None
        module, _, name = path.rpartition(".")
        provider_name: str | None = getattr(importlib.import_module(module), name).provider_name
        return provider_name

    @abc.abstractmethod
    def client(self, name: str, api_key: str | None) -> ChatClient:
        """The provider's client, named `name`, authenticated with `api_key`."""


class KeyedEndpoint(Credentials):
    """An endpoint taking an API key from the variable `api_key_env` names, else from
    `default_key_variable` (the one the provider's constructor reads)."""

    default_key_variable: ClassVar[str]

    api_key_env: EnvironmentVariable | None = None
    """The environment variable holding the API key (unset: the provider's own, such as
    `OPENAI_API_KEY`). A key is never written in the file."""

    def key_variable(self) -> str | None:
        return self.api_key_env or self.default_key_variable


class _HTTPOptions(TypedDict, total=False):
    transport: Literal["aiohttp", "httpx2"] | None
    timeout: float
    first_chunk_timeout: float | None
    stream_idle_timeout: float | None
    max_response_bytes: int
    name: str


class _ChatCompletionsOptions(_HTTPOptions, total=False):
    max_tokens_field: str | None


class HTTPProviderSettings(ProviderSettings):
    """A provider over HTTP: `transport` (``aiohttp`` or ``httpx2``; unset: the provider's
    default), `timeout` (seconds per request; unset: the provider's default, 60 s with 10 s to
    connect), `first_chunk_timeout` and `stream_idle_timeout` (unset: none)."""

    transport: Literal["aiohttp", "httpx2"] | None = None
    """The HTTP client library: `aiohttp` (the providers' default) or `httpx2`; unset: the
    provider's default."""
    timeout: Seconds | None = None
    """Seconds a request may take, read as httpx2 reads a timeout (each wait for the server); unset:
    the provider's default, 60 s with 10 s to connect."""
    first_chunk_timeout: Seconds | None = None
    """Seconds a stream may take to send its first chunk before it fails as a transient error
    (unset: no such bound)."""
    stream_idle_timeout: Seconds | None = None
    """Seconds a stream may stay silent between two chunks before it fails as a transient error
    (unset: no such bound)."""
    max_response_bytes: Annotated[int, Field(ge=1)] = 64 * 1024 * 1024
    """The most a non-streamed answer's body may hold once decompressed, in bytes (default
    64 MiB): a larger one fails with a `ProviderError` (code ``response_too_large``) as
    soon as it passes the bound, so a compressed body that expands without end never fills
    memory."""

    def _http_options(self, name: str) -> _HTTPOptions:
        options: _HTTPOptions = {
            "transport": self.transport,
            "first_chunk_timeout": self.first_chunk_timeout,
            "stream_idle_timeout": self.stream_idle_timeout,
            "max_response_bytes": self.max_response_bytes,
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
    """The body field that carries the output limit: `max_completion_tokens` (OpenAI's current one)
    or `max_tokens` (servers that ignore the newer field: llama.cpp, vLLM, Ollama); unset: the
    provider's own default."""

    def _chat_options(self, name: str) -> _ChatCompletionsOptions:
        return {**self._http_options(name), "max_tokens_field": self.max_tokens_field}


class OpenAIEndpoint(KeyedEndpoint):
    """An OpenAI-compatible endpoint: its model, URL and the variable holding its key
    (``OPENAI_API_KEY`` unless named; required on api.openai.com only)."""

    default_key_variable: ClassVar[str] = "OPENAI_API_KEY"

    model: Name
    """The model name sent to the endpoint."""
    base_url: HttpUrl = "https://api.openai.com/v1"
    """The endpoint's base URL, up to and including `/v1` (an http(s) URL without credentials); a
    key is required only on api.openai.com."""

    def requires_key(self) -> bool:
        return self.base_url.startswith("https://api.openai.com")


class OpenAISettings(OpenAIEndpoint, ChatCompletionsSettings):
    """``provider = "openai"``: OpenAI or any Chat Completions server (`OpenAIChatClient`)."""

    provider: Literal["openai"] = "openai"
    """`openai`: OpenAI, or any server speaking Chat Completions (`OpenAIChatClient`)."""

    client_class_path: ClassVar[str | None] = "pipeline.providers.openai.OpenAIChatClient"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.openai import OpenAIChatClient

        return OpenAIChatClient(
            self.model, api_key=api_key, base_url=self.base_url, **self._chat_options(name)
        )


class OpenAIResponsesSettings(OpenAIEndpoint, HTTPProviderSettings):
    """``provider = "openai_responses"``: OpenAI's Responses API, or a server speaking it
    (`OpenAIResponsesChatClient`)."""

    provider: Literal["openai_responses"] = "openai_responses"
    """`openai_responses`: OpenAI's Responses API, or a server speaking it
    (`OpenAIResponsesChatClient`)."""

    client_class_path: ClassVar[str | None] = (
        "pipeline.providers.openai_responses.OpenAIResponsesChatClient"
    )

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
    """`azure_openai`: a deployment of Azure OpenAI (`AzureOpenAIChatClient`); its key
    (`AZURE_OPENAI_API_KEY` unless `api_key_env` names another) is always required."""
    endpoint: HttpUrl
    """The resource's endpoint, such as `https://NAME.openai.azure.com`."""
    deployment: Name
    """The deployment's name (Azure routes by deployment, not by model)."""
    api_version: Name = "2024-10-21"
    """The `api-version` query parameter sent with every request."""

    def requires_key(self) -> bool:
        return True

    client_class_path: ClassVar[str | None] = "pipeline.providers.azure.AzureOpenAIChatClient"

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
    """`ollama`: a local Ollama server's OpenAI-compatible endpoint (`OllamaChatClient`); no key is
    read or sent."""
    model: Name
    """The model name, as Ollama knows it (`llama3.2`)."""
    base_url: HttpUrl = "http://localhost:11434/v1"
    """The Ollama server's `/v1` endpoint."""

    client_class_path: ClassVar[str | None] = "pipeline.providers.ollama.OllamaChatClient"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.ollama import OllamaChatClient

        return OllamaChatClient(self.model, base_url=self.base_url, **self._chat_options(name))


class AnthropicSettings(KeyedEndpoint, HTTPProviderSettings):
    """``provider = "anthropic"``: the Messages API (`AnthropicChatClient`); its key
    (``ANTHROPIC_API_KEY`` unless named) is required on api.anthropic.com. `max_tokens` is
    sent when a request sets no output limit (the API requires one)."""

    default_key_variable: ClassVar[str] = "ANTHROPIC_API_KEY"

    provider: Literal["anthropic"] = "anthropic"
    """`anthropic`: the Anthropic Messages API (`AnthropicChatClient`); its key (`ANTHROPIC_API_KEY`
    unless `api_key_env` names another) is required on api.anthropic.com."""
    model: Name
    """The model name (`claude-sonnet-4-5`)."""
    base_url: HttpUrl = "https://api.anthropic.com"
    """The API's base URL, without `/v1` (the client calls `{base_url}/v1/messages`)."""
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    """The output limit sent when a request sets none (the Messages API requires one)."""
    anthropic_version: Name = "2023-06-01"
    """The `anthropic-version` header sent with every request."""

    def requires_key(self) -> bool:
        return self.base_url.startswith("https://api.anthropic.com")

    client_class_path: ClassVar[str | None] = "pipeline.providers.anthropic.AnthropicChatClient"

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


class BedrockSettings(HTTPProviderSettings):
    """``provider = "bedrock"``: Amazon Bedrock's Converse API (`BedrockChatClient`, the
    ``bedrock`` extra), signed with the credentials botocore's chain finds (the environment,
    `profile`, a role); none found, or expired, is a configuration error at startup."""

    provider: Literal["bedrock"] = "bedrock"
    """`bedrock`: Amazon Bedrock's Converse API (`BedrockChatClient`); AWS credentials from the
    environment (`AWS_ACCESS_KEY_ID`...), the shared config's `profile`, or a role."""
    model: Name
    """The model id, inference profile or ARN (`anthropic.claude-sonnet-4-5-20250929-v1:0`,
    `us.amazon.nova-pro-v1:0`)."""
    region: Name | None = None
    """The AWS region (unset: `AWS_REGION`, or the profile's)."""
    profile: Name | None = None
    """A profile of the shared AWS config and credentials files (unset: the default chain)."""
    base_url: HttpUrl | None = None
    """An endpoint in place of the region's `https://bedrock-runtime.{region}.amazonaws.com` (a
    VPC endpoint, a proxy)."""
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """The output limit sent when a request sets none (unset: the model's own)."""

    client_class_path: ClassVar[str | None] = "pipeline.providers.bedrock.BedrockChatClient"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.bedrock import BedrockChatClient

        return BedrockChatClient(
            self.model,
            region=self.region,
            profile=self.profile,
            base_url=self.base_url,
            max_tokens=self.max_tokens,
            **self._http_options(name),
        )


class VendorSettings(KeyedEndpoint, ChatCompletionsSettings):
    """``provider = "groq" | "mistral" | "deepseek" | "together" | "fireworks" | "openrouter" |
    "xai" | "vllm"``: an OpenAI-compatible vendor by name (`pipeline.providers.vendors`): its
    endpoint, key variable and quirks are the preset's, so a route is a provider and a
    model."""

    provider: VendorName
    """The vendor: `groq`, `mistral`, `deepseek`, `together`, `fireworks`, `openrouter`, `xai` or
    `vllm` (its endpoint, key variable and the fields it refuses or renames come with it)."""
    model: Name
    """The model name, as the vendor knows it (`llama-3.3-70b-versatile`, `deepseek-chat`)."""
    base_url: HttpUrl | None = None
    """Another endpoint of the vendor's API (unset: the vendor's own; for `vllm`,
    `http://localhost:8000/v1`)."""
    app_url: HttpUrl | None = None
    """OpenRouter only: your site's URL, sent as `HTTP-Referer` (OpenRouter's attribution)."""
    app_name: Name | None = None
    """OpenRouter only: your app's name, sent as `X-Title`."""

    @model_validator(mode="after")
    def _openrouter_only(self) -> VendorSettings:
        if self.provider != "openrouter" and (self.app_url or self.app_name):
            raise ValueError("app_url and app_name are OpenRouter's: no other vendor reads them")
        return self

    def key_variable(self) -> str | None:
        return self.api_key_env or VENDORS[self.provider].key_variable

    def requires_key(self) -> bool:
        return self.base_url is None and VENDORS[self.provider].key_required

    def gen_ai_provider_name(self) -> str | None:
        from pipeline.providers.vendors import VENDOR_CLIENTS

        return VENDOR_CLIENTS[self.provider].provider_name

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.vendors import VENDOR_CLIENTS, OpenRouterChatClient

        options = self._chat_options(name)
        if self.provider == "openrouter":
            return OpenRouterChatClient(
                self.model,
                api_key=api_key,
                base_url=self.base_url,
                app_url=self.app_url,
                app_name=self.app_name,
                **options,
            )
        vendor = VENDOR_CLIENTS[self.provider]
        return vendor(self.model, api_key=api_key, base_url=self.base_url, **options)


class GeminiSettings(KeyedEndpoint, HTTPProviderSettings):
    """``provider = "gemini"``: Google's Gemini API (`GeminiChatClient`); its key
    (``GEMINI_API_KEY`` unless named) is required on generativelanguage.googleapis.com."""

    default_key_variable: ClassVar[str] = "GEMINI_API_KEY"

    provider: Literal["gemini"] = "gemini"
    """`gemini`: Google's Gemini API (`GeminiChatClient`); its key (`GEMINI_API_KEY` unless
    `api_key_env` names another) is required on generativelanguage.googleapis.com."""
    model: Name
    """The model name (`gemini-2.5-flash`)."""
    base_url: HttpUrl = "https://generativelanguage.googleapis.com/v1beta"
    """The API version's root (the client calls `{base_url}/models/{model}:generateContent`)."""

    def requires_key(self) -> bool:
        return self.base_url.startswith("https://generativelanguage.googleapis.com")

    client_class_path: ClassVar[str | None] = "pipeline.providers.gemini.GeminiChatClient"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.gemini import GeminiChatClient

        return GeminiChatClient(
            self.model, api_key=api_key, base_url=self.base_url, **self._http_options(name)
        )


def _google_credentials(path: str | None) -> str | None:
    # Checked when the file is read: a route whose credentials are missing fails at
    # startup, naming this key, never on each request.
    from pipeline.providers._google_auth import load_credentials

    load_credentials(path)
    return path


class VertexSettings(HTTPProviderSettings):
    """``provider = "vertex"``: a model on Google Cloud's Vertex AI (`VertexChatClient`):
    Gemini, or Anthropic's (``claude-...``), with Google credentials (`credentials_file`, else
    Application Default Credentials), checked when the file is read and again, for a token,
    when the route is built."""

    provider: Literal["vertex"] = "vertex"
    """`vertex`: a Gemini or an Anthropic model on Vertex AI (`VertexChatClient`)."""
    model: Name
    """The model name (`gemini-2.5-flash`, `claude-sonnet-4-5@20250929`)."""
    project: Name
    """The Google Cloud project."""
    location: Annotated[str, StringConstraints(pattern=r"^[a-z0-9-]+$")]
    """The Vertex AI location (`us-central1`, `europe-west4`, `global`)."""
    credentials_file: Annotated[str | None, AfterValidator(_google_credentials)] = Field(
        default=None, validate_default=True
    )
    """A Google credentials file (a service account key); unset: Application Default
    Credentials (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud's, or the metadata server's)."""
    publisher: Literal["google", "anthropic"] | None = None
    """Who publishes the model: `google` or `anthropic`; unset: `anthropic` for `claude-*`
    models, `google` for the others."""
    base_url: HttpUrl | None = None
    """Vertex AI's endpoint; unset: the location's (`https://{location}-aiplatform.googleapis.com`)."""
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    """Anthropic models only: the output limit sent when a request sets none."""

    client_class_path: ClassVar[str | None] = "pipeline.providers.vertex.VertexChatClient"

    def client(self, name: str, api_key: str | None) -> ChatClient:
        from pipeline.providers.vertex import VertexChatClient, publisher_of

        options: dict[str, Any] = dict(self._http_options(name))
        if publisher_of(self.model, self.publisher) == "anthropic":
            options["max_tokens"] = self.max_tokens
        client = VertexChatClient(
            self.model,
            project=self.project,
            location=self.location,
            credentials=self.credentials_file,
            publisher=self.publisher,
            base_url=self.base_url,
            **options,
        )
        try:
            client.check_credentials()
        except ValueError as exc:
            raise ConfigError(f"routes.{name}.credentials_file", str(exc)) from None
        return client


class ScriptedSettings(ProviderSettings):
    """``provider = "scripted"``: an in-process simulated model answering `reply` (for
    development, demos and tests; `ScriptedChatClient`)."""

    provider: Literal["scripted"] = "scripted"
    """`scripted`: an in-process simulated model that answers `reply`, for development, demos and
    tests (`ScriptedChatClient`); no network, no key."""
    reply: str = "Simulated answer."
    """The text every request is answered with."""
    model: Name = "scripted-model"
    """The model name the answers report."""

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
    """`hashing`: offline, deterministic hashed character n-grams (`HashingEmbeddingGenerator`): for
    tests and demos, not a semantic model."""
    dimensions: Annotated[int, Field(ge=2, le=65_536)] = 384
    """The length of each embedding vector."""

    def generator(self, api_key: str | None) -> EmbeddingGenerator:
        from pipeline.providers.hashing import HashingEmbeddingGenerator

        return HashingEmbeddingGenerator(dimensions=self.dimensions)


class LocalEmbeddingsSettings(EmbeddingsSettings):
    """``provider = "local"``: a sentence-transformers model on this machine, run off the
    event loop (`LocalEmbeddingGenerator`; the ``local`` extra)."""

    provider: Literal["local"] = "local"
    """`local`: a model on this machine, through sentence-transformers."""
    model: Name
    """The model's directory, or a sentence-transformers model name (looked up in the
    Hugging Face cache, then the Hub: pass a directory where there is no network)."""
    batch_size: Annotated[int, Field(ge=1, le=65_536)] = 64
    """Texts per call of the model's ``encode``."""
    max_concurrency: Annotated[int, Field(ge=1, le=64)] = 1
    """Batches the model encodes at once (each in its own worker thread)."""
    name: Name | None = None
    """The model's name in a saved index (default: the model name, or the directory's name)."""
    device: Name | None = None
    """Where sentence-transformers runs the model (``cpu``, ``cuda``; default: its choice)."""

    def generator(self, api_key: str | None) -> EmbeddingGenerator:
        from pipeline.providers.local import LocalEmbeddingGenerator

        return LocalEmbeddingGenerator(
            self.model,
            batch_size=self.batch_size,
            max_concurrency=self.max_concurrency,
            name=self.name,
            device=self.device,
        )


class OpenAIEmbeddingsSettings(OpenAIEndpoint, EmbeddingsSettings):
    """``provider = "openai"``: an OpenAI-compatible embeddings endpoint
    (`OpenAIEmbeddingGenerator`)."""

    provider: Literal["openai"] = "openai"
    """`openai`: an OpenAI-compatible embeddings endpoint (`OpenAIEmbeddingGenerator`), its key from
    `api_key_env` (`OPENAI_API_KEY` unless named)."""

    def generator(self, api_key: str | None) -> EmbeddingGenerator:
        from pipeline.providers.embeddings import OpenAIEmbeddingGenerator

        return OpenAIEmbeddingGenerator(self.model, api_key=api_key, base_url=self.base_url)
