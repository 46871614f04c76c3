"""`OpenAIResponsesChatClient`: the OpenAI Responses API (``POST /v1/responses``) over HTTP.

Failure boundaries, for `get_response` and `get_streaming_response` alike, are those of
every HTTP provider here (see `pipeline.providers.openai`), on this API's wire:

* HTTP error statuses become `ProviderError`s of the matching kind, with `status_code`,
  `retry_after` (from ``Retry-After``) and the error's `code`;
* an ``error`` event, or ``response.failed`` (its ``response.error``), on a 200 stream
  becomes a `ProviderError` of its code's kind (``rate_limit_exceeded`` is `RATE_LIMITED`,
  ``server_error`` `TRANSIENT`...): before any content it is a pre-output failure a router
  may fail over; after content it is terminal;
* no first event within `first_chunk_timeout` is a transient (pre-output) failure; no event
  within `stream_idle_timeout` is transient;
* a stream that ends without ``response.completed`` (or ``response.incomplete``) is
  transient; malformed SSE or JSON is a `ProviderError` (kind `UNKNOWN`, code
  ``malformed``);
* error messages never contain the provider's body, prompt text or the API key.

A response's status becomes the finish reason other clients report: ``completed`` ->
``stop`` (``tool_calls`` when the model called functions), ``incomplete`` for
``max_output_tokens`` -> ``length``, for ``content_filter`` -> ``content_filter``; a
refusal is ``content_filter``. Requests send the whole conversation with ``store: false``.
"""

from __future__ import annotations

from typing import Any

import httpx2

from pipeline.client import check_options
from pipeline.providers._base import StreamReader
from pipeline.providers.openai import OpenAIAPIClient
from pipeline.types import (
    OPENAI_RESPONSES_EXTRAS,
    ChatOptions,
    ChatResponse,
    Messages,
    as_messages,
)
from pipeline.wire.responses.outbound import (
    END_EVENTS,
    ResponsesStreamReader,
    build_request,
    parse_response,
)

__all__ = ["OpenAIResponsesChatClient"]


class OpenAIResponsesChatClient(OpenAIAPIClient):
    """A Responses API client. See the module docstring for its failure boundaries.

    Takes the keywords of `OpenAIAPIClient`. The API key comes from `api_key` or
    ``OPENAI_API_KEY``; it is required only for the default OpenAI endpoint and never
    appears in `repr`, errors, logs or telemetry.
    `base_url` is the ``/v1`` URL (requests go to ``{base_url}/responses``). `transport` is
    the HTTP client library: ``"aiohttp"`` (the default) or ``"httpx2"``. A given
    `http_client` (an ``httpx2.AsyncClient`` or an ``aiohttp.ClientSession``) implies its
    own and is used as is and left open; otherwise the client owns one, with `timeout`.

    Function tools, tool choice, output limits, temperature, top-p, response formats
    (``text.format``) and reasoning effort are sent in the API's fields; `ChatOptions.stop`
    has none, so a request with stop sequences is refused before anything is sent
    (`UnsendableRequestError`), and `ChatOptions.seed` is not sent.
    """

    stream_end_types = END_EVENTS
    extras_scope = OPENAI_RESPONSES_EXTRAS
    api_name = "the OpenAI Responses API"

    def _chat_url(self) -> httpx2.URL:
        return self._base_url.join("responses")

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        options = check_options(options)
        return build_request(
            as_messages(messages),
            options,
            model=self._request_model(options) or "",
            stream=stream,
        )

    def _parse_response(self, payload: Any) -> ChatResponse:
        return parse_response(payload, self.provider_name)

    def _stream_reader(self) -> StreamReader:
        return ResponsesStreamReader(self.provider_name)
