"""`AzureOpenAIChatClient`: Chat Completions on an Azure OpenAI deployment."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Unpack

import httpx2

from pipeline.providers.openai import ClientOptions, OpenAIChatClient
from pipeline.types import ChatOptions

__all__ = ["AzureOpenAIChatClient"]

TokenProvider = Callable[[], str | Awaitable[str]]


class AzureOpenAIChatClient(OpenAIChatClient):
    """Calls ``{endpoint}/openai/deployments/{deployment}/chat/completions?api-version=...``.

    Authenticates with an ``api-key`` header (`api_key` or ``AZURE_OPENAI_API_KEY``) or a
    bearer token from `token_provider` (sync or async; called per request, so it may cache
    and refresh). Exactly one of the two is needed. Failure boundaries are those of
    `OpenAIChatClient`; a content-filter refusal is a `ContentFilteredError`.
    """

    provider_name = "azure.ai.openai"
    api_key_env = "AZURE_OPENAI_API_KEY"
    max_tokens_field = "max_tokens"

    def __init__(
        self,
        *,
        endpoint: str,
        deployment: str,
        api_version: str = "2024-10-21",
        api_key: str | None = None,
        token_provider: TokenProvider | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        if not deployment:
            raise ValueError("deployment must be a non-empty string")
        if not endpoint.startswith(("https://", "http://")):
            raise ValueError("endpoint must be an http(s) URL")
        if token_provider is None and api_key is None:
            import os

            api_key = os.environ.get(self.api_key_env or "") or None
            if api_key is None:
                raise ValueError(
                    "Azure OpenAI needs api_key=, AZURE_OPENAI_API_KEY or token_provider="
                )
        if token_provider is not None and api_key is not None:
            raise ValueError("pass either api_key= or token_provider=, not both")
        if token_provider is not None and not callable(token_provider):
            raise TypeError("token_provider must be a callable returning a bearer token")
        self.deployment = deployment
        self.api_version = api_version
        self._token_provider = token_provider
        super().__init__(
            deployment,
            api_key=api_key,
            base_url=endpoint.rstrip("/") + f"/openai/deployments/{deployment}",
            **options,
        )

    def _chat_url(self) -> httpx2.URL:
        return self._base_url.join("chat/completions").copy_merge_params(
            {"api-version": self.api_version}
        )

    def _static_auth_headers(self) -> dict[str, str]:
        return {} if self._token_provider is not None else {"api-key": self._api_key or ""}

    async def _request_headers(self) -> dict[str, str]:
        if self._token_provider is None:
            return self._headers
        token = self._token_provider()
        if inspect.isawaitable(token):
            token = await token
        return {**self._headers, "Authorization": f"Bearer {token}"}

    def _body_model(self, options: ChatOptions | None) -> str | None:
        return None  # the deployment in the URL names the model

    def _requires_model(self) -> bool:
        return False
