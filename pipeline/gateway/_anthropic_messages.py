"""The gateway's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the
`InboundFormat`s over the Messages codec (`pipeline.wire.messages.inbound`), and the
count_tokens handler, which answers an estimate (`estimate_tokens`) without calling a
model."""

from __future__ import annotations

from pipeline.gateway._exchange import EXCHANGE, Exchange, Receive, Scope, Send
from pipeline.gateway._shared import GatewayState, StreamEncoder
from pipeline.types import (
    ChatResponse,
    FunctionCallContent,
    FunctionResultContent,
    FunctionTool,
    ReasoningContent,
    TextContent,
)
from pipeline.wire import ChatRequest, WireError, dumps
from pipeline.wire.messages.inbound import (
    MessageEventEncoder,
    completion,
    error_body,
    new_message_id,
    parse_count_tokens_request,
    parse_messages_request,
)
from pipeline.wire.sse import SSE_HEADERS

__all__ = [
    "COUNT_TOKENS",
    "MESSAGES",
    "CountTokensFormat",
    "CountTokensHandler",
    "MessagesFormat",
    "estimate_tokens",
]


class MessagesFormat:
    """`InboundFormat` of the Anthropic Messages API."""

    path = "/v1/messages"
    x_api_key = True
    stream_headers = SSE_HEADERS
    request_id_header: bytes | None = b"request-id"

    parse = staticmethod(parse_messages_request)
    new_response_id = staticmethod(new_message_id)
    error_body = staticmethod(error_body)

    def completion(
        self, response: ChatResponse, request: ChatRequest, *, response_id: str, created: int
    ) -> bytes:
        return completion(response, model=request.model, response_id=response_id)

    def encoder(
        self, request: ChatRequest, *, model: str, response_id: str, created: int
    ) -> StreamEncoder:
        return MessageEventEncoder(model=model, response_id=response_id)


MESSAGES = MessagesFormat()


# -- count_tokens -----------------------------------------------------------------------------

CHARS_PER_TOKEN = 4
"""The estimate's ratio: about four characters of English text (or JSON) a token."""
TOKENS_PER_MESSAGE = 4
"""The estimate's overhead of each message (its role and framing)."""


def estimate_tokens(request: ChatRequest) -> int:
    """The input tokens of a request, estimated (no model's tokenizer is at hand): its
    characters (texts, reasoning, tool calls' arguments and results as JSON, the tools'
    names, descriptions and schemas) over `CHARS_PER_TOKEN`, rounded up, plus
    `TOKENS_PER_MESSAGE` per message."""
    characters = 0
    for message in request.messages:
        characters += TOKENS_PER_MESSAGE * CHARS_PER_TOKEN
        for content in message.contents:
            if isinstance(content, TextContent | ReasoningContent):
                characters += len(content.text)
            elif isinstance(content, FunctionCallContent):
                characters += len(content.name) + len(dumps(dict(content.arguments)))
            elif isinstance(content, FunctionResultContent):
                result = content.result
                characters += len(result if isinstance(result, str) else dumps(result))
    for tool in request.options.tools or ():
        if isinstance(tool, FunctionTool):
            characters += len(tool.name) + len(tool.description or "")
            characters += len(dumps(tool.parameters))
    return -(-characters // CHARS_PER_TOKEN)


class CountTokensFormat(MessagesFormat):
    """``POST /v1/messages/count_tokens``: a Messages body in, ``{"input_tokens": n}``
    out (`CountTokensHandler`), errors in Anthropic's shape."""

    path = "/v1/messages/count_tokens"
    parse = staticmethod(parse_count_tokens_request)


COUNT_TOKENS = CountTokensFormat()


class CountTokensHandler:
    """Answers a ``count_tokens`` request with `estimate_tokens` (the model name must be
    one the gateway serves, as for ``/v1/messages``); no model is called."""

    __slots__ = ("gateway",)

    def __init__(self, gateway: GatewayState) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange: Exchange = scope[EXCHANGE]
        request = exchange.request
        if request is None:  # pragma: no cover - the body layer runs first
            raise RuntimeError("the request's body was not read")
        if self.gateway.target(request.model) is None:
            error = WireError(
                404,
                "the model does not exist here; GET /v1/models lists the models",
                param="model",
                code="model_not_found",
            )
            exchange.failure = error
            await exchange.error(error)
            return
        body = dumps({"input_tokens": estimate_tokens(request)}).encode()
        await exchange.whole(200, body)
