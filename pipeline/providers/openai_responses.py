"""`OpenAIResponsesChatClient`: the OpenAI Responses API (``POST /v1/responses``) over HTTP,
the whole conversation each time with ``store: false`` (the codec is
`pipeline.wire.responses.outbound`). Its failure boundaries are every HTTP provider's (see
`pipeline.providers.openai`); how its events and statuses map is in docs/providers.md."""

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
