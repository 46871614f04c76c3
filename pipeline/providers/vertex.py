"""`VertexChatClient`: models on Google Cloud's Vertex AI with Google credentials: Gemini
(``generateContent``, the `GeminiChatClient` wire) and Anthropic's (the Messages API
through ``rawPredict``, the `AnthropicChatClient` wire).

Failure boundaries are those of the wire's own client. Vertex AI's own errors (quota,
permissions, a model not enabled) are Google's shape for either publisher and map as the
Gemini client's do; a refused credential is an `AuthenticationError`.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, ClassVar

import httpx2
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GenAiProviderNameValues,
)

from pipeline.providers._base import HTTPChatClient
from pipeline.providers._google_auth import GoogleTokens, load_credentials, refusal
from pipeline.providers.anthropic import AnthropicChatClient
from pipeline.providers.gemini import GeminiChatClient
from pipeline.types import ChatOptions, Messages

if TYPE_CHECKING:
    from google.auth.credentials import Credentials

__all__ = ["PUBLISHERS", "VertexAnthropicChatClient", "VertexChatClient", "VertexGeminiChatClient"]

PUBLISHERS = ("google", "anthropic")
"""The model publishers a `VertexChatClient` speaks to."""
VERTEX_ANTHROPIC_VERSION = "vertex-2023-10-16"
"""The ``anthropic_version`` Anthropic's models on Vertex AI take, in the body."""

_LOCATION = re.compile(r"^[a-z0-9-]+$")
_logger = logging.getLogger("chat_pipeline.providers")


def publisher_of(model: str, publisher: str | None = None) -> str:
    """The publisher of `model`: `publisher` when given, else ``anthropic`` for Claude
    models and ``google`` for every other."""
    if publisher is None:
        return "anthropic" if model.startswith("claude") else "google"
    if publisher not in PUBLISHERS:
        raise ValueError(f"publisher must be one of {', '.join(PUBLISHERS)}, not {publisher!r}")
    return publisher


def vertex_url(location: str) -> str:
    """Vertex AI's endpoint for `location` (``global`` has no regional host)."""
    if location == "global":
        return "https://aiplatform.googleapis.com"
    return f"https://{location}-aiplatform.googleapis.com"


class VertexChatClient(HTTPChatClient):
    """A model on Vertex AI: ``VertexChatClient(model, project=..., location=...)`` is a
    `VertexGeminiChatClient` for Gemini models and a `VertexAnthropicChatClient` for
    Anthropic's (``claude-...``; `publisher` says which when the name does not).

    `credentials` are google-auth credentials, or the path of a credentials file (a
    service account key...); None reads Application Default Credentials. Tokens are
    refreshed before they expire, in the background (`GoogleTokens`), and never appear in
    `repr`, errors, logs or telemetry. Requests go to
    ``{base_url}/{api_version}/projects/{project}/locations/{location}/publishers/
    {publisher}/models/{model}:{method}``; `base_url` defaults to the location's endpoint.
    The other keywords are the wire's client's (`GeminiChatClient`, or
    `AnthropicChatClient`'s with `max_tokens`).
    """

    provider_name = GenAiProviderNameValues.GCP_VERTEX_AI.value
    api_key_env: ClassVar[str | None] = None
    default_base_url = ""

    def __new__(
        cls,
        model: str,
        *,
        project: str,
        location: str,
        credentials: Credentials | str | None = None,
        publisher: str | None = None,
        **options: Any,
    ) -> VertexChatClient:
        if cls is VertexChatClient:
            anthropic = publisher_of(model, publisher) == "anthropic"
            cls = VertexAnthropicChatClient if anthropic else VertexGeminiChatClient
        return super().__new__(cls)

    def __init__(
        self,
        model: str,
        *,
        project: str,
        location: str,
        credentials: Credentials | str | None = None,
        publisher: str | None = None,
        base_url: str | None = None,
        api_version: str = "v1",
        **options: Any,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty string")
        if not isinstance(project, str) or not project:
            raise ValueError("project must be a non-empty string (the Google Cloud project)")
        if not isinstance(location, str) or not _LOCATION.match(location):
            raise ValueError("location must be a Vertex AI location, such as 'us-central1'")
        self.project = project
        self.location = location
        self.publisher = publisher_of(model, publisher)
        self.api_version = api_version
        if credentials is None or isinstance(credentials, str):
            credentials = load_credentials(credentials)
        self._tokens = GoogleTokens(credentials, self.provider_name)
        super().__init__(model, base_url=base_url or vertex_url(location), **options)

    def _model_path(self) -> str:
        return (
            f"{self.api_version}/projects/{self.project}/locations/{self.location}/"
            f"publishers/{self.publisher}/models/{self.model}"
        )

    def _method_url(self, method: str) -> httpx2.URL:
        base = self._base_url
        return base.copy_with(path=f"{base.path}{self._model_path()}:{method}")

    def _static_auth_headers(self) -> dict[str, str]:
        return {}

    async def _request_headers(self) -> dict[str, str]:
        return {**self._headers, "Authorization": await self._tokens.authorization()}

    def check_credentials(self) -> None:
        """Get a token now, in this thread (at startup): `ValueError` when Google refuses
        the credentials (expired, revoked, unknown); a token endpoint that cannot be
        reached is only logged, and the first request tries again."""
        try:
            self._tokens.refresh_now()
        except Exception as exc:
            code = refusal(exc)
            if code is not None:
                raise ValueError(f"Google refused the credentials ({code})") from None
            _logger.warning(
                "no Google access token for %s at startup (%s): the first request tries again",
                self.model,
                type(exc).__name__,
            )


class VertexGeminiChatClient(VertexChatClient, GeminiChatClient):
    """Gemini on Vertex AI (``:generateContent``, ``:streamGenerateContent?alt=sse``)."""


class VertexAnthropicChatClient(VertexChatClient, AnthropicChatClient):
    """Anthropic's models on Vertex AI: the Messages API's body without ``model`` and with
    ``anthropic_version`` (`VERTEX_ANTHROPIC_VERSION`), at ``:rawPredict`` and
    ``:streamRawPredict``."""

    def __init__(self, model: str, **options: Any) -> None:
        options.setdefault("anthropic_version", VERTEX_ANTHROPIC_VERSION)
        super().__init__(model, **options)
        # The version goes in the body here, not in a header.
        self._headers.pop("anthropic-version", None)

    def _chat_url(self) -> httpx2.URL:
        return self._method_url("rawPredict")

    def _stream_url(self) -> httpx2.URL:
        return self._method_url("streamRawPredict")

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        body = super()._body(messages, options, stream)
        del body["model"]  # the URL names it
        return {"anthropic_version": self.anthropic_version, **body}
