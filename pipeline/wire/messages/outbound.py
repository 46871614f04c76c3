"""Anthropic's Messages API as the providers speak it: `build_request` writes a core request
(thinking sent back exactly as received, prompt-cache breakpoints kept within the API's
bound), `parse_response` and `MessagesStreamReader` read answers and stream events. Block
and event types it does not know are skipped, as the API asks of clients; anything else
that does not fit is a `ProviderError`. Details: docs/concepts/wire.md."""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.errors import RequestRefusedError
from pipeline.types import (
    ANTHROPIC_EXTRAS,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    ChatTool,
    Content,
    DataContent,
    FinishReason,
    FunctionCallContent,
    FunctionResultContent,
    RawTool,
    ReasoningContent,
    TextContent,
    UsageDetails,
    as_tool_choice,
    checked_text,
    unknown_content,
)
from pipeline.wire._common import (
    cache_counted_apart,
    error_from_payload,
    malformed,
    parse_arguments,
    read_usage,
    str_or_none,
    tool_result_text,
)
from pipeline.wire.messages.vocab import (
    API,
    EFFORT_ALIASES,
    EFFORT_OF,
    EFFORTS,
    MAX_CACHE_BREAKPOINTS,
    USAGE_FIELDS,
    tool_choice,
)
from pipeline.wire.tools import as_tool, function_definition, raw_body

__all__ = [
    "MessagesStreamReader",
    "build_request",
    "message_blocks",
    "parse_response",
    "parse_usage",
]

_logger = logging.getLogger("chat_pipeline.providers.anthropic")

_ASSISTANT = ChatRole.ASSISTANT

_DOCUMENT_TYPES = frozenset({"application/pdf", "text/plain"})

# -- requests ---------------------------------------------------------------------------------


def _tool(tool: ChatTool) -> dict[str, Any]:
    """A tool as the API takes it, ``{"name", "description", "input_schema"}`` and the
    Messages fields a `FunctionTool` carries for this API (``cache_control``,
    ``defer_loading``...); a raw tool of this API as it is."""
    match as_tool(tool, API):
        case RawTool() as raw:
            return raw_body(raw, API)
        case definition:
            return function_definition(definition, API, "input_schema")


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
    """A message's contents as content blocks (empty texts, and reasoning this API cannot
    take, left out)."""
    blocks: list[dict[str, Any]] = []
    for content in message.contents:
        match content:
            case TextContent():
                if content.text:
                    blocks.append({"type": "text", "text": content.text})
            case DataContent():
                blocks.append(_data_block(content))
            case FunctionCallContent():
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": content.call_id,
                        "name": content.name,
                        "input": dict(content.arguments),
                    }
                )
            case FunctionResultContent():
                block: dict[str, Any] = {
                    "type": "tool_result",
                    "tool_use_id": content.call_id,
                    "content": tool_result_text(content),
                }
                if content.exception is not None:
                    block["is_error"] = True
                blocks.append(block)
            case ReasoningContent():
                reasoning = reasoning_block(content)
                if reasoning is not None:
                    blocks.append(reasoning)
            case _:
                unknown_content(content)
    return blocks


def reasoning_block(content: ReasoningContent) -> dict[str, Any] | None:
    """The ``thinking`` or ``redacted_thinking`` block of a reasoning content, or None when
    it cannot be sent to this API (no signature, or another API's reasoning item)."""
    if not content.protected or content.id is not None:
        return None
    if content.redacted:
        return {"type": "redacted_thinking", "data": content.protected}
    return {"type": "thinking", "thinking": content.text, "signature": content.protected}


def _cache_control(message: ChatMessage) -> Any:
    extra = message.additional_properties
    return extra.get("cache_control") if extra else None


def _system_blocks(message: ChatMessage) -> list[dict[str, Any]]:
    """A system message's text blocks: the system prompt is text, its other contents are
    left out."""
    blocks: list[dict[str, Any]] = []
    for content in message.contents:
        match content:
            case TextContent():
                if content.text:
                    blocks.append({"type": "text", "text": content.text})
            case (
                DataContent() | FunctionCallContent() | FunctionResultContent() | ReasoningContent()
            ):
                pass
            case _:
                unknown_content(content)
    breakpoint_ = _cache_control(message)
    if blocks and breakpoint_ is not None:
        blocks[-1]["cache_control"] = breakpoint_
    return blocks


def _conversation(
    messages: Sequence[ChatMessage],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """System blocks, and the turns: tool results go back as user turns; adjacent turns of
    one role are merged, since the API alternates user and assistant.

    Every system message, one in the middle of the conversation too (the API has no place
    for those), is folded into the request's ``system``, in order. A message's
    ``cache_control`` goes on its last block (`build_request` keeps the request within
    `MAX_CACHE_BREAKPOINTS`)."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.role is ChatRole.SYSTEM:
            system += _system_blocks(message)
            continue
        role = "assistant" if message.role is ChatRole.ASSISTANT else "user"
        blocks = message_blocks(message)
        if not blocks:
            continue
        breakpoint_ = _cache_control(message)
        if breakpoint_ is not None:
            blocks[-1]["cache_control"] = breakpoint_
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns


def _capped(body: dict[str, Any]) -> dict[str, Any]:
    """`body` within `MAX_CACHE_BREAKPOINTS` (`_cap_breakpoints`), saying what was left out
    on a log line: where they were, never what they mark (the gateway's log configuration
    adds the request id)."""
    total, dropped = _cap_breakpoints(body)
    if dropped:
        _logger.info(
            "anthropic request: %d cache_control breakpoints, the API takes %d: left out "
            "the earliest, %s",
            total,
            MAX_CACHE_BREAKPOINTS,
            " ".join(dropped),
        )
    return body


def _cap_breakpoints(body: dict[str, Any]) -> tuple[int, list[str]]:
    """Keep `body` within `MAX_CACHE_BREAKPOINTS`, counting tools, system and messages
    together, in the order the API reads them (tools, system, messages): the last ones are
    kept (a later breakpoint caches a longer prefix, the earlier ones' included; a
    top-level ``cache_control`` marks the last block, so it is kept first). Returns how
    many there were and where the ones left out were (``tools[1]``, ``system[0]``,
    ``messages[2].content[0]``)."""
    marked: list[tuple[str, dict[str, Any]]] = []
    for index, tool in enumerate(body.get("tools") or ()):
        if isinstance(tool, dict) and "cache_control" in tool:
            marked.append((f"tools[{index}]", tool))
    system = body.get("system")
    if isinstance(system, list):
        for index, block in enumerate(system):
            if isinstance(block, dict) and "cache_control" in block:
                marked.append((f"system[{index}]", block))
    for turn_index, turn in enumerate(body.get("messages") or ()):
        content = turn.get("content") if isinstance(turn, dict) else None
        for index, block in enumerate(content if isinstance(content, list) else ()):
            if isinstance(block, dict) and "cache_control" in block:
                marked.append((f"messages[{turn_index}].content[{index}]", block))
    top_level = 1 if body.get("cache_control") is not None else 0
    dropped = marked[: max(0, len(marked) + top_level - MAX_CACHE_BREAKPOINTS)]
    for _, holder in dropped:
        del holder["cache_control"]
    return len(marked) + top_level, [where for where, _ in dropped]


def _reasoning(options: ChatOptions) -> tuple[dict[str, Any] | None, str | None]:
    """``thinking`` and ``output_config.effort`` for the options' reasoning: a budget is
    ``enabled`` thinking with that budget (`0`: ``disabled``); an effort alone is
    ``adaptive`` thinking at that effort; effort ``none`` is ``disabled``.

    An effort this API has no word for (another API's new value) has no translation:
    `RequestRefusedError`, unless the caller's own ``output_config`` (`ANTHROPIC_EXTRAS`)
    says this API's effort, which is then what is sent."""
    reasoning = options.reasoning
    effort = (reasoning.effort if reasoning is not None else None) or options.reasoning_effort
    budget = reasoning.budget_tokens if reasoning is not None else None
    if effort == "none":
        return {"type": "disabled"}, None
    if (
        effort is not None
        and effort not in EFFORTS
        and effort not in EFFORT_ALIASES
        and effort not in EFFORT_OF
    ):
        scoped = options.additional_properties.get(ANTHROPIC_EXTRAS)
        own = scoped.get("output_config") if isinstance(scoped, Mapping) else None
        if not (isinstance(own, Mapping) and own.get("effort") is not None):
            raise RequestRefusedError.untranslatable(
                "reasoning.effort", effort, "the Anthropic Messages API", tuple(EFFORTS.values())
            )
        effort = None  # the caller's own effort is merged in
    mapped = (
        (EFFORTS.get(effort) or EFFORT_ALIASES.get(effort) or effort)
        if effort is not None
        else None
    )
    if budget == 0:
        return {"type": "disabled"}, mapped  # effort is about the answer too
    if budget is not None:
        return {"type": "enabled", "budget_tokens": budget}, mapped
    if mapped is not None:
        return {"type": "adaptive"}, mapped
    return None, None


def _output_format(value: Any) -> dict[str, Any] | None:
    """`ChatOptions.response_format` as ``output_config.format``: a JSON schema (this API
    has no JSON mode without one, nor a text format: those are left out)."""
    if not isinstance(value, Mapping):
        return None
    if value.get("type") == "json_schema":
        if isinstance(value.get("schema"), Mapping):  # already this API's shape
            return {"type": "json_schema", "schema": value["schema"]}
        value = value.get("json_schema")
    if isinstance(value, Mapping) and isinstance(value.get("schema"), Mapping):
        return {"type": "json_schema", "schema": value["schema"]}
    return None


# Fields of a request the scoped extras never replace: what the request is.
_OWN_FIELDS = frozenset({"model", "messages", "system", "max_tokens", "stream", "tools"})
# Extras that are no body field: the ``anthropic-beta`` header's values (the client sends
# them as that header).
_HEADER_FIELDS = frozenset({"betas"})


def _clears_thinking(edit: Any) -> bool:
    return isinstance(edit, Mapping) and str(edit.get("type", "")).startswith("clear_thinking")


def _merge_extras(body: dict[str, Any], extras: Mapping[str, Any]) -> None:
    """The caller's own Messages fields (`ANTHROPIC_EXTRAS`), as given: an object field
    (``thinking``, ``output_config``) is merged key by key into what the options made."""
    for key, value in extras.items():
        if key in _OWN_FIELDS or key in _HEADER_FIELDS:
            continue
        current = body.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            if key == "thinking" and current.get("type") != value.get("type"):
                # The options (a route's own, say) chose another kind of thinking: only
                # how it is shown carries over, and only to thinking that is on.
                if current.get("type") != "disabled" and "display" in value:
                    body[key] = {**current, "display": value["display"]}
                continue
            body[key] = {**current, **value}
        else:
            body[key] = value
    thinking = body.get("thinking")
    thinks = isinstance(thinking, Mapping) and thinking.get("type") in ("enabled", "adaptive")
    management = body.get("context_management")
    if not thinks and isinstance(management, Mapping) and isinstance(management.get("edits"), list):
        # Clearing thinking needs thinking (the API refuses it otherwise): with none to
        # clear, the edit changes nothing and is left out.
        edits = [edit for edit in management["edits"] if not _clears_thinking(edit)]
        if edits:
            body["context_management"] = {**management, "edits": edits}
        else:
            del body["context_management"]


def build_request(
    messages: Sequence[ChatMessage],
    options: ChatOptions | None,
    *,
    model: str,
    max_tokens: int,
    stream: bool,
) -> dict[str, Any]:
    """The JSON body of a Messages API request.

    `ChatOptions.reasoning` (or `reasoning_effort`) becomes ``thinking`` and
    ``output_config.effort`` (see `_reasoning`), a JSON-schema `response_format`
    ``output_config.format``; `seed` has no field and is not sent. The dict under
    `ANTHROPIC_EXTRAS` in `additional_properties` is the caller's own Messages fields, set
    as given (object fields merged into what the options made); the other
    `additional_properties` are merged in for anything else (``top_k``, ``metadata``...),
    never overriding what the request needs. A ``clear_thinking`` context-management edit
    is left out when the request does not think. Prompt-cache breakpoints beyond
    `MAX_CACHE_BREAKPOINTS` (tools, system and messages counted together) are left out, the
    earliest first, and a log line says where they were.
    """
    system, turns = _conversation(messages)
    if not turns:
        raise RequestRefusedError(
            "messages: the Anthropic Messages API needs a user or assistant turn with "
            "content, and the conversation has none",
            param="messages",
        )
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    if system:
        if any("cache_control" in block for block in system):
            body["system"] = system  # blocks: a breakpoint is on one of them
        else:
            body["system"] = "\n\n".join(block["text"] for block in system)
    body["messages"] = turns
    if stream:
        body["stream"] = True
    if options is None:
        return _capped(body)
    if options.max_output_tokens is not None:
        body["max_tokens"] = options.max_output_tokens
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.top_p is not None:
        body["top_p"] = options.top_p
    if options.stop:
        body["stop_sequences"] = list(options.stop)
    if options.tools:
        body["tools"] = [_tool(t) for t in options.tools]
        choice = as_tool_choice(options.tool_mode, options.tools)
        if choice is not None:
            body["tool_choice"] = tool_choice(choice)
    thinking, effort = _reasoning(options)
    if thinking is not None:
        body["thinking"] = thinking
    output_config: dict[str, Any] = {}
    if effort is not None:
        output_config["effort"] = effort
    output_format = _output_format(options.response_format)
    if output_format is not None:
        output_config["format"] = output_format
    if output_config:
        body["output_config"] = output_config
    extras = options.additional_properties
    for key, value in extras.items():
        if key != ANTHROPIC_EXTRAS:
            body.setdefault(key, value)
    scoped = extras.get(ANTHROPIC_EXTRAS)
    if isinstance(scoped, Mapping):
        _merge_extras(body, scoped)
    elif "context_management" in body:
        _merge_extras(body, {})
    return _capped(body)


# -- responses --------------------------------------------------------------------------------


def parse_usage(value: Any) -> UsageDetails | None:
    """Usage; input tokens include those written to and read from the prompt cache, which
    are also told apart (`cache_write_tokens`, `cache_read_tokens`); thinking tokens are
    `reasoning_tokens` when the API counts them (``output_tokens_details``)."""
    read = read_usage(value, USAGE_FIELDS)
    if read is None:
        return None
    return cache_counted_apart(
        read.input_tokens,
        read.cache_read_tokens,
        read.cache_write_tokens,
        read.output_tokens,
        read.reasoning_tokens,
    )


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
        elif kind == "thinking":
            thinking = block.get("thinking", "")
            signature = block.get("signature")
            if not isinstance(thinking, str) or not isinstance(signature, str | None):
                raise malformed(provider, "a thinking block's thinking or signature is no string")
            contents.append(ReasoningContent(thinking, protected=signature or None))
        elif kind == "redacted_thinking":
            data = block.get("data")
            if not isinstance(data, str):
                raise malformed(provider, "a redacted_thinking block's data is not a string")
            contents.append(ReasoningContent(protected=data, redacted=True))
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
            if delta_type == "thinking_delta":
                thinking = delta.get("thinking")
                if block.kind != "thinking" or type(thinking) is not str:
                    raise malformed(self.provider, "a thinking delta that is not thinking text")
                return self._update([ReasoningContent(thinking)]) if thinking else None
            if delta_type == "signature_delta":
                signature = delta.get("signature")
                if block.kind != "thinking" or type(signature) is not str:
                    raise malformed(self.provider, "a signature delta that is not a string")
                block.parts.append(signature)
            return None
        if kind == "content_block_start":
            index, _ = self._block(payload)
            start = payload.get("content_block")
            if type(start) is not dict:
                raise malformed(self.provider, "a content block start without a block")
            block_kind = start.get("type")
            self._blocks[index] = _Block(block_kind if type(block_kind) is str else "", start)
            if block_kind == "redacted_thinking":
                data = start.get("data")
                if type(data) is not str:
                    raise malformed(self.provider, "a redacted_thinking block without data")
                return self._update([ReasoningContent(protected=data, redacted=True)])
            if block_kind == "thinking":
                thinking = start.get("thinking")
                if type(thinking) is str and thinking:
                    return self._update([ReasoningContent(thinking)])
                return None
            text = start.get("text") if block_kind == "text" else None
            return self._update([checked_text(text)]) if type(text) is str and text else None
        if kind == "content_block_stop":
            index, block = self._block(payload)
            if block is None:
                raise malformed(self.provider, "a content block stop for no open block")
            del self._blocks[index]
            if block.kind == "thinking":
                # The signature ends the block: `ChatResponse.from_updates` joins the
                # thinking pieces before it into one block.
                signature = "".join(block.parts) or block.start.get("signature")
                if type(signature) is str and signature:
                    return self._update([ReasoningContent(protected=signature)])
                return None
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
