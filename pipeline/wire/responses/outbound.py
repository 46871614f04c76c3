"""The Responses API as the providers speak it: `build_request` writes a core request (the
whole conversation, ``store: false``; reasoning sent back as encrypted ``reasoning``
items), `parse_response` and `ResponsesStreamReader` read answers and stream events. Output
items and events it does not know are skipped; anything else that does not fit is a
`ProviderError` (never quoting the payload). Details: docs/concepts/wire.md."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.errors import ProviderError, RequestRefusedError
from pipeline.types import (
    OPENAI_RESPONSES_EXTRAS,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    ChatTool,
    Content,
    CustomTool,
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
    chat_response_format,
    data_url,
    error_from_payload,
    malformed,
    parse_arguments,
    read_usage,
    str_or_none,
    tool_result_text,
)
from pipeline.wire.responses.vocab import (
    API,
    ENCRYPTED_REASONING,
    END_EVENTS,
    INCOMPLETE_REASONS,
    USAGE_FIELDS,
    tool_choice,
)
from pipeline.wire.tools import as_tool, custom_tool_names, function_definition, raw_body

__all__ = [
    "END_EVENTS",
    "ENCRYPTED_REASONING",
    "ResponsesStreamReader",
    "build_request",
    "parse_response",
    "parse_usage",
    "text_format",
    "tool_definition",
]

_ASSISTANT = ChatRole.ASSISTANT

# -- requests ---------------------------------------------------------------------------------


def tool_definition(tool: ChatTool) -> dict[str, Any]:
    """A tool as the Responses API takes it: a function flat, ``{"type": "function",
    "name", "description", "parameters"}``; a custom tool as ``{"type": "custom"}``; a raw
    tool of this API as it is."""
    match as_tool(tool, API):
        case RawTool() as raw:
            return raw_body(raw, API)
        case CustomTool() as custom:
            definition: dict[str, Any] = {"type": "custom", "name": custom.name}
            if custom.description:
                definition["description"] = custom.description
            if custom.format is not None:
                definition["format"] = dict(custom.format)
            return definition
        case other:
            return function_definition(other, API, "parameters", kind="function")


def _user_content(parts: list[TextContent | DataContent]) -> str | list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, TextContent):
            content.append({"type": "input_text", "text": part.text})
        else:
            content.append({"type": "input_image", "image_url": data_url(part)})
    if all(item["type"] == "input_text" for item in content):
        return "".join(item["text"] for item in content)
    return content


def _reasoning_item(content: ReasoningContent) -> dict[str, Any] | None:
    """A reasoning item to send back, or None for reasoning this API cannot verify (no
    item id or no encrypted content: with ``store: false`` nothing else can be resolved)."""
    if content.protected is None or not content.id:
        return None
    summary = [{"type": "summary_text", "text": content.text}] if content.text else []
    return {
        "type": "reasoning",
        "id": content.id,
        "summary": summary,
        "encrypted_content": content.protected,
    }


def _flush(
    items: list[dict[str, Any]], parts: list[TextContent | DataContent], role: ChatRole
) -> None:
    """The text (and a user's images) gathered so far as one message item."""
    if not parts:
        return
    if role is ChatRole.USER:
        items.append({"role": "user", "content": _user_content(parts)})
    elif role is not ChatRole.TOOL:  # a tool message is its results
        text = "".join(part.text for part in parts if isinstance(part, TextContent))
        items.append({"role": role.value, "content": text})
    parts.clear()


def _items(message: ChatMessage, custom_calls: frozenset[str]) -> list[dict[str, Any]]:
    """A message as input items, in its order: a user message's text and images, another
    role's text, the model's reasoning and calls, tool results as output items."""
    role = message.role
    items: list[dict[str, Any]] = []
    parts: list[TextContent | DataContent] = []
    for content in message.contents:
        match content:
            case TextContent():
                parts.append(content)
            case DataContent():
                if role is ChatRole.USER:  # the one role with image parts
                    parts.append(content)
            case ReasoningContent():
                item = _reasoning_item(content) if role is ChatRole.ASSISTANT else None
                if item is not None:
                    _flush(items, parts, role)
                    items.append(item)
            case FunctionCallContent():
                _flush(items, parts, role)
                if content.custom:
                    items.append(
                        {
                            "type": "custom_tool_call",
                            "call_id": content.call_id,
                            "name": content.name,
                            "input": content.input_text or "",
                        }
                    )
                else:
                    items.append(
                        {
                            "type": "function_call",
                            "call_id": content.call_id,
                            "name": content.name,
                            "arguments": json.dumps(dict(content.arguments)),
                        }
                    )
            case FunctionResultContent():
                _flush(items, parts, role)
                custom = content.call_id in custom_calls
                items.append(
                    {
                        "type": "custom_tool_call_output" if custom else "function_call_output",
                        "call_id": content.call_id,
                        "output": tool_result_text(content),
                    }
                )
            case _:
                unknown_content(content)
    _flush(items, parts, role)
    if not items and role is not ChatRole.TOOL and role is not ChatRole.ASSISTANT:
        items.append({"role": role.value, "content": ""})  # as an empty message was
    return items


def _custom_call_ids(messages: Sequence[ChatMessage]) -> frozenset[str]:
    return frozenset(
        c.call_id
        for m in messages
        if m.role is ChatRole.ASSISTANT
        for c in m.contents
        if type(c) is FunctionCallContent and c.custom
    )


def reasoning_request(options: ChatOptions) -> dict[str, Any] | None:
    """The ``reasoning`` object of a request: `ChatOptions.reasoning` (its effort wins over
    the older `ChatOptions.reasoning_effort`) and its summary; None when neither is set."""
    reasoning: dict[str, Any] = {}
    effort = options.reasoning.effort if options.reasoning is not None else None
    effort = effort or options.reasoning_effort
    if effort is not None:
        reasoning["effort"] = effort
    if options.reasoning is not None and options.reasoning.summary is not None:
        reasoning["summary"] = options.reasoning.summary
    return reasoning or None


def build_request(
    messages: Sequence[ChatMessage], options: ChatOptions | None, *, model: str, stream: bool
) -> dict[str, Any]:
    """The JSON body of a Responses request.

    `ChatOptions.stop` has no Responses field: a request with stop sequences is refused
    (`ValueError`) rather than answered without them. `seed` has none either and is not
    sent. `additional_properties` are merged in (``parallel_tool_calls``, ``truncation``,
    ``service_tier``...), never overriding what the request needs.
    """
    custom_calls = _custom_call_ids(messages)
    body: dict[str, Any] = {
        "model": model,
        "input": [item for message in messages for item in _items(message, custom_calls)],
        "store": False,
    }
    if stream:
        body["stream"] = True
    carries_reasoning = any(item.get("type") == "reasoning" for item in body["input"])
    if options is None:
        if carries_reasoning:
            body["include"] = [ENCRYPTED_REASONING]
        return body
    if options.stop:
        raise RequestRefusedError(
            "stop: the OpenAI Responses API takes no stop sequences", param="stop"
        )
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.top_p is not None:
        body["top_p"] = options.top_p
    if options.max_output_tokens is not None:
        body["max_output_tokens"] = options.max_output_tokens
    if options.tools:
        body["tools"] = [tool_definition(t) for t in options.tools]
        choice = as_tool_choice(options.tool_mode, options.tools)
        if choice is not None:
            custom = custom_tool_names(options.tools) if choice.name else frozenset[str]()
            body["tool_choice"] = tool_choice(choice, custom)
    text: dict[str, Any] = {}
    if options.response_format is not None:
        text["format"] = text_format(chat_response_format(options.response_format))
    extra = dict(options.additional_properties)
    if "verbosity" in extra:
        # A Chat Completions field (top level) that this API takes under ``text``.
        text["verbosity"] = extra.pop("verbosity")
    if text:
        body["text"] = text
    reasoning = reasoning_request(options)
    if reasoning is not None:
        body["reasoning"] = reasoning
    if reasoning is not None or carries_reasoning:
        # Nothing is stored (store: false): the reasoning comes back encrypted, to be sent
        # back on the next turn of a tool loop.
        include = list(extra.pop("include", None) or [])
        if ENCRYPTED_REASONING not in include:
            include.append(ENCRYPTED_REASONING)
        body["include"] = include
    # The caller's own Responses fields (`OPENAI_RESPONSES_EXTRAS`), as given.
    scoped = extra.pop(OPENAI_RESPONSES_EXTRAS, None)
    if isinstance(scoped, Mapping):
        extra.update((key, value) for key, value in scoped.items() if key not in extra)
    for key, value in extra.items():
        body.setdefault(key, value)
    return body


def text_format(chat_format: Any) -> Any:
    """A Chat Completions ``response_format`` as a Responses ``text.format`` (the JSON
    schema's fields move up a level)."""
    if isinstance(chat_format, Mapping) and chat_format.get("type") == "json_schema":
        schema = chat_format.get("json_schema")
        if isinstance(schema, Mapping):
            return {"type": "json_schema", **schema}
    return chat_format


# -- responses --------------------------------------------------------------------------------


def parse_usage(value: Any) -> UsageDetails | None:
    """A response's ``usage``, with the cached part of the input and the reasoning part of
    the output."""
    return read_usage(value, USAGE_FIELDS)


def _finish_reason(response: Mapping[str, Any], called_tools: bool, refused: bool) -> str | None:
    status = response.get("status")
    if status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, Mapping) else None
        if not isinstance(reason, str):
            return FinishReason.LENGTH  # the usual cause; the API names no other default
        return INCOMPLETE_REASONS.get(reason, reason)
    if refused:
        return FinishReason.CONTENT_FILTER
    if status == "completed":
        return FinishReason.TOOL_CALLS if called_tools else FinishReason.STOP
    return str_or_none(status)


def _function_call(item: Mapping[str, Any], arguments: Any, provider: str) -> FunctionCallContent:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise malformed(provider, "a function_call item has no name")
    return FunctionCallContent(
        call_id=str_or_none(item.get("call_id")) or "",
        name=name,
        arguments=parse_arguments(arguments, provider),
    )


def _custom_call(item: Mapping[str, Any], text: Any, provider: str) -> FunctionCallContent:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise malformed(provider, "a custom_tool_call item has no name")
    if not isinstance(text, str):
        raise malformed(provider, "a custom_tool_call item has no input text")
    return FunctionCallContent.custom_call(str_or_none(item.get("call_id")) or "", name, text)


def _texts(parts: Any, kind: str, provider: str) -> list[str]:
    if parts is None:
        return []
    if not isinstance(parts, list):
        raise malformed(provider, "a reasoning item's parts are not a list")
    texts = []
    for part in parts:
        text = part.get("text") if isinstance(part, Mapping) else None
        if not isinstance(text, str):
            raise malformed(provider, "a reasoning part has no text")
        if part.get("type") == kind:
            texts.append(text)
    return texts


def _reasoning(item: Mapping[str, Any], provider: str) -> ReasoningContent | None:
    """A reasoning output item: its summary (or, from servers that show it, its reasoning
    text), its encrypted content and id; None when it carries none of them."""
    texts = _texts(item.get("summary"), "summary_text", provider)
    if not texts:
        texts = _texts(item.get("content"), "reasoning_text", provider)
    encrypted = item.get("encrypted_content")
    if encrypted is not None and not isinstance(encrypted, str):
        raise malformed(provider, "a reasoning item's encrypted content is not a string")
    text = "\n\n".join(texts)
    if not text and encrypted is None:
        return None
    return ReasoningContent(text, protected=encrypted, id=str_or_none(item.get("id")))


def _failed(response: Mapping[str, Any], provider: str) -> ProviderError:
    return error_from_payload(response.get("error"), provider)


def parse_response(payload: Any, provider: str) -> ChatResponse:
    """A non-streaming Responses API response."""
    if not isinstance(payload, Mapping):
        raise malformed(provider, "the body is not a JSON object")
    if payload.get("error") or payload.get("status") == "failed":
        raise _failed(payload, provider)
    output = payload.get("output")
    if not isinstance(output, list):
        raise malformed(provider, "the response has no output list")
    contents: list[Content] = []
    refused = False
    for item in output:
        if not isinstance(item, Mapping):
            raise malformed(provider, "an output item is not an object")
        kind = item.get("type")
        if kind == "function_call":
            contents.append(_function_call(item, item.get("arguments"), provider))
        elif kind == "custom_tool_call":
            contents.append(_custom_call(item, item.get("input"), provider))
        elif kind == "reasoning":
            reasoning = _reasoning(item, provider)
            if reasoning is not None:
                contents.append(reasoning)
        elif kind == "message":
            parts = item.get("content")
            if not isinstance(parts, list):
                raise malformed(provider, "a message item has no content list")
            for part in parts:
                if not isinstance(part, Mapping):
                    raise malformed(provider, "a content part is not an object")
                text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
                if part.get("type") not in ("output_text", "refusal"):
                    continue
                if not isinstance(text, str):
                    raise malformed(provider, "an output text part has no text")
                refused = refused or part.get("type") == "refusal"
                last = contents[-1] if contents else None
                if type(last) is TextContent:
                    contents[-1] = TextContent(last.text + text)  # as a stream assembles it
                elif text:
                    contents.append(TextContent(text))
    called = any(type(c) is FunctionCallContent for c in contents)
    return ChatResponse(
        messages=[ChatMessage(ChatRole.ASSISTANT, contents)],
        response_id=str_or_none(payload.get("id")),
        model_id=str_or_none(payload.get("model")),
        finish_reason=_finish_reason(payload, called, refused),
        usage=parse_usage(payload.get("usage")),
    )


# Reasoning text as it streams: summary text, or the reasoning itself from servers that
# show it (open models behind vLLM-style servers).
_REASONING_DELTAS = frozenset(
    {"response.reasoning_summary_text.delta", "response.reasoning_text.delta"}
)


class _Call:
    __slots__ = ("item", "parts")

    def __init__(self, item: Mapping[str, Any]) -> None:
        self.item = item
        self.parts: list[str] = []


class ResponsesStreamReader:
    """Turns stream events into updates: text deltas as they come, a function call whole
    when its item is done, and, from the event that ends the stream (``response.completed``
    or ``response.incomplete``), one last update with the finish reason and the usage.
    ``response.failed`` and an ``error`` event (one sent without an SSE event name) become
    the `ProviderError` of their error's kind."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self._calls: dict[int, _Call] = {}
        self._response_id: str | None = None
        self._model_id: str | None = None
        self._called = False
        self._refused = False
        self._reasoned: set[str] = set()  # reasoning items whose text came in deltas

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

    def _response(self, payload: Mapping[str, Any]) -> Mapping[str, Any]:
        response = payload.get("response")
        if type(response) is not dict:
            raise malformed(self.provider, "a response event without a response object")
        return response

    def _call(self, payload: Mapping[str, Any]) -> _Call:
        index = payload.get("output_index")
        call = self._calls.get(index) if type(index) is int else None
        if call is None:
            raise malformed(self.provider, "a function call event for no open function call")
        return call

    def _reasoning_delta(self, payload: Mapping[str, Any]) -> ChatResponseUpdate | None:
        delta = payload.get("delta")
        if type(delta) is not str:
            raise malformed(self.provider, "a reasoning delta that is not text")
        item_id = str_or_none(payload.get("item_id"))
        if item_id is not None:
            self._reasoned.add(item_id)
        return self._update([ReasoningContent(delta, id=item_id)]) if delta else None

    def _reasoning_done(self, item: Mapping[str, Any]) -> ChatResponseUpdate | None:
        """A reasoning item done: its encrypted content (the deltas said the text), or the
        whole item when no delta came for it."""
        item_id = str_or_none(item.get("id"))
        if item_id is not None and item_id in self._reasoned:
            encrypted = item.get("encrypted_content")
            if encrypted is None:
                return None
            if not isinstance(encrypted, str):
                raise malformed(self.provider, "a reasoning item's encrypted content is not text")
            return self._update([ReasoningContent("", protected=encrypted, id=item_id)])
        reasoning = _reasoning(item, self.provider)
        return None if reasoning is None else self._update([reasoning])

    def feed(self, payload: Any) -> ChatResponseUpdate | None:
        if type(payload) is not dict:
            raise malformed(self.provider, "a stream event is not a JSON object")
        kind = payload.get("type")
        if kind == "response.output_text.delta" or kind == "response.refusal.delta":
            delta = payload.get("delta")
            if type(delta) is not str:
                raise malformed(self.provider, "a text delta that is not text")
            if kind == "response.refusal.delta":
                self._refused = True
            return self._update([checked_text(delta)]) if delta else None
        if kind in _REASONING_DELTAS:
            return self._reasoning_delta(payload)
        if kind == "response.reasoning_summary_part.added":
            # Summary parts after the first are paragraphs of one summary.
            index = payload.get("summary_index")
            if type(index) is int and index > 0:
                return self._reasoning_delta({**payload, "delta": "\n\n"})
            return None
        if (
            kind == "response.function_call_arguments.delta"
            or kind == "response.custom_tool_call_input.delta"
        ):
            delta = payload.get("delta")
            if type(delta) is not str:
                raise malformed(self.provider, "a function call arguments delta that is not text")
            self._call(payload).parts.append(delta)
            return None
        if kind == "response.output_item.added" or kind == "response.output_item.done":
            item = payload.get("item")
            index = payload.get("output_index")
            if type(item) is not dict or type(index) is not int:
                raise malformed(self.provider, "an output item event without an item and index")
            item_kind = item.get("type")
            if item_kind == "reasoning":
                return None if kind == "response.output_item.added" else self._reasoning_done(item)
            if item_kind != "function_call" and item_kind != "custom_tool_call":
                return None
            if kind == "response.output_item.added":
                self._calls[index] = _Call(item)
                return None
            call = self._calls.pop(index, None)
            field = "arguments" if item_kind == "function_call" else "input"
            arguments = item.get(field)
            if type(arguments) is not str and call is not None:
                arguments = "".join(call.parts)
            self._called = True
            if item_kind == "custom_tool_call":
                return self._update([_custom_call(item, arguments, self.provider)])
            return self._update([_function_call(item, arguments, self.provider)])
        if kind == "response.created" or kind == "response.in_progress":
            response = self._response(payload)
            self._response_id = str_or_none(response.get("id")) or self._response_id
            self._model_id = str_or_none(response.get("model")) or self._model_id
            return None
        if kind in END_EVENTS:
            response = self._response(payload)
            if self._calls:
                raise malformed(self.provider, "the response ended inside a function call")
            self._model_id = str_or_none(response.get("model")) or self._model_id
            return self._update(
                [],
                _finish_reason(response, self._called, self._refused),
                parse_usage(response.get("usage")),
            )
        if kind == "response.failed":
            raise _failed(self._response(payload), self.provider)
        if kind == "error":
            raise error_from_payload(payload.get("error", payload), self.provider)
        return None  # content part and done events repeat what the deltas said; new types

    def finish(self) -> ChatResponseUpdate | None:
        return None  # the event that ended the stream said everything
