"""The gateway's ``POST /v1/chat/completions``: the `InboundFormat` over the Chat Completions
codec (`pipeline.wire.chat_completions.inbound`)."""

from __future__ import annotations

from pipeline.gateway._shared import StreamEncoder
from pipeline.types import ChatResponse
from pipeline.wire import ChatRequest, WireError
from pipeline.wire.chat_completions.inbound import (
    ChunkEncoder,
    completion,
    new_id,
    parse_request,
)
from pipeline.wire.sse import SSE_HEADERS

__all__ = ["CHAT_COMPLETIONS", "ChatCompletions"]


class ChatCompletions:
    """`InboundFormat` of the Chat Completions API."""

    path = "/v1/chat/completions"
    x_api_key = False
    stream_headers = SSE_HEADERS
    request_id_header: bytes | None = None

    # The codec's own functions where the signatures match: no call in between.
    parse = staticmethod(parse_request)
    new_response_id = staticmethod(new_id)

    def error_body(self, error: WireError) -> bytes:
        return error.body()

    def completion(
        self, response: ChatResponse, request: ChatRequest, *, response_id: str, created: int
    ) -> bytes:
        return completion(response, model=request.model, response_id=response_id, created=created)

    def encoder(
        self, request: ChatRequest, *, model: str, response_id: str, created: int
    ) -> StreamEncoder:
        return ChunkEncoder(
            model=model,
            response_id=response_id,
            created=created,
            include_usage=request.include_usage,
        )


CHAT_COMPLETIONS = ChatCompletions()
