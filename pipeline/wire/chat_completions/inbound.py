"""Chat Completions as the gateway serves it: `parse_request` turns a body into a
`ChatRequest` (or a `WireError` naming the field that is wrong, never quoting its value),
`completion` writes a whole answer and `ChunkEncoder` a streamed one (ending in ``[DONE]``,
or in an in-band ``error`` event after output). Client tools go to the model as
`FunctionTool`s and their calls come back to the client: the gateway runs no tools."""

from __future__ import annotations

import os
import re
from typing import Any

from pipeline._json import json_body
from pipeline.types import (
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
    FunctionTool,
    ReasoningContent,
    TextContent,
    ToolChoice,
    UsageDetails,
    checked_message,
    checked_text,
    session_options,
)
from pipeline.wire import sse
from pipeline.wire._common import (
    ChatRequest,
    WireError,
    caller_of,
    dumps,
    enum_value,
    integer,
    invalid,
    number,
    put,
    request_object,
    unsupported_parameter,
    user_of,
)
from pipeline.wire.chat_completions.vocab import (
    MAX_TOKENS_FIELDS,
    REASONING_FIELDS,
    USAGE_FIELDS,
    read_tool_choice,
)
from pipeline.wire.tools import openai_function_fields

__all__ = [
    "ChunkEncoder",
    "completion",
    "error_body",
    "finish_reason",
    "new_id",
    "parse_request",
    "usage_payload",
]

error_body = WireError.error_body
"""The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""


# -- requests ---------------------------------------------------------------------------------


# Sampling fields passed on in `additional_properties` (OpenAI-format routes send them as
# they are); fields that describe the caller or the storage of the request change nothing
# here and are accepted and dropped.
_PASSED = frozenset(
    {"presence_penalty", "frequency_penalty", "logit_bias", "parallel_tool_calls", "verbosity"}
)
_DROPPED = frozenset(
    {"store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key"}
)
_KNOWN = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "seed",
        "tools",
        "tool_choice",
        "response_format",
        "reasoning_effort",
        "n",
        "logprobs",
    }
)
_ACCEPTED = _KNOWN | _PASSED | _DROPPED
# Fields whose values are one of a vendor's enums. A vendor's enum is open: any string is
# taken (a value the gateway does not know yet goes on as it is) and only its type is
# checked here; a route of another API refuses what it cannot translate.
_ENUMS = ("reasoning_effort", "verbosity", "service_tier")
# A body of only these fields sets no option and names no caller.
_PLAIN_FIELDS = frozenset({"model", "messages", "stream"})
# The roles of a message the forwarded path sends as it came (a developer message goes as a
# system one).
_PLAIN_ROLES = {"system": ChatRole.SYSTEM, "user": ChatRole.USER, "assistant": ChatRole.ASSISTANT}
_NO_NAMES: frozenset[str] = frozenset()


def _text_parts(content: Any, param: str, *, images: bool) -> list[Content]:
    """A message's ``content``: a string, or a list of text (and image) parts."""
    if isinstance(content, str):
        return [TextContent(content)] if content else []
    if not isinstance(content, list):
        raise invalid(param, "expected a string or a list of content parts")
    parts: list[Content] = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise invalid(where, "expected a content part object")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.text", "expected a string")
            parts.append(TextContent(text))
        elif kind == "image_url" and images:
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            if not isinstance(url, str) or not url:
                raise invalid(f"{where}.image_url.url", "expected a URL string")
            parts.append(DataContent(uri=url))
        else:
            raise invalid(f"{where}.type", "this content part type is not supported here")
    return parts


def _tool_calls(value: Any, param: str) -> list[Content]:
    if not isinstance(value, list):
        raise invalid(param, "expected a list of tool calls")
    calls: list[Content] = []
    for index, call in enumerate(value):
        where = f"{param}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.function.name", "expected a non-empty string")
        raw = function.get("arguments")
        try:
            # Bounded like the body: the arguments are JSON of their own, in a string.
            arguments = json_body(raw.encode()) if isinstance(raw, str) and raw.strip() else {}
        except ValueError:
            raise invalid(f"{where}.function.arguments", "is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise invalid(f"{where}.function.arguments", "expected a JSON object")
        call_id = call.get("id")
        calls.append(
            FunctionCallContent(
                call_id=call_id if isinstance(call_id, str) else "", name=name, arguments=arguments
            )
        )
    return calls


def _message(raw: Any, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise invalid(param, "expected a message object")
    role = raw.get("role")
    content = raw.get("content")
    name = raw.get("name")
    author = name if isinstance(name, str) and name else None
    if role in ("system", "developer"):
        return ChatMessage(
            ChatRole.SYSTEM,
            _text_parts(content, f"{param}.content", images=False),
            author_name=author,
        )
    if role == "user":
        return ChatMessage(
            ChatRole.USER, _text_parts(content, f"{param}.content", images=True), author_name=author
        )
    if role == "assistant":
        contents = [] if content is None else _text_parts(content, f"{param}.content", images=False)
        if raw.get("tool_calls") is not None:
            contents += _tool_calls(raw["tool_calls"], f"{param}.tool_calls")
        return ChatMessage(ChatRole.ASSISTANT, contents, author_name=author)
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{param}.tool_call_id", "expected a non-empty string")
        parts = _text_parts(
            content if content is not None else "", f"{param}.content", images=False
        )
        text = "".join(p.text for p in parts if isinstance(p, TextContent))
        return ChatMessage(ChatRole.TOOL, FunctionResultContent(call_id, result=text))
    raise invalid(f"{param}.role", "expected system, developer, user, assistant or tool")


_FUNCTION_FIELDS = frozenset({"name", "description", "parameters"})


def _tools(value: Any) -> tuple[list[ChatTool], frozenset[str]]:
    if not isinstance(value, list):
        raise invalid("tools", "expected a list of tools")
    tools: list[ChatTool] = []
    names: set[str] = set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{where}.type", "expected a function tool")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise invalid(
                f"{where}.function.name", "expected 1-64 letters, digits, underscores or dashes"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{where}.function.description", "expected a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters", "expected a JSON schema object")
        fields = {k: v for k, v in function.items() if k not in _FUNCTION_FIELDS}
        tools.append(
            FunctionTool(
                name,
                description or None,
                parameters if parameters is not None else {"type": "object", "properties": {}},
                openai_function_fields(fields),
            )
        )
        names.add(name)
    return tools, frozenset(names)


def _tool_mode(value: Any, names: frozenset[str]) -> ToolChoice:
    choice = read_tool_choice(value)
    if choice is None:
        raise invalid("tool_choice", "expected auto, none, required or a function to call")
    if choice.name is not None and choice.name not in names:
        raise invalid("tool_choice", "names a function that is not in tools")
    return choice  # a named one: the single tool the model must call


def parse_request(body: bytes, *, session_id: str | None = None) -> ChatRequest:
    """The request a Chat Completions body describes (see the module docstring)."""
    payload = request_object(body)
    if not _ACCEPTED.issuperset(payload):
        raise unsupported_parameter(sorted(key for key in payload if key not in _ACCEPTED)[0])
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required (a model name from /v1/models)", "missing_required")
    raw_messages = payload.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise invalid("messages", "expected a non-empty list of messages", "missing_required")
    messages: list[ChatMessage] = []
    plain = True
    for index, raw in enumerate(raw_messages):
        # Most messages are a role and its text, nothing else: made without the general
        # reader's steps, and known to be forwarded as they came (`ChatRequest.plain_messages`).
        if type(raw) is dict and len(raw) == 2:
            role = raw.get("role")
            text = raw.get("content")
            if type(text) is str and text and type(role) is str and role in _PLAIN_ROLES:
                messages.append(checked_message(_PLAIN_ROLES[role], [checked_text(text)]))
                continue
        plain = False
        messages.append(_message(raw, index))
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", "expected true or false")
    if _PLAIN_FIELDS.issuperset(payload):  # no option to read: none set, no caller named
        return ChatRequest(
            model,
            messages,
            session_options(session_id),
            bool(stream),
            False,
            _NO_NAMES,
            [],
            None,
            None,
            payload,
            plain,
        )
    include_usage = False
    stream_options = payload.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise invalid("stream_options", "expected an object")
        usage = stream_options.get("include_usage", False)
        if not isinstance(usage, bool):
            raise invalid("stream_options.include_usage", "expected true or false")
        include_usage = usage
    n = integer(payload, "n", 1)
    if n is not None and n != 1:
        raise invalid("n", "only one choice per request is supported", "unsupported_value")
    if payload.get("logprobs"):
        raise invalid("logprobs", "log probabilities are not supported", "unsupported_value")
    options = ChatOptions(
        temperature=number(payload, "temperature", 0.0, 2.0),
        top_p=number(payload, "top_p", 0.0, 1.0),
        seed=integer(payload, "seed", -(2**63)),
        session_id=session_id,
    )
    for key in MAX_TOKENS_FIELDS:  # the current field first
        options.max_output_tokens = integer(payload, key, 1)
        if options.max_output_tokens is not None:
            break
    stop = payload.get("stop")
    if isinstance(stop, str):
        options.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        options.stop = list(stop) or None
    elif stop is not None:
        raise invalid("stop", "expected a string or a list of up to 4 strings")
    names: frozenset[str] = frozenset()
    if payload.get("tools") is not None:
        options.tools, names = _tools(payload["tools"])
    if payload.get("tool_choice") is not None:
        if not options.tools:
            if payload["tool_choice"] != "none":
                raise invalid("tool_choice", "needs tools")
        else:
            options.tool_mode = _tool_mode(payload["tool_choice"], names)
    response_format = payload.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise invalid("response_format.type", "expected text, json_object or json_schema")
        options.response_format = response_format
    for key in _ENUMS:
        enum_value(payload.get(key), key)
    options.reasoning_effort = payload.get("reasoning_effort")
    for key in _PASSED:
        if key in payload:
            options.additional_properties[key] = payload[key]
    return ChatRequest(
        model,
        messages,
        options,
        bool(stream),
        include_usage,
        names,
        [],
        user_of(payload),
        caller_of(payload),
        payload,
        plain,
    )


# -- responses --------------------------------------------------------------------------------


def finish_reason(reason: str | None, called_tools: bool) -> str:
    """A Chat Completions finish reason for whatever the provider said (`FinishReason.of`);
    without one, ``tool_calls`` when the model called tools, else ``stop``."""
    if reason is None:
        return FinishReason.TOOL_CALLS if called_tools else FinishReason.STOP
    return FinishReason.of(reason) or FinishReason.STOP


def new_id() -> str:
    """A fresh ``chatcmpl-`` id: the gateway's own, since failover may change upstreams."""
    return "chatcmpl-" + os.urandom(12).hex()


def _usage(usage: UsageDetails | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt = usage.input_tokens or 0
    completion_tokens = usage.output_tokens or 0
    total = usage.total_tokens if usage.total_tokens is not None else prompt + completion_tokens
    body: dict[str, Any] = {}
    put(body, USAGE_FIELDS["input_tokens"], prompt)
    put(body, USAGE_FIELDS["output_tokens"], completion_tokens)
    put(body, USAGE_FIELDS["total_tokens"], total)
    # The parts OpenAI reports, when the route reported them.
    if usage.cache_read_tokens is not None:
        put(body, USAGE_FIELDS["cache_read_tokens"], usage.cache_read_tokens)
    if usage.reasoning_tokens is not None:
        put(body, USAGE_FIELDS["reasoning_tokens"], usage.reasoning_tokens)
    return body


def _call_payload(call: FunctionCallContent, index: int | None) -> dict[str, Any]:
    payload: dict[str, Any] = {} if index is None else {"index": index}
    payload["id"] = call.call_id or "call_" + os.urandom(8).hex()
    payload["type"] = "function"
    payload["function"] = {"name": call.name, "arguments": dumps(dict(call.arguments))}
    return payload


usage_payload = _usage
"""A ``usage`` object of an answer (None for no usage)."""


def completion(response: ChatResponse, *, model: str, response_id: str, created: int) -> bytes:
    """The body of a non-streaming answer: the assistant's text and tool calls."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[FunctionCallContent] = []
    for message in response.messages:
        if message.role is not ChatRole.ASSISTANT:
            continue
        for content in message.contents:
            if type(content) is TextContent:
                text.append(content.text)
            elif type(content) is FunctionCallContent:
                calls.append(content)
            elif type(content) is ReasoningContent and content.text:
                reasoning.append(content.text)
    message_payload: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(text) if text or not calls else None,
        "refusal": None,
    }
    if reasoning:
        # Where DeepSeek, vLLM and OpenRouter-style servers put it (the text only: a
        # provider's protected part has no place in this format).
        message_payload[REASONING_FIELDS[0]] = "\n\n".join(reasoning)
    if calls:
        message_payload["tool_calls"] = [_call_payload(call, None) for call in calls]
    body = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": response.model_id or model,
        "choices": [
            {
                "index": 0,
                "message": message_payload,
                "logprobs": None,
                "finish_reason": finish_reason(response.finish_reason, bool(calls)),
            }
        ],
        "usage": _usage(response.usage),
    }
    return dumps(body).encode()


class ChunkEncoder:
    """The SSE events of one streamed answer, in the order Chat Completions sends them.

    `update(u)` returns the events for one update (the first also carries the role chunk);
    `end()` the finish chunk, the usage chunk (when asked for) and ``[DONE]``; `error(...)`
    the in-band error event that ends a stream which failed after output (no ``[DONE]``
    follows it, so even a client that ignores the event sees an unfinished stream).
    """

    __slots__ = (
        "_called_tools",
        "_created",
        "_finish",
        "_include_usage",
        "_model",
        "_prefix",
        "_response_id",
        "_started",
        "_suffix",
        "_tool_index",
        "_usage",
    )

    def __init__(self, *, model: str, response_id: str, created: int, include_usage: bool) -> None:
        self._include_usage = include_usage
        self._model = model
        self._response_id = response_id
        self._created = created
        self._prefix = ""  # made at the first chunk (a forwarded stream may write none)
        self._suffix = "}]}\n\n"
        self._started = False
        self._finish: str | None = None
        self._usage: UsageDetails | None = None
        self._called_tools = False
        self._tool_index = 0

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        if not self._prefix:
            # Every chunk shares id, object, created and model: the JSON around the choices
            # is built once, the per-update work is the delta alone.
            head = dumps(
                {
                    "id": self._response_id,
                    "object": "chat.completion.chunk",
                    "created": self._created,
                    "model": self._model,
                }
            )
            self._prefix = "data: " + head[:-1] + ',"choices":[{"index":0,"delta":'
        tail = ',"logprobs":null,"finish_reason":' + ("null" if finish is None else f'"{finish}"')
        return self._prefix + dumps(delta) + tail + self._suffix

    def update(self, update: ChatResponseUpdate) -> str:
        out = ""
        if not self._started:
            self._started = True
            out = self._chunk({"role": "assistant", "content": ""})
        if update.finish_reason is not None:
            self._finish = update.finish_reason
        if update.usage is not None:
            self._usage = update.usage if self._usage is None else self._usage + update.usage
        text = ""
        for content in update.contents:
            if isinstance(content, TextContent):
                text += content.text
            elif isinstance(content, ReasoningContent):
                if content.text:
                    if text:
                        out += self._chunk({"content": text})
                        text = ""
                    out += self._chunk({REASONING_FIELDS[0]: content.text})
            elif isinstance(content, FunctionCallContent):
                if text:
                    out += self._chunk({"content": text})
                    text = ""
                self._called_tools = True
                call = _call_payload(content, self._tool_index)
                self._tool_index += 1
                out += self._chunk({"tool_calls": [call]})
        if text:
            out += self._chunk({"content": text})
        return out

    def end(self) -> str:
        out = "" if self._started else self._chunk({"role": "assistant", "content": ""})
        out += self._chunk({}, finish_reason(self._finish, self._called_tools))
        if self._include_usage:
            frame = self._prefix.split(',"choices"', 1)[0]
            usage = _usage(self._usage)
            out += frame + ',"choices":[],"usage":' + dumps(usage) + "}\n\n"
        return out + sse.DONE

    @staticmethod
    def error(error: WireError) -> str:
        return sse.data(error_body(error.message, error.type, error.code).decode())
