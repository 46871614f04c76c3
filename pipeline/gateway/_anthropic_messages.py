"""The Anthropic Messages format: ``POST /v1/messages``.

The reverse of `pipeline.providers._messages` (which sends Messages requests and reads
their answers), on the same tables (tool choices, stop reasons, content blocks):

* `parse_messages_request` turns a body into messages, `ChatOptions` and the stream flag,
  or raises `WireError` (a 4xx, answered in Anthropic's error body) naming the field that
  is wrong, never quoting its value. ``system`` (a string or text blocks), ``messages``
  with ``text`` / ``tool_use`` / ``tool_result`` blocks, ``tools`` (name, description,
  input_schema), ``tool_choice`` (auto, any, tool, none), ``max_tokens`` (required, as
  Anthropic requires it), ``temperature``, ``top_p``, ``top_k``, ``stop_sequences`` and
  ``stream`` are mapped; ``metadata``, ``service_tier``, ``cache_control``, ``speed``
  and the like describe the caller or the billing and are dropped; what would change the
  answer's meaning and is not served here (images and documents, ``thinking``, server
  tools, MCP servers, containers, ``output_config``, ``inference_geo``) is a 400 naming
  it;
* `MessagesFormat.completion` is a ``message`` object; `MessageEventEncoder` writes the
  stream's events (``message_start``, ``ping``, ``content_block_start`` /
  ``content_block_delta`` (``text_delta``, ``input_json_delta``) / ``content_block_stop``
  per block, ``message_delta`` with the stop reason and the final usage,
  ``message_stop``), and ``event: error`` for a failure after output;
* errors keep the gateway's status, in Anthropic's body and error types
  (``invalid_request_error``, ``authentication_error``, ``rate_limit_error``,
  ``overloaded_error``, ``api_error`` ...).

The model served is the answer's ``model``; the answer's ``id`` is the gateway's own
(``msg_...``), since failover may change upstreams. Client tools are declared to the model
(every provider writes them in its own format) and the model's calls come back as
``tool_use`` blocks: the gateway runs no tools itself.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pipeline.gateway._shared import SSE_HEADERS, StreamEncoder
from pipeline.gateway.wire import (
    ChatRequest,
    WireError,
    _dumps,
    _integer,
    _invalid,
    _number,
    request_object,
    unsupported_parameter,
)
from pipeline.providers._messages import STOP_REASONS, TOOL_CHOICE_TYPES, message_blocks
from pipeline.providers._wire import ToolSpec
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    Content,
    FinishReason,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    UsageDetails,
)

__all__ = [
    "MESSAGES",
    "MessageEventEncoder",
    "MessagesFormat",
    "anthropic_error_type",
    "new_message_id",
    "parse_messages_request",
    "stop_reason",
]

# -- requests ---------------------------------------------------------------------------------

_KNOWN = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
    }
)
# They describe the caller, how the request is billed, cached or scheduled: the answer is
# the same without them. Accepted, not passed on.
_DROPPED = frozenset(
    {
        "metadata",
        "service_tier",
        "cache_control",
        "diagnostics",
        "speed",
        "user_profile_id",
        "workspace_id",
    }
)
# Features of Anthropic's own servers that change what the answer is (or where it is
# made): refused by name.
_SERVER_FEATURES = {
    "mcp_servers": "MCP servers are not supported by this gateway",
    "container": "code execution containers are not supported by this gateway",
    "context_management": "server-side context management is not supported by this gateway",
    "output_config": "output formats and effort are not supported by this gateway",
    "inference_geo": "choosing where inference runs is not supported by this gateway",
}
_TOOL_MODES = {kind: mode for mode, kind in TOOL_CHOICE_TYPES.items()}
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_UNSUPPORTED_BLOCKS = {
    "image": "images are not supported by this gateway",
    "document": "documents are not supported by this gateway",
    "thinking": "thinking blocks are not supported by this gateway (nor is `thinking`)",
    "redacted_thinking": "thinking blocks are not supported by this gateway (nor is `thinking`)",
}


def _unsupported(param: str, what: str) -> WireError:
    return _invalid(param, what, "unsupported_value")


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise _invalid(where, "expected a content block object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _invalid(f"{where}.type", "expected a content block type")
    if kind in _UNSUPPORTED_BLOCKS:
        raise _unsupported(f"{where}.type", _UNSUPPORTED_BLOCKS[kind])
    return kind


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _invalid(f"{where}.text", "expected a string")
    return text


def _texts(value: Any, param: str) -> list[str]:
    """A field that is a string or a list of text blocks (``system``, a tool result)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise _invalid(param, "expected a string or a list of text blocks")
    texts = []
    for index, block in enumerate(value):
        where = f"{param}[{index}]"
        if _block_type(block, where) != "text":
            raise _unsupported(f"{where}.type", "expected a text block")
        texts.append(_text(block, where))
    return texts


def _system(value: Any) -> list[ChatMessage]:
    text = "\n\n".join(t for t in _texts(value, "system") if t)
    return [ChatMessage(ChatRole.SYSTEM, text)] if text else []


def _tool_result(block: dict[str, Any], where: str) -> FunctionResultContent:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _invalid(f"{where}.tool_use_id", "expected a non-empty string")
    text = "".join(_texts(block.get("content"), f"{where}.content"))
    if not isinstance(block.get("is_error", False), bool):
        raise _invalid(f"{where}.is_error", "expected true or false")
    # An error result is its text: the model reads what went wrong from it.
    return FunctionResultContent(call_id, result=text)


def _tool_use(block: dict[str, Any], where: str) -> FunctionCallContent:
    name = block.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid(f"{where}.name", "expected a non-empty string")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise _invalid(f"{where}.input", "expected an object")
    call_id = block.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise _invalid(f"{where}.id", "expected a non-empty string")
    return FunctionCallContent(call_id=call_id, name=name, arguments=arguments)


def _turn(raw: Any, index: int) -> list[ChatMessage]:
    """One turn as messages: a user turn's tool results come first, as tool messages (the
    API puts them first in the turn), then its text."""
    param = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise _invalid(param, "expected a message object")
    role = raw.get("role")
    if role not in ("user", "assistant"):
        raise _invalid(f"{param}.role", "expected user or assistant")
    content = raw.get("content")
    if isinstance(content, str):
        return [ChatMessage(ChatRole.USER if role == "user" else ChatRole.ASSISTANT, content)]
    if not isinstance(content, list):
        raise _invalid(f"{param}.content", "expected a string or a list of content blocks")
    contents: list[Content] = []
    results: list[Content] = []
    for position, block in enumerate(content):
        where = f"{param}.content[{position}]"
        kind = _block_type(block, where)
        if kind == "text":
            text = _text(block, where)
            if text:
                contents.append(TextContent(text))
        elif kind == "tool_use" and role == "assistant":
            contents.append(_tool_use(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        else:
            raise _unsupported(
                f"{where}.type", f"this content block type is not supported in {role} turns"
            )
    if role == "assistant":
        return [ChatMessage(ChatRole.ASSISTANT, contents)]
    turn = [ChatMessage(ChatRole.TOOL, [result]) for result in results]
    if contents or not results:
        turn.append(ChatMessage(ChatRole.USER, contents))
    return turn


def _tools(value: Any) -> tuple[list[Any], frozenset[str]]:
    if not isinstance(value, list):
        raise _invalid("tools", "expected a list of tools")
    tools: list[Any] = []
    names: set[str] = set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _invalid(where, "expected a tool object")
        kind = tool.get("type", "custom")
        if kind != "custom":
            # web_search_..., bash_..., text_editor_...: tools Anthropic's servers run.
            raise _unsupported(f"{where}.type", "server tools are not supported by this gateway")
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise _invalid(f"{where}.name", "expected 1-64 letters, digits, underscores or dashes")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid(f"{where}.description", "expected a string")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _invalid(f"{where}.input_schema", "expected a JSON schema object")
        # A tool definition: every provider writes it in its own format.
        tools.append(ToolSpec(name, description or None, schema))
        names.add(name)
    return tools, frozenset(names)


def _tool_mode(value: Any, names: frozenset[str]) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or (kind not in _TOOL_MODES and kind != "tool"):
        raise _invalid("tool_choice.type", "expected auto, any, tool or none")
    if value.get("disable_parallel_tool_use") is True:
        raise _unsupported(
            "tool_choice.disable_parallel_tool_use",
            "limiting the model to one tool call is not supported by this gateway",
        )
    if kind != "tool":
        return _TOOL_MODES[kind]
    name = value.get("name")
    if not isinstance(name, str) or name not in names:
        raise _invalid("tool_choice.name", "expected the name of a tool in tools")
    return name  # the one tool the model must call


def parse_messages_request(body: bytes, *, session_id: str | None = None) -> ChatRequest:
    """The request a Messages body describes (see the module docstring)."""
    payload = request_object(body)
    for key in sorted(payload):
        if key in _SERVER_FEATURES:
            raise _unsupported(key, _SERVER_FEATURES[key])
        if key not in _KNOWN and key not in _DROPPED:
            raise unsupported_parameter(key)
    thinking = payload.get("thinking")
    if thinking is not None and not (
        isinstance(thinking, dict) and thinking.get("type") == "disabled"
    ):
        raise _unsupported("thinking", "extended thinking is not supported by this gateway")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model", "Field required (a model name from /v1/models)", "missing_required")
    # Anthropic requires a limit on every request, and so does the format here.
    max_tokens = _integer(payload, "max_tokens", 1)
    if max_tokens is None:
        raise _invalid("max_tokens", "Field required", "missing_required")
    raw_messages = payload.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _invalid("messages", "expected a non-empty list of messages", "missing_required")
    messages = _system(payload.get("system"))
    for index, raw in enumerate(raw_messages):
        messages += _turn(raw, index)
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("stream", "expected true or false")
    options = ChatOptions(
        temperature=_number(payload, "temperature", 0.0, 1.0),
        top_p=_number(payload, "top_p", 0.0, 1.0),
        max_output_tokens=max_tokens,
        session_id=session_id,
    )
    top_k = _integer(payload, "top_k", 0)
    if top_k is not None:
        options.additional_properties["top_k"] = top_k
    stop = payload.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _invalid("stop_sequences", "expected a list of non-empty strings")
        options.stop = list(stop) or None
    names: frozenset[str] = frozenset()
    if payload.get("tools") is not None:
        options.tools, names = _tools(payload["tools"])
    choice = payload.get("tool_choice")
    if choice is not None:
        mode = _tool_mode(choice, names)
        if not options.tools and mode != "none":
            raise _invalid("tool_choice", "needs tools")
        if options.tools:
            options.tool_mode = mode
    return ChatRequest(
        model=model, messages=messages, options=options, stream=bool(stream), tool_names=names
    )


# -- answers ----------------------------------------------------------------------------------


def new_message_id() -> str:
    """A fresh ``msg_`` id: the gateway's own, since failover may change upstreams."""
    return "msg_" + os.urandom(12).hex()


def _tool_use_id() -> str:
    return "toolu_" + os.urandom(12).hex()


# Stop reasons passed on as they are when a client reports them so (no `FinishReason`
# keeps ``stop_sequence`` or ``pause_turn`` apart from ``end_turn``).
_STOP_REASONS = frozenset({*STOP_REASONS.values(), "stop_sequence", "pause_turn"})


def stop_reason(reason: str | None, called_tools: bool) -> str:
    """The Messages stop reason for a finish reason (`FinishReason.of`); without one,
    ``tool_use`` when the model called tools, else ``end_turn``."""
    if reason is not None and reason in _STOP_REASONS:
        return reason
    finish = FinishReason.of(reason)
    if finish is None:
        return STOP_REASONS[FinishReason.TOOL_CALLS] if called_tools else "end_turn"
    return STOP_REASONS[finish]


def _usage(usage: UsageDetails | None) -> dict[str, int]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {"input_tokens": usage.input_tokens or 0, "output_tokens": usage.output_tokens or 0}


def _content(response: ChatResponse) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for message in response.messages:
        if message.role is not ChatRole.ASSISTANT:
            continue
        for block in message_blocks(message):
            kind = block["type"]
            if kind == "text":
                if blocks and blocks[-1]["type"] == "text":
                    blocks[-1]["text"] += block["text"]  # one text block, as a stream has
                    continue
            elif kind == "tool_use":
                block["id"] = block["id"] or _tool_use_id()
            else:
                continue  # no other block is an assistant's answer
            blocks.append(block)
    return blocks


def _event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {_dumps(payload)}\n\n"


_PING = _event("ping", {"type": "ping"})


class MessageEventEncoder:
    """The SSE events of one streamed answer, in the order the Messages API sends them.

    `update(u)` returns the events for one update (the first also carries
    ``message_start`` and a ``ping``): text goes into an open text block, each tool call
    is a whole ``tool_use`` block (its input in one ``input_json_delta``); `end()` closes
    the open block and sends ``message_delta`` (stop reason, final usage) and
    ``message_stop``. Usage comes only at the end: ``message_start`` says 0 tokens.
    """

    __slots__ = (
        "_called_tools",
        "_finish",
        "_index",
        "_model",
        "_open",
        "_response_id",
        "_started",
        "_usage",
    )

    def __init__(self, *, model: str, response_id: str) -> None:
        self._model = model
        self._response_id = response_id
        self._started = False  # message_start sent
        self._index = -1  # the last block started
        self._open: str | None = None  # the type of the open block
        self._finish: str | None = None
        self._usage: UsageDetails | None = None
        self._called_tools = False

    def _start(self) -> str:
        message: dict[str, Any] = {
            "id": self._response_id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(None),
        }
        return _event("message_start", {"type": "message_start", "message": message}) + _PING

    def _open_block(self, block: dict[str, Any]) -> str:
        out = self._close_block()
        self._index += 1
        self._open = block["type"]
        return out + _event(
            "content_block_start",
            {"type": "content_block_start", "index": self._index, "content_block": block},
        )

    def _close_block(self) -> str:
        if self._open is None:
            return ""
        self._open = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> str:
        payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return _event("content_block_delta", payload)

    def update(self, update: ChatResponseUpdate) -> str:
        out = ""
        if not self._started:
            self._started = True
            out = self._start()
        if update.finish_reason is not None:
            self._finish = update.finish_reason
        if update.usage is not None:
            self._usage = update.usage if self._usage is None else self._usage + update.usage
        for content in update.contents:
            if isinstance(content, TextContent):
                if not content.text:
                    continue
                if self._open != "text":
                    out += self._open_block({"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": content.text})
            elif isinstance(content, FunctionCallContent):
                self._called_tools = True
                block = {
                    "type": "tool_use",
                    "id": content.call_id or _tool_use_id(),
                    "name": content.name,
                    "input": {},
                }
                out += self._open_block(block)
                partial = _dumps(dict(content.arguments))
                out += self._delta({"type": "input_json_delta", "partial_json": partial})
                out += self._close_block()
        return out

    def end(self) -> str:
        out = "" if self._started else self._start()
        self._started = True
        out += self._close_block()
        delta = {
            "stop_reason": stop_reason(self._finish, self._called_tools),
            "stop_sequence": None,
        }
        out += _event(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(self._usage)}
        )
        return out + _event("message_stop", {"type": "message_stop"})

    @staticmethod
    def error(error: WireError) -> str:
        return "event: error\ndata: " + MessagesFormat.error_body(error).decode() + "\n\n"


# -- errors -----------------------------------------------------------------------------------

# The Messages API's error type of each status the gateway answers (Anthropic's own
# statuses are 400, 401, 403, 404, 413, 429, 500 and 529; the gateway keeps its status,
# 503 when the models are unavailable, and says so in the type).
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error_type(status: int) -> str:
    """The Messages API's error type for an HTTP status."""
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


# -- the format -------------------------------------------------------------------------------


class MessagesFormat:
    """`InboundFormat` of the Anthropic Messages API."""

    path = "/v1/messages"
    x_api_key = True
    stream_headers = SSE_HEADERS
    request_id_header: bytes | None = b"request-id"

    parse = staticmethod(parse_messages_request)
    new_response_id = staticmethod(new_message_id)

    @staticmethod
    def error_body(error: WireError) -> bytes:
        """``{"type": "error", "error": {"type", "message"}}``."""
        detail = {"type": anthropic_error_type(error.status), "message": error.message}
        return _dumps({"type": "error", "error": detail}).encode()

    def completion(
        self, response: ChatResponse, request: ChatRequest, *, response_id: str, created: int
    ) -> bytes:
        content = _content(response)
        called_tools = any(block["type"] == "tool_use" for block in content)
        body = {
            "id": response_id,
            "type": "message",
            "role": "assistant",
            "model": response.model_id or request.model,
            "content": content,
            "stop_reason": stop_reason(response.finish_reason, called_tools),
            "stop_sequence": None,
            "usage": _usage(response.usage),
        }
        return _dumps(body).encode()

    def encoder(
        self, request: ChatRequest, *, model: str, response_id: str, created: int
    ) -> StreamEncoder:
        return MessageEventEncoder(model=model, response_id=response_id)


MESSAGES = MessagesFormat()
