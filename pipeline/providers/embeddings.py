"""`OpenAIEmbeddingGenerator`: the ``/embeddings`` endpoint, batched, as a float32 matrix."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx2
import numpy as np
import numpy.typing as npt

from pipeline.providers._http import (
    TransportName,
    encode_json,
    endpoint,
    service_url,
    traced,
)
from pipeline.providers._transports import make_transport
from pipeline.providers.openai import _DEFAULT_TIMEOUT, DEFAULT_BASE_URL
from pipeline.wire import malformed

if TYPE_CHECKING:
    import aiohttp

__all__ = ["OpenAIEmbeddingGenerator"]


class OpenAIEmbeddingGenerator:
    """Embeds texts with an OpenAI-compatible ``/embeddings`` endpoint.

    `generate(values)` returns a float32 array of shape ``(len(values), d)`` in input order,
    sending at most `batch_size` texts per request. A wrong count, ragged or non-numeric
    vectors, or a malformed body raise `ProviderError`; HTTP and transport failures map as
    for `OpenAIChatClient`, and `transport`, `http_client` and `timeout` mean what they mean
    there.
    """

    provider_name = "openai"

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str = DEFAULT_BASE_URL,
        http_client: httpx2.AsyncClient | aiohttp.ClientSession | None = None,
        transport: TransportName | None = None,
        timeout: float | httpx2.Timeout = _DEFAULT_TIMEOUT,
        batch_size: int = 256,
        dimensions: int | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError("batch_size must be a positive int")
        if dimensions is not None and (not isinstance(dimensions, int) or dimensions < 1):
            raise ValueError("dimensions must be a positive int or None")
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or None
        if api_key is None and base_url.rstrip("/") == DEFAULT_BASE_URL:
            raise ValueError(f"an API key is needed for {DEFAULT_BASE_URL}")
        self.model = model
        self.batch_size = batch_size
        self.dimensions = dimensions
        self._api_key = api_key
        base, basic_auth = service_url(base_url)
        self._basic_auth = basic_auth
        url = base.join("embeddings")
        self._endpoint = endpoint(url)
        self._transport = make_transport(transport, http_client, timeout, base)
        self._target = self._transport.target(url)

    @property
    def identity(self) -> str:
        """What a saved semantic index records as its embedder: the model (and dimensions),
        not the URL, so an index moves between deployments of the same model."""
        suffix = "" if self.dimensions is None else f"@{self.dimensions}"
        return f"openai:{self.model}{suffix}"

    def __repr__(self) -> str:
        return f"OpenAIEmbeddingGenerator(model={self.model!r}, url={self._endpoint!r})"

    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        if isinstance(values, str) or not all(isinstance(v, str) for v in values):
            raise TypeError("values must be a sequence of str")
        batches = [
            await self._batch(list(values[i : i + self.batch_size]))
            for i in range(0, len(values), self.batch_size)
        ]
        if not batches:
            return np.zeros((0, self.dimensions or 0), dtype=np.float32)
        if len({b.shape[1] for b in batches}) != 1:
            raise malformed(self.provider_name, "batches returned different dimensions")
        return np.concatenate(batches, axis=0)

    async def _batch(self, values: list[str]) -> npt.NDArray[np.float32]:
        body: dict[str, object] = {"model": self.model, "input": values, "encoding_format": "float"}
        if self.dimensions is not None:
            body["dimensions"] = self.dimensions
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        elif self._basic_auth is not None:
            headers["Authorization"] = self._basic_auth
        payload = await self._transport.post_json(
            self._target, encode_json(body), traced(headers), self.provider_name, self._endpoint
        )
        return self._parse(payload, len(values))

    def _parse(self, payload: object, expected: int) -> npt.NDArray[np.float32]:
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            raise malformed(self.provider_name, "no 'data' list in the embeddings response")
        if len(data) != expected:
            raise malformed(
                self.provider_name, f"{len(data)} embeddings returned for {expected} inputs"
            )
        try:
            ordered = sorted(data, key=lambda item: item["index"])
            matrix = np.asarray([item["embedding"] for item in ordered], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as exc:
            raise malformed(self.provider_name, "embeddings are not numeric vectors") from exc
        if matrix.ndim != 2 or not np.isfinite(matrix).all():
            raise malformed(self.provider_name, "embeddings are ragged or not finite")
        return matrix

    async def aclose(self) -> None:
        await self._transport.aclose()
