"""The Anthropic Messages wire format: requests out, responses and stream events in.

Pure functions, no I/O, like `_chat_completions`. Anything the server sends that does not
fit the format raises a `ProviderError` saying what was wrong, never a `KeyError`, and never
quoting the payload. Event and content-block types this module does not know (``thinking``,
server tools, new ones) are skipped, as the API's versioning policy asks of clients.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.providers._wire import (
    error_from_payload,
    int_or_none,
    malformed,
    parse_arguments,
    str_or_none,
    tool_result_text,
    tool_spec,
)
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    Content,
    DataContent,
    FinishReason,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    UsageDetails,
    checked_text,
)

__all__ = [
    "STOP_REASONS",
    "TOOL_CHOICE_TYPES",
    "MessagesStreamReader",
    "build_request",
    "message_blocks",
    "parse_response",
    "parse_usage",
]

_ASSISTANT = ChatRole.ASSISTANT

_DOCUMENT_TYPES = frozenset({"application/pdf", "text/plain"})

# -- requests ---------------------------------------------------------------------------------


def _tool_definition(tool: Any) -> dict[str, Any]:
    spec = tool_spec(tool)
    if spec is not None:
        definition: dict[str, Any] = {"name": spec.name}
        if spec.description:
            definition["description"] = spec.description
        definition["input_schema"] = spec.parameters
        return definition
    if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
        # An OpenAI-format tool dict: the same tool, described the other way.
        function = tool["function"]
        definition = {"name": function.get("name")}
        if function.get("description"):
            definition["description"] = function["description"]
        definition["input_schema"] = function.get("parameters") or {
            "type": "object",
            "properties": {},
        }
        return definition
    return dict(tool)  # already a Messages API tool (or a server tool)


TOOL_CHOICE_TYPES: dict[str, str] = {"auto": "auto", "none": "none", "required": "any"}
"""The ``tool_choice`` type of each `ChatOptions.tool_mode` that is not a tool's name (a
name is ``{"type": "tool", "name": ...}``)."""


def _tool_choice(mode: str) -> dict[str, Any]:
    kind = TOOL_CHOICE_TYPES.get(mode)
    return {"type": kind} if kind is not None else {"type": "tool", "name": mode}


def _data_block(content: DataContent) -> dict[str, Any]:
    media_type = content.media_type
    uri = content.uri
    data = content.data
    if uri is not None and uri.startswith("data:"):
        # A data URL is inline data, which the API takes only as a base64 source.
        header, comma, payload = uri[5:].partition(",")
        if not comma or not header.endswith(";base64"):
            raise ValueError("DataContent: only base64 data URLs can be sent to Anthropic")
        media_type = media_type or header.removesuffix(";base64") or None
        source: dict[str, Any] = {"type": "base64", "media_type": media_type, "data": payload}
    elif uri is not None:
        source = {"type": "url", "url": uri}
    else:
        if not media_type:
            raise ValueError("DataContent sent to Anthropic as data needs a media_type")
        encoded = base64.b64encode(data or b"").decode("ascii")
        source = {"type": "base64", "media_type": media_type, "data": encoded}
    if media_type is None or media_type.startswith("image/"):
        return {"type": "image", "source": source}
    if media_type in _DOCUMENT_TYPES:
        return {"type": "document", "source": source}
    raise ValueError(f"DataContent of type {media_type!r} cannot be sent to Anthropic")


def message_blocks(message: ChatMessage) -> list[dict[str, Any]]:
    """A message's contents as content blocks (empty texts left out)."""
    blocks: list[dict[str, Any]] = []
    for content in message.contents:
        if type(content) is TextContent:
            if content.text:
                blocks.append({"type": "text", "text": content.text})
        elif type(content) is DataContent:
            blocks.append(_data_block(content))
        elif type(content) is FunctionCallContent:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": content.call_id,
                    "name": content.name,
                    "input": dict(content.arguments),
                }
            )
        elif type(content) is FunctionResultContent:
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": content.call_id,
                "content": tool_result_text(content),
            }
            if content.exception is not None:
                block["is_error"] = True
            blocks.append(block)
    return blocks


def _conversation(messages: Sequence[ChatMessage]) -> tuple[list[str], list[dict[str, Any]]]:
    """System texts, and the turns: tool results go back as user turns; adjacent turns of
    one role are merged, since the API alternates user and assistant."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.role is ChatRole.SYSTEM:
            if message.text:
                system.append(message.text)
            continue
        role = "assistant" if message.role is ChatRole.ASSISTANT else "user"
        blocks = message_blocks(message)
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns


def build_request(
    messages: Sequence[ChatMessage],
    options: ChatOptions | None,
    *,
    model: str,
    max_tokens: int,
    stream: bool,
) -> dict[str, Any]:
    """The JSON body of a Messages API request.

    `ChatOptions.seed` and `reasoning_effort` have no Messages API field and are not sent;
    `additional_properties` are merged in for anything else (``top_k``, ``thinking``,
    ``metadata``...), never overriding what the request needs.
    """
    system, turns = _conversation(messages)
    if not turns:
        raise ValueError("Anthropic needs at least one user or assistant message with content")
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    if system:
        body["system"] = "\n\n".join(system)
    body["messages"] = turns
    if stream:
        body["stream"] = True
    if options is None:
        return body
    if options.max_output_tokens is not None:
        body["max_tokens"] = options.max_output_tokens
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.top_p is not None:
        body["top_p"] = options.top_p
    if options.stop:
        body["stop_sequences"] = list(options.stop)
    if options.tools:
        body["tools"] = [_tool_definition(t) for t in options.tools]
        if options.tool_mode is not None:
            body["tool_choice"] = _tool_choice(options.tool_mode)
    for key, value in options.additional_properties.items():
        body.setdefault(key, value)
    return body


# -- responses --------------------------------------------------------------------------------


def parse_usage(value: Any) -> UsageDetails | None:
    """Usage; input tokens include those written to and read from the prompt cache."""
    if not isinstance(value, Mapping):
        return None
    parts = [
        int_or_none(value.get(key))
        for key in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    ]
    known = [p for p in parts if p is not None]
    input_tokens = sum(known) if known else None
    output_tokens = int_or_none(value.get("output_tokens"))
    total = (
        input_tokens + output_tokens
        if input_tokens is not None and output_tokens is not None
        else None
    )
    return UsageDetails(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=total)


STOP_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
    FinishReason.CONTENT_FILTER: "refusal",
}
"""The stop reason each finish reason is (``stop_sequence`` and ``end_turn`` are both
`FinishReason.STOP`, so a stop reason read through `FinishReason.of` comes back as
``end_turn``)."""


def _finish_reason(value: Any) -> str | None:
    """A stop reason as the finish reason every client reports (`FinishReason`); one of
    no known meaning as it came."""
    if not isinstance(value, str):
        return None
    return FinishReason.of(value) or value


def _tool_call(block: Mapping[str, Any], arguments: Any, provider: str) -> FunctionCallContent:
    name = block.get("name")
    if not isinstance(name, str) or not name:
        raise malformed(provider, "a tool_use block has no name")
    return FunctionCallContent(
        call_id=str_or_none(block.get("id")) or "",
        name=name,
        arguments=parse_arguments(arguments, provider),
    )


def parse_response(payload: Any, provider: str) -> ChatResponse:
    """A non-streaming Messages API response."""
    if not isinstance(payload, Mapping):
        raise malformed(provider, "the body is not a JSON object")
    if payload.get("type") == "error" or payload.get("error"):
        raise error_from_payload(payload.get("error"), provider)
    blocks = payload.get("content")
    if not isinstance(blocks, list):
        raise malformed(provider, "the message has no content list")
    contents: list[Content] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            raise malformed(provider, "a content block is not an object")
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise malformed(provider, "a text block's text is not a string")
            last = contents[-1] if contents else None
            if type(last) is TextContent:
                contents[-1] = TextContent(last.text + text)  # as a stream assembles it
            elif text:
                contents.append(TextContent(text))
        elif kind == "tool_use":
            contents.append(_tool_call(block, block.get("input"), provider))
    return ChatResponse(
        messages=[ChatMessage(ChatRole.ASSISTANT, contents)],
        response_id=str_or_none(payload.get("id")),
        model_id=str_or_none(payload.get("model")),
        finish_reason=_finish_reason(payload.get("stop_reason")),
        usage=parse_usage(payload.get("usage")),
    )


class _Block:
    __slots__ = ("kind", "parts", "start")

    def __init__(self, kind: str, start: Mapping[str, Any]) -> None:
        self.kind = kind
        self.start = start
        self.parts: list[str] = []


class MessagesStreamReader:
    """Turns stream events into updates: text deltas as they come, a tool call whole when
    its block stops, and, once the stream is complete, one last update with the finish
    reason and the usage (input tokens from ``message_start``, output tokens from the last
    ``message_delta``), so usage is never counted twice."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self._blocks: dict[int, _Block] = {}
        self._response_id: str | None = None
        self._model_id: str | None = None
        self._usage: dict[str, Any] = {}
        self._finish_reason: str | None = None

    def _update(
        self,
        contents: list[Content],
        finish_reason: str | None = None,
        usage: UsageDetails | None = None,
    ) -> ChatResponseUpdate:
        # Positional, and the role read once per module: this runs for every event.
        return ChatResponseUpdate(
            _ASSISTANT, contents, self._response_id, self._model_id, finish_reason, usage
        )

    def _block(self, payload: Mapping[str, Any]) -> tuple[int, _Block | None]:
        index = payload.get("index")
        if type(index) is not int:
            raise malformed(self.provider, "a content block event has no integer index")
        return index, self._blocks.get(index)

    def feed(self, payload: Any) -> ChatResponseUpdate | None:
        if type(payload) is not dict:
            raise malformed(self.provider, "a stream event is not a JSON object")
        kind = payload.get("type")
        if kind == "content_block_delta":
            index, block = self._block(payload)
            delta = payload.get("delta")
            if block is None or type(delta) is not dict:
                raise malformed(self.provider, "a delta for no open content block")
            delta_type = delta.get("type")
            if delta_type == "text_delta":
                text = delta.get("text")
                if block.kind != "text" or type(text) is not str:
                    raise malformed(self.provider, "a text delta that is not text")
                return self._update([checked_text(text)]) if text else None
            if delta_type == "input_json_delta":
                part = delta.get("partial_json")
                if block.kind != "tool_use" or type(part) is not str:
                    raise malformed(self.provider, "a tool input delta that is not JSON text")
                block.parts.append(part)
            return None
        if kind == "content_block_start":
            index, _ = self._block(payload)
            start = payload.get("content_block")
            if type(start) is not dict:
                raise malformed(self.provider, "a content block start without a block")
            block_kind = start.get("type")
            self._blocks[index] = _Block(block_kind if type(block_kind) is str else "", start)
            text = start.get("text") if block_kind == "text" else None
            return self._update([checked_text(text)]) if type(text) is str and text else None
        if kind == "content_block_stop":
            index, block = self._block(payload)
            if block is None:
                raise malformed(self.provider, "a content block stop for no open block")
            del self._blocks[index]
            if block.kind != "tool_use":
                return None
            raw: Any = "".join(block.parts) if block.parts else block.start.get("input")
            return self._update([_tool_call(block.start, raw, self.provider)])
        if kind == "message_start":
            message = payload.get("message")
            if type(message) is not dict:
                raise malformed(self.provider, "message_start without a message")
            self._response_id = str_or_none(message.get("id"))
            self._model_id = str_or_none(message.get("model"))
            usage = message.get("usage")
            if type(usage) is dict:
                self._usage.update(usage)
            return None
        if kind == "message_delta":
            delta = payload.get("delta")
            usage = payload.get("usage")
            if type(usage) is dict:
                # Cumulative counts: later values replace earlier ones, field by field.
                self._usage.update({k: v for k, v in usage.items() if v is not None})
            if type(delta) is dict and delta.get("stop_reason") is not None:
                self._finish_reason = _finish_reason(delta.get("stop_reason"))
            return None
        if kind == "error":
            raise error_from_payload(payload.get("error"), self.provider)
        return None  # ping, and event types added after this was written

    def finish(self) -> ChatResponseUpdate | None:
        if any(block.kind == "tool_use" for block in self._blocks.values()):
            raise malformed(self.provider, "the stream ended inside a tool_use block")
        usage = parse_usage(self._usage) if self._usage else None
        if usage is None and self._finish_reason is None:
            return None
        return self._update([], self._finish_reason, usage)
