"""Chat Completions as the providers speak it: `build_request` writes a core request,
`parse_response` and `StreamAssembler` read answers and stream chunks. Anything that does
not fit the format is a `ProviderError` saying what was wrong (never quoting the payload);
every content type is matched, and what the format has no place for is left out as
docs/concepts/wire.md lists."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.types import (
    CUSTOM_TOOL_INPUT,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    ChatTool,
    Content,
    DataContent,
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
from pipeline.wire.chat_completions.vocab import (
    API,
    MAX_TOKENS_FIELDS,
    REASONING_FIELDS,
    USAGE_FIELDS,
    tool_choice,
)
from pipeline.wire.tools import as_tool, function_definition, raw_body

__all__ = [
    "MAX_TOKENS_FIELDS",
    "StreamAssembler",
    "build_request",
    "parse_response",
    "parse_usage",
]

# -- requests ---------------------------------------------------------------------------------


def _tool_definition(tool: ChatTool) -> dict[str, Any]:
    """A tool as a function (a custom tool as the function of one string argument its
    `CustomTool.parameters` describe), or a raw tool of this API as it is."""
    match as_tool(tool, API):
        case RawTool() as raw:
            return raw_body(raw, API)
        case definition:
            return {
                "type": "function",
                "function": function_definition(definition, API, "parameters"),
            }


def _message_payloads(message: ChatMessage) -> list[dict[str, Any]]:
    """A message as Chat Completions messages: its tool results as ``tool`` messages, first
    (they answer the calls before them), then the rest in one message of its role."""
    role = message.role
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    images = False
    for content in message.contents:
        match content:
            case TextContent():
                parts.append({"type": "text", "text": content.text})
            case DataContent():
                if role is ChatRole.USER:  # the one role with image parts
                    parts.append({"type": "image_url", "image_url": {"url": data_url(content)}})
                    images = True
            case FunctionCallContent():
                # A custom call goes as the function call it was offered as (`CustomTool`).
                calls.append(
                    {
                        "id": content.call_id,
                        "type": "function",
                        "function": {
                            "name": content.name,
                            "arguments": json.dumps(dict(content.arguments)),
                        },
                    }
                )
            case FunctionResultContent():
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": content.call_id,
                        "content": tool_result_text(content),
                    }
                )
            case ReasoningContent():
                pass  # these servers take no reasoning back (DeepSeek refuses it)
            case _:
                unknown_content(content)
    if role is ChatRole.TOOL:
        return results  # a tool message is its results
    if not parts and not calls and results:
        return results
    payload: dict[str, Any] = {"role": role.value}
    if images:
        payload["content"] = parts
    else:
        text = "".join(part["text"] for part in parts)
        payload["content"] = text if (text or not calls) else None
    if calls:
        payload["tool_calls"] = calls
    if message.author_name:
        payload["name"] = message.author_name
    return [*results, payload]


def build_request(
    messages: Sequence[ChatMessage],
    options: ChatOptions | None,
    *,
    model: str | None,
    stream: bool,
    max_tokens_field: str = "max_completion_tokens",
) -> dict[str, Any]:
    """The JSON body of a Chat Completions request."""
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    body["messages"] = [p for m in messages for p in _message_payloads(m)]
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if options is None:
        return body
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.top_p is not None:
        body["top_p"] = options.top_p
    if options.max_output_tokens is not None:
        body[max_tokens_field] = options.max_output_tokens
    if options.stop:
        body["stop"] = list(options.stop)
    if options.seed is not None:
        body["seed"] = options.seed
    if options.tools:
        body["tools"] = [_tool_definition(t) for t in options.tools]
        choice = as_tool_choice(options.tool_mode, options.tools)
        if choice is not None:
            body["tool_choice"] = tool_choice(choice)
    if options.response_format is not None:
        body["response_format"] = chat_response_format(options.response_format)
    # `ChatOptions.reasoning`'s effort wins over the older `reasoning_effort`; a budget or
    # a summary has no Chat Completions field and is dropped.
    effort = options.reasoning.effort if options.reasoning is not None else None
    effort = effort or options.reasoning_effort
    if effort is not None:
        body["reasoning_effort"] = effort
    # The escape hatch for provider-specific fields; never overrides what the request needs.
    for key, value in options.additional_properties.items():
        body.setdefault(key, value)
    return body


# -- responses --------------------------------------------------------------------------------


_PLAIN_COUNTS = frozenset({int, type(None)})
_new_usage = object.__new__
_set_input, _set_output, _set_total, _set_reasoning, _set_cache_read, _set_cache_write = (
    UsageDetails.__dict__[name].__set__  # the slots' own setters: the dataclass is frozen
    for name in (
        "input_tokens",
        "output_tokens",
        "total_tokens",
        "reasoning_tokens",
        "cache_read_tokens",
        "cache_write_tokens",
    )
)


def parse_usage(value: Any) -> UsageDetails | None:
    """A ``usage`` object, with its cached prompt tokens and reasoning tokens."""
    # Every answer and every stream carries one. One of plain objects and integers (as
    # decoded) is read here, each of `USAGE_FIELDS`' paths written out and each count put in
    # its slot (some 3 thousand instructions fewer than `read_usage`'s loops); any other
    # (a count of another type, a mapping that is not a dict) is `read_usage`'s.
    if type(value) is dict:
        asked = value.get("prompt_tokens_details")
        done = value.get("completion_tokens_details")
        if (asked is None or type(asked) is dict) and (done is None or type(done) is dict):
            prompt = value.get("prompt_tokens")
            completion = value.get("completion_tokens")
            total = value.get("total_tokens")
            reasoning = done.get("reasoning_tokens") if done else None
            cache_read = asked.get("cached_tokens") if asked else None
            cache_write = asked.get("cache_write_tokens") if asked else None
            if _PLAIN_COUNTS.issuperset(
                map(type, (prompt, completion, total, reasoning, cache_read, cache_write))
            ):
                usage: UsageDetails = _new_usage(UsageDetails)
                _set_input(usage, prompt)
                _set_output(usage, completion)
                _set_total(usage, total)
                _set_reasoning(usage, reasoning)
                _set_cache_read(usage, cache_read)
                _set_cache_write(usage, cache_write)
                return usage
    return read_usage(value, USAGE_FIELDS)


def _reasoning_text(message: Mapping[str, Any], provider: str) -> str | None:
    for key in REASONING_FIELDS:
        value = message.get(key)
        if value is None:
            continue
        if type(value) is not str:
            raise malformed(provider, f"the message's {key} is not a string")
        return value
    return None


def _call(call_id: str, name: str, arguments: Any, custom: frozenset[str], provider: str) -> Any:
    """A tool call; one of a custom tool (offered as a function of ``input``) as a custom
    call, when its arguments are that one string."""
    decoded = parse_arguments(arguments, provider)
    text = decoded.get(CUSTOM_TOOL_INPUT)
    if name in custom and isinstance(text, str) and len(decoded) == 1:
        return FunctionCallContent.custom_call(call_id, name, text)
    return FunctionCallContent(call_id=call_id, name=name, arguments=decoded)


def _first_choice(payload: Mapping[str, Any], provider: str) -> Mapping[str, Any] | None:
    choices = payload.get("choices")
    if choices is None:
        return None
    if type(choices) is not list:
        raise malformed(provider, "'choices' is not a list")
    if not choices:
        return None
    choice = choices[0]
    if type(choice) is not dict:
        raise malformed(provider, "a choice is not an object")
    return choice


def parse_response(
    payload: Any, provider: str, custom_tools: frozenset[str] = frozenset()
) -> ChatResponse:
    """A non-streaming Chat Completions response (`custom_tools`: the names of the request's
    custom tools, whose calls come back as custom calls)."""
    if type(payload) is not dict and not isinstance(payload, Mapping):
        raise malformed(provider, "the body is not a JSON object")
    if "error" in payload and payload.get("error"):
        raise error_from_payload(payload["error"], provider)
    choice = _first_choice(payload, provider)
    if choice is None:
        raise malformed(provider, "the response has no choices")
    message = choice.get("message")
    if type(message) is not dict and not isinstance(message, Mapping):
        raise malformed(provider, "the choice has no message object")
    contents: list[Content] = []
    reasoning = _reasoning_text(message, provider)
    if reasoning:
        contents.append(ReasoningContent(reasoning))
    text = message.get("content")
    if text is not None and not isinstance(text, str):
        raise malformed(provider, "message content is not a string")
    if text:
        contents.append(TextContent(text))
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise malformed(provider, "'tool_calls' is not a list")
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise malformed(provider, "a tool call has no function name")
        call_id = str_or_none(call.get("id")) or ""
        contents.append(
            _call(call_id, function["name"], function.get("arguments"), custom_tools, provider)
        )
    return ChatResponse(
        messages=[ChatMessage(ChatRole.ASSISTANT, contents)],
        response_id=str_or_none(payload.get("id")),
        model_id=str_or_none(payload.get("model")),
        finish_reason=str_or_none(choice.get("finish_reason")),
        usage=parse_usage(payload.get("usage")),
    )


_ASSISTANT = ChatRole.ASSISTANT


@dataclass
class _PendingCall:
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class StreamAssembler:
    """Turns streamed chunks into updates; tool-call deltas are assembled by index and
    emitted whole when the choice finishes (or the stream ends)."""

    def __init__(self, provider: str, custom_tools: frozenset[str] = frozenset()) -> None:
        self.provider = provider
        self.custom_tools = custom_tools
        self._calls: dict[int, _PendingCall] = {}
        self.finished = False

    @property
    def pending_calls(self) -> bool:
        """Whether pieces of tool calls wait for the finish (or the end) that completes them."""
        return bool(self._calls)

    def _flush_calls(self) -> list[Content]:
        if any(not pending.name for pending in self._calls.values()):
            raise malformed(self.provider, "a streamed tool call has no function name")
        calls: list[Content] = [
            _call(
                pending.call_id,
                pending.name,
                "".join(pending.arguments),
                self.custom_tools,
                self.provider,
            )
            for _, pending in sorted(self._calls.items())
        ]
        self._calls.clear()
        return calls

    def feed(self, payload: Any) -> ChatResponseUpdate | None:
        """The update for one chunk, or None when it carries nothing for the caller."""
        # Payloads come from json.loads, so objects are plain dicts: checking `dict` rather
        # than the Mapping ABC keeps this per-chunk path cheap.
        if type(payload) is not dict:
            raise malformed(self.provider, "a stream chunk is not a JSON object")
        if payload.get("error"):
            raise error_from_payload(payload["error"], self.provider)
        contents: list[Content] = []
        finish_reason = None
        # `_first_choice`, inline for the common chunk (it runs for every one); anything
        # else is left to it, to be None or malformed.
        choices = payload.get("choices")
        choice: Mapping[str, Any] | None
        if type(choices) is list and choices and type(choices[0]) is dict:
            choice = choices[0]
        else:
            choice = _first_choice(payload, self.provider)
        # Another choice's chunk (n > 1) is skipped: the response is choice 0.
        if choice is not None and not choice.get("index", 0):
            delta = choice.get("delta") or {}
            if type(delta) is not dict:
                raise malformed(self.provider, "a chunk's delta is not an object")
            if REASONING_FIELDS[0] in delta or REASONING_FIELDS[1] in delta:
                reasoning = _reasoning_text(delta, self.provider)
                if reasoning:
                    contents.append(ReasoningContent(reasoning))
            text = delta.get("content")
            if text is not None:
                if type(text) is not str:
                    raise malformed(self.provider, "delta content is not a string")
                if text:
                    contents.append(checked_text(text))
            if "tool_calls" in delta:
                self._feed_calls(delta["tool_calls"])
            finish = choice.get("finish_reason")
            if finish is not None:
                finish_reason = finish if type(finish) is str else None
                if finish_reason is not None:
                    contents.extend(self._flush_calls())
        raw_usage = payload.get("usage")
        usage = parse_usage(raw_usage) if raw_usage is not None else None
        if not contents and finish_reason is None and usage is None:
            return None
        response_id = payload.get("id")
        model_id = payload.get("model")
        # Positional, and the role read once per module: this runs for every chunk.
        return ChatResponseUpdate(
            _ASSISTANT,
            contents,
            response_id if type(response_id) is str else None,
            model_id if type(model_id) is str else None,
            finish_reason,
            usage,
        )

    def _feed_calls(self, deltas: Any) -> None:
        if deltas is None:
            return
        if not isinstance(deltas, list):
            raise malformed(self.provider, "delta 'tool_calls' is not a list")
        for delta in deltas:
            if not isinstance(delta, Mapping):
                raise malformed(self.provider, "a tool call delta is not an object")
            index = delta.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool):
                raise malformed(self.provider, "a tool call delta has no integer index")
            pending = self._calls.setdefault(index, _PendingCall())
            pending.call_id = str_or_none(delta.get("id")) or pending.call_id
            function = delta.get("function") or {}
            if not isinstance(function, Mapping):
                raise malformed(self.provider, "a tool call delta's function is not an object")
            name = str_or_none(function.get("name"))
            if name:
                # OpenAI sends the name once; some servers (llama-cpp-python) repeat the
                # whole name in every delta: a repeat is not a continuation.
                if name.startswith(pending.name) and pending.name:
                    pending.name = name
                elif name != pending.name:
                    pending.name += name
            arguments = function.get("arguments")
            if arguments is not None:
                if not isinstance(arguments, str):
                    raise malformed(self.provider, "tool call argument deltas must be strings")
                pending.arguments.append(arguments)

    def finish(self) -> ChatResponseUpdate | None:
        """Tool calls still pending when the stream ended without a finish reason."""
        if not self._calls:
            return None
        return ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=self._flush_calls())
