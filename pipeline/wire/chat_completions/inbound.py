"""The gateway's side of the Chat Completions wire: requests in, responses and errors out.

Pure functions and small classes, no I/O, so they are tested alone. This is the reverse
of `pipeline.providers._chat_completions` (which sends requests and reads responses):

* `parse_request` turns a request body into messages, `ChatOptions` and the stream flags,
  or raises `WireError` (a 4xx with an OpenAI error body) naming the parameter that is
  wrong, never quoting its value (it may be prompt text);
* `completion` is the body of a non-streaming answer; `ChunkEncoder` writes the SSE events
  of a streaming one (a role chunk, deltas, one finish chunk, the usage chunk when the
  client asked for it, ``[DONE]``), or an in-band ``error`` event that ends a stream which
  failed after output;
* `error_for` maps any exception to the HTTP status and OpenAI error the client gets.

Client-declared tools are passed to the model as `FunctionTool`s (every route writes them
its own way; their other fields, ``strict``..., go to OpenAI routes), and the model's tool
calls come back to the client: the gateway runs no tools itself.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline._retry_signal import signal_of as retry_signal_of
from pipeline.errors import (
    FailureKind,
    ProviderError,
    RequestRefusedError,
    RequestTimeoutError,
    RoutingError,
    WireError,
    classify,
    retry_after_of,
)
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
)
from pipeline.wire.chat_completions.vocab import read_tool_choice
from pipeline.wire.tools import openai_function_fields

__all__ = [
    "NOT_RETRYABLE",
    "ChatRequest",
    "ChunkEncoder",
    "WireError",
    "caller_of",
    "completion",
    "error_body",
    "enum_value",
    "error_for",
    "finish_reason",
    "parse_request",
    "request_object",
    "unsupported_parameter",
    "user_of",
]

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


error_body = WireError.error_body
"""The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""


# -- requests ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatRequest:
    """A parsed request: what to ask the pipeline and how to answer."""

    model: str
    messages: list[ChatMessage]
    options: ChatOptions
    stream: bool = False
    include_usage: bool = False
    tool_names: frozenset[str] = field(default_factory=frozenset)
    builtin_tools: list[str] = field(default_factory=list)
    """The types of the provider-side tools the request offered, left out of the pipeline's
    tools (see `pipeline.gateway._builtin_tools`)."""
    user: str | None = None
    """The end user the request names (``user`` or ``safety_identifier``; Anthropic's
    ``metadata.user_id``), for a response cache partitioned by user; None when it names
    none."""
    caller: dict[str, str] | None = None
    """What the body says of its caller, for the spend ledger's attribution (`caller_of`)."""


def user_of(payload: Mapping[str, Any]) -> str | None:
    """The end user an OpenAI-format body names: ``user``, else ``safety_identifier``."""
    for name in ("user", "safety_identifier"):
        value = payload.get(name)
        if isinstance(value, str) and value:
            return value
    return None


_CALLER_KEYS = frozenset({"user", "user_id", "team", "tags", "session", "session_id"})


def caller_of(payload: dict[str, Any]) -> dict[str, str] | None:
    """The body's ``user`` and the attribution keys of its ``metadata`` (``user``,
    ``user_id``, ``team``, ``tags``, ``session``, ``session_id``), string values only, each
    cut to 256 characters: whose request it says it is (never anything else of the body)."""
    found: dict[str, str] = {}
    metadata = payload.get("metadata")
    if isinstance(metadata, dict):
        for key in _CALLER_KEYS:
            value = metadata.get(key)
            if isinstance(value, str) and value:
                found[key] = value[:256]
    user = payload.get("user")
    if isinstance(user, str) and user:
        found["user"] = user[:256]
    return found or None


def _invalid(param: str, what: str, code: str | None = "invalid_value") -> WireError:
    return WireError(400, f"{param}: {what}", param=param, code=code)


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


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(key, "expected a number")
    if not low <= value <= high:
        raise _invalid(key, f"expected a number from {low:g} to {high:g}")
    return float(value)


def enum_value(value: Any, param: str) -> str | None:
    """The value of a vendor's enum: any string (the enum is open), or None; `WireError`
    naming `param` for another type."""
    if value is not None and not isinstance(value, str):
        raise _invalid(param, "expected a string")
    return value


def _integer(body: Mapping[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(key, "expected an integer")
    if value < low:
        raise _invalid(key, f"expected an integer of at least {low}")
    return value


def _text_parts(content: Any, param: str, *, images: bool) -> list[Content]:
    """A message's ``content``: a string, or a list of text (and image) parts."""
    if isinstance(content, str):
        return [TextContent(content)] if content else []
    if not isinstance(content, list):
        raise _invalid(param, "expected a string or a list of content parts")
    parts: list[Content] = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise _invalid(where, "expected a content part object")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid(f"{where}.text", "expected a string")
            parts.append(TextContent(text))
        elif kind == "image_url" and images:
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            if not isinstance(url, str) or not url:
                raise _invalid(f"{where}.image_url.url", "expected a URL string")
            parts.append(DataContent(uri=url))
        else:
            raise _invalid(f"{where}.type", "this content part type is not supported here")
    return parts


def _tool_calls(value: Any, param: str) -> list[Content]:
    if not isinstance(value, list):
        raise _invalid(param, "expected a list of tool calls")
    calls: list[Content] = []
    for index, call in enumerate(value):
        where = f"{param}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _invalid(f"{where}.function", "expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid(f"{where}.function.name", "expected a non-empty string")
        raw = function.get("arguments")
        try:
            # Bounded like the body: the arguments are JSON of their own, in a string.
            arguments = json_body(raw.encode()) if isinstance(raw, str) and raw.strip() else {}
        except ValueError:
            raise _invalid(f"{where}.function.arguments", "is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise _invalid(f"{where}.function.arguments", "expected a JSON object")
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
        raise _invalid(param, "expected a message object")
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
            raise _invalid(f"{param}.tool_call_id", "expected a non-empty string")
        parts = _text_parts(
            content if content is not None else "", f"{param}.content", images=False
        )
        text = "".join(p.text for p in parts if isinstance(p, TextContent))
        return ChatMessage(ChatRole.TOOL, FunctionResultContent(call_id, result=text))
    raise _invalid(f"{param}.role", "expected system, developer, user, assistant or tool")


_FUNCTION_FIELDS = frozenset({"name", "description", "parameters"})


def _tools(value: Any) -> tuple[list[ChatTool], frozenset[str]]:
    if not isinstance(value, list):
        raise _invalid("tools", "expected a list of tools")
    tools: list[ChatTool] = []
    names: set[str] = set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _invalid(f"{where}.type", "expected a function tool")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _invalid(f"{where}.function", "expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise _invalid(
                f"{where}.function.name", "expected 1-64 letters, digits, underscores or dashes"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid(f"{where}.function.description", "expected a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _invalid(f"{where}.function.parameters", "expected a JSON schema object")
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
        raise _invalid("tool_choice", "expected auto, none, required or a function to call")
    if choice.name is not None and choice.name not in names:
        raise _invalid("tool_choice", "names a function that is not in tools")
    return choice  # a named one: the single tool the model must call


def request_object(body: bytes) -> dict[str, Any]:
    """The JSON object a request body is, or a 400 ``invalid_json`` saying why not."""
    try:
        payload = json_body(body)
    except ValueError as exc:  # not JSON in UTF-8, or nested deeper than the bound
        raise WireError(400, str(exc), code="invalid_json") from None
    if not isinstance(payload, dict):
        raise WireError(400, "the request body must be a JSON object", code="invalid_json")
    return payload


def unsupported_parameter(param: str) -> WireError:
    """The 400 of a request parameter this gateway does not know."""
    return WireError(
        400,
        f"{param}: this parameter is not supported by this gateway",
        param=param,
        code="unsupported_parameter",
    )


def parse_request(body: bytes, *, session_id: str | None = None) -> ChatRequest:
    """The request a Chat Completions body describes (see the module docstring)."""
    payload = request_object(body)
    unknown = [key for key in payload if key not in _ACCEPTED]
    if unknown:
        raise unsupported_parameter(sorted(unknown)[0])
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model", "is required (a model name from /v1/models)", "missing_required")
    raw_messages = payload.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _invalid("messages", "expected a non-empty list of messages", "missing_required")
    messages = [_message(raw, index) for index, raw in enumerate(raw_messages)]
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("stream", "expected true or false")
    include_usage = False
    stream_options = payload.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _invalid("stream_options", "expected an object")
        usage = stream_options.get("include_usage", False)
        if not isinstance(usage, bool):
            raise _invalid("stream_options.include_usage", "expected true or false")
        include_usage = usage
    n = _integer(payload, "n", 1)
    if n is not None and n != 1:
        raise _invalid("n", "only one choice per request is supported", "unsupported_value")
    if payload.get("logprobs"):
        raise _invalid("logprobs", "log probabilities are not supported", "unsupported_value")
    options = ChatOptions(
        temperature=_number(payload, "temperature", 0.0, 2.0),
        top_p=_number(payload, "top_p", 0.0, 1.0),
        seed=_integer(payload, "seed", -(2**63)),
        session_id=session_id,
    )
    max_tokens = _integer(payload, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(payload, "max_tokens", 1)
    options.max_output_tokens = max_tokens
    stop = payload.get("stop")
    if isinstance(stop, str):
        options.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        options.stop = list(stop) or None
    elif stop is not None:
        raise _invalid("stop", "expected a string or a list of up to 4 strings")
    names: frozenset[str] = frozenset()
    if payload.get("tools") is not None:
        options.tools, names = _tools(payload["tools"])
    if payload.get("tool_choice") is not None:
        if not options.tools:
            if payload["tool_choice"] != "none":
                raise _invalid("tool_choice", "needs tools")
        else:
            options.tool_mode = _tool_mode(payload["tool_choice"], names)
    response_format = payload.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise _invalid("response_format.type", "expected text, json_object or json_schema")
        options.response_format = response_format
    for key in _ENUMS:
        enum_value(payload.get(key), key)
    options.reasoning_effort = payload.get("reasoning_effort")
    for key in _PASSED:
        if key in payload:
            options.additional_properties[key] = payload[key]
    return ChatRequest(
        model=model,
        messages=messages,
        options=options,
        stream=bool(stream),
        include_usage=include_usage,
        tool_names=names,
        user=user_of(payload),
        caller=caller_of(payload),
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
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
    }
    # The parts OpenAI reports, when the route reported them.
    if usage.cache_read_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cache_read_tokens}
    if usage.reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return body


def _call_payload(call: FunctionCallContent, index: int | None) -> dict[str, Any]:
    payload: dict[str, Any] = {} if index is None else {"index": index}
    payload["id"] = call.call_id or "call_" + os.urandom(8).hex()
    payload["type"] = "function"
    payload["function"] = {"name": call.name, "arguments": _dumps(dict(call.arguments))}
    return payload


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
        message_payload["reasoning_content"] = "\n\n".join(reasoning)
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
    return _dumps(body).encode()


class ChunkEncoder:
    """The SSE events of one streamed answer, in the order Chat Completions sends them.

    `update(u)` returns the events for one update (the first also carries the role chunk);
    `end()` the finish chunk, the usage chunk (when asked for) and ``[DONE]``; `error(...)`
    the in-band error event that ends a stream which failed after output (no ``[DONE]``
    follows it, so even a client that ignores the event sees an unfinished stream).
    """

    __slots__ = (
        "_called_tools",
        "_finish",
        "_include_usage",
        "_prefix",
        "_started",
        "_suffix",
        "_tool_index",
        "_usage",
    )

    def __init__(self, *, model: str, response_id: str, created: int, include_usage: bool) -> None:
        self._include_usage = include_usage
        # Every chunk shares id, object, created and model: the JSON around the choices is
        # built once, the per-update work is the delta alone.
        head = _dumps(
            {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
            }
        )
        self._prefix = "data: " + head[:-1] + ',"choices":[{"index":0,"delta":'
        self._suffix = "}]}\n\n"
        self._started = False
        self._finish: str | None = None
        self._usage: UsageDetails | None = None
        self._called_tools = False
        self._tool_index = 0

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        tail = ',"logprobs":null,"finish_reason":' + ("null" if finish is None else f'"{finish}"')
        return self._prefix + _dumps(delta) + tail + self._suffix

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
                    out += self._chunk({"reasoning_content": content.text})
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
            out += frame + ',"choices":[],"usage":' + _dumps(usage) + "}\n\n"
        return out + "data: [DONE]\n\n"

    @staticmethod
    def error(error: WireError) -> str:
        return "data: " + error_body(error.message, error.type, error.code).decode() + "\n\n"


# -- errors -----------------------------------------------------------------------------------

_SAFE_CODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# kind -> (status, type, code, our words)
_KINDS: dict[FailureKind, tuple[int, str, str | None, str]] = {
    FailureKind.RATE_LIMITED: (
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
        "the model provider is rate limiting requests",
    ),
    # The gateway's own provider account is out of quota or credit: the operator's to fix
    # (never the caller's 402, which is the caller's budget); a retry cannot help soon.
    FailureKind.QUOTA_EXHAUSTED: (
        503,
        "server_error",
        "upstream_quota_exhausted",
        "the model provider's quota or credit for the gateway's account is exhausted",
    ),
    FailureKind.REQUEST_INVALID: (
        400,
        "invalid_request_error",
        None,
        "the model provider refused the request as invalid",
    ),
    # OpenAI's own words ("This model's maximum context length is N tokens. ..."): the
    # phrase LiteLLM, the SDKs' users and agent frameworks look for to tell a context
    # overflow (LiteLLM's ContextWindowExceededError) from any other 400.
    FailureKind.CONTEXT_LENGTH_EXCEEDED: (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "This model's maximum context length is exceeded by the request. "
        "Please reduce the length of the messages.",
    ),
    FailureKind.CONTENT_FILTERED: (
        400,
        "invalid_request_error",
        "content_filter",
        "the model provider's content filter refused the request",
    ),
    # The provider refusing the gateway's own credentials is the gateway's fault, not the
    # caller's: 502 (an upstream answered badly), never the 401 that tells a client its
    # key is wrong; retrying cannot help (`NOT_RETRYABLE`).
    FailureKind.AUTHENTICATION: (
        502,
        "server_error",
        "upstream_authentication_failed",
        "the model provider refused the gateway's own credentials; your key for this "
        "gateway was accepted: the gateway's configuration must be fixed",
    ),
    FailureKind.TRANSIENT: (
        503,
        "server_error",
        "upstream_unavailable",
        "the model provider is unavailable",
    ),
    FailureKind.CIRCUIT_OPEN: (
        503,
        "server_error",
        "circuit_open",
        "the route is unavailable (circuit open)",
    ),
    FailureKind.INVALID_RESPONSE: (
        503,
        "server_error",
        "upstream_invalid_response",
        "the model provider's answer failed the route's response validation",
    ),
    FailureKind.UNKNOWN: (
        503,
        "server_error",
        "upstream_error",
        "the model provider failed to answer",
    ),
}


NOT_RETRYABLE = frozenset({"upstream_authentication_failed", "upstream_quota_exhausted"})
"""Error codes answered with ``x-should-retry: false``: the official SDKs (which retry
5xx) do not retry them."""


_EVERY_ROUTE_FAILED = frozenset(
    {
        FailureKind.RATE_LIMITED,
        FailureKind.QUOTA_EXHAUSTED,
        FailureKind.TRANSIENT,
        FailureKind.CIRCUIT_OPEN,
        FailureKind.INVALID_RESPONSE,
        FailureKind.UNKNOWN,
    }
)
"""The kinds of a failure before output that mean every route the request could take
failed (the others are the request's own fault, or the gateway's configuration)."""


def _said_wait(exc: BaseException, retry_after: float) -> float | None:
    """How long the routes said to wait, the earliest of every attempt (a rate limit that
    said no time: `retry_after`), or None when none said."""
    signal = retry_signal_of(exc)
    wait = signal.wait()
    if wait is None and signal.rate_limited:
        wait = retry_after
    return wait


def error_for(
    exc: BaseException,
    retry_after: float,
    *,
    after_output: bool = False,
    route: str | None = None,
) -> WireError:
    """The HTTP status and OpenAI error a failure of the pipeline becomes.

    A request the pipeline refused before any provider was called (`RequestRefusedError`:
    the caller's mistake) is a 400 naming its field, its message ours, and `route` (the one
    it reached, when known) named. Timeouts (the request's deadline, or an attempt cut short
    with nothing left to try) are 504; request errors 400 with their code (a context overflow
    in OpenAI's words, ``param: messages``); the provider refusing our credentials 502. Every
    other failure before output means every route failed, whatever each answered (rate
    limits, 5xx, open breakers, invalid answers): 503, read from every attempt
    (`pipeline._retry_signal`), with ``Retry-After`` the earliest time any route said it may
    serve again (a provider's ``Retry-After``, an open breaker's next probe; a rate limit
    that said no time counts as `retry_after`), or, when none said, `should_retry` False
    (``x-should-retry: false``: agents otherwise retry for minutes before their user sees
    anything). A failure `after_output` is one route's, mid-stream: its own status (429 for a
    rate limit), and a retry after its own ``Retry-After``, else `retry_after`. The message is
    ours: a kind and, for a provider error, which provider and what status it answered.
    """
    if isinstance(exc, WireError):
        return exc
    if isinstance(exc, RequestRefusedError):
        message = exc.message if route is None else f"{exc.message} (route {route})"
        return WireError(400, message, param=exc.param, code="invalid_value")
    if isinstance(exc, TimeoutError):  # RequestTimeoutError, AttemptTimeoutError, others
        what = (
            "the request's deadline passed before the model answered"
            if isinstance(exc, RequestTimeoutError)
            else "the model did not answer in time"
        )
        return WireError(504, what, type="timeout_error", code="timeout")
    if isinstance(exc, RoutingError):
        wait = retry_after if after_output else _said_wait(exc, retry_after)
        return WireError(
            503,
            "no route could serve the request"
            + ("" if wait is not None else "; no route says when it may serve again"),
            type="server_error",
            code="no_route",
            retry_after=wait,
            should_retry=None if wait is not None else False,
        )
    kind = classify(exc)
    status, type_, code, message = _KINDS.get(kind, _KINDS[FailureKind.UNKNOWN])
    wait = None
    should_retry = None
    if after_output:
        if status in (429, 503):
            # One route failed mid-answer: asking again may well be served.
            own = retry_after_of(exc)
            wait = own if own is not None else retry_after
            message += "; retry later"
    elif kind in _EVERY_ROUTE_FAILED:
        status, type_ = 503, "server_error"
        wait = _said_wait(exc, retry_after)
        if wait is None:
            should_retry = False
            message += "; no route says when it may serve again"
        else:
            message += "; retry later"
    if isinstance(exc, ProviderError):
        details = []
        if exc.provider:
            details.append(f"provider {exc.provider}")
        if exc.status_code is not None:
            details.append(f"HTTP {exc.status_code}")
        if details:
            message += f" ({', '.join(details)})"
        if code is None and exc.code and _SAFE_CODE.fullmatch(exc.code):
            code = exc.code
    param = "messages" if kind is FailureKind.CONTEXT_LENGTH_EXCEEDED else None
    return WireError(
        status,
        message,
        type=type_,
        code=code,
        param=param,
        retry_after=wait,
        should_retry=should_retry,
    )


def now() -> int:
    """The ``created`` timestamp of a response."""
    return int(time.time())
