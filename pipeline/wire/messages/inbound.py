"""Anthropic's Messages API as the gateway serves it: `parse_messages_request` turns a body
into a `ChatRequest` (or a `WireError` naming the field, answered in this API's error body,
`error_body`), `completion` writes a whole answer and `MessageEventEncoder` a streamed one.
What is honoured, passed on to Anthropic routes, refused and written: docs/concepts/wire.md."""

from __future__ import annotations

import os
import re
from typing import Any

from pipeline.types import (
    ANTHROPIC_EXTRAS,
    UNTRANSLATED,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    ChatTool,
    Content,
    FinishReason,
    FunctionCallContent,
    FunctionResultContent,
    FunctionTool,
    ReasoningContent,
    ReasoningOptions,
    TextContent,
    ToolChoice,
    UsageDetails,
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
)
from pipeline.wire.messages.outbound import message_blocks
from pipeline.wire.messages.vocab import (
    API,
    EFFORT_OF,
    KEPT_STOP_REASONS,
    STOP_REASONS,
    TOOL_CHOICES,
    USAGE_FIELDS,
)

__all__ = [
    "MessageEventEncoder",
    "anthropic_error_type",
    "completion",
    "error_body",
    "new_message_id",
    "parse_count_tokens_request",
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
        "output_config",
    }
)
# Passed on, as given, to Anthropic routes (`ANTHROPIC_EXTRAS`) and dropped by the others:
# who the caller is, how the request is billed, cached or scheduled, and how Anthropic's
# servers trim the context (the conversation goes whole to a route that cannot).
_PASSED = frozenset({"metadata", "service_tier", "cache_control", "speed", "context_management"})
# They describe the caller to nobody who reads them here: accepted, not passed on.
_DROPPED = frozenset({"diagnostics", "user_profile_id", "workspace_id"})
# Features of Anthropic's own servers that change what the answer is (or where it is
# made): refused by name.
_SERVER_FEATURES = {
    "mcp_servers": "MCP servers are not supported by this gateway",
    "container": "code execution containers are not supported by this gateway",
    "inference_geo": "choosing where inference runs is not supported by this gateway",
}
# Tool fields besides the definition: passed to Anthropic routes on the tool.
_TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema"})
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_TYPE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
# Tools Anthropic's servers run (the type's prefix; a version date follows): built-in tools,
# left out of the request or refused as ``[gateway] builtin_tools`` says.
_SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")
_UNSUPPORTED_BLOCKS = {
    "image": "images are not supported by this gateway",
    "document": "documents are not supported by this gateway",
}


def _unsupported(param: str, what: str) -> WireError:
    return invalid(param, what, "unsupported_value")


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise invalid(where, "expected a content block object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise invalid(f"{where}.type", "expected a content block type")
    if kind in _UNSUPPORTED_BLOCKS:
        raise _unsupported(f"{where}.type", _UNSUPPORTED_BLOCKS[kind])
    return kind


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text", "expected a string")
    return text


def _texts(value: Any, param: str) -> list[str]:
    """A field that is a string or a list of text blocks (``system``, a tool result)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid(param, "expected a string or a list of text blocks")
    texts = []
    for index, block in enumerate(value):
        where = f"{param}[{index}]"
        if _block_type(block, where) != "text":
            raise _unsupported(f"{where}.type", "expected a text block")
        texts.append(_text(block, where))
    return texts


def _breakpoint(block: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A block's ``cache_control`` (a prompt-cache breakpoint), or None."""
    value = block.get("cache_control")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(f"{where}.cache_control", "expected an object with a type")
    return value


def _segments(
    role: ChatRole, contents: list[tuple[Content, dict[str, Any] | None]]
) -> list[ChatMessage]:
    """Messages of one role from contents and their breakpoints: a message ends at each
    breakpoint (its ``cache_control``), so an Anthropic route puts it back on that block
    (the provider merges adjacent messages of a role into one turn again)."""
    messages: list[ChatMessage] = []
    current: list[Content] = []
    for content, breakpoint_ in contents:
        current.append(content)
        if breakpoint_ is not None:
            extra = {"cache_control": breakpoint_}
            messages.append(ChatMessage(role, current, additional_properties=extra))
            current = []
    if current or not messages:
        messages.append(ChatMessage(role, current))
    return messages


def _system_turn(value: Any, param: str) -> list[ChatMessage]:
    """System text (a string or text blocks) as system messages, one per breakpoint."""
    if value is None:
        return []
    if isinstance(value, str):
        return [ChatMessage(ChatRole.SYSTEM, value)] if value else []
    if not isinstance(value, list):
        raise invalid(param, "expected a string or a list of text blocks")
    contents: list[tuple[Content, dict[str, Any] | None]] = []
    for index, block in enumerate(value):
        where = f"{param}[{index}]"
        if _block_type(block, where) != "text":
            raise _unsupported(f"{where}.type", "expected a text block")
        text = _text(block, where)
        breakpoint_ = _breakpoint(block, where)
        if text or breakpoint_ is not None:
            contents.append((TextContent(text), breakpoint_))
    segments = _segments(ChatRole.SYSTEM, contents) if contents else []
    for message in segments:  # one text per system message, as a system prompt reads
        texts = [c.text for c in message.contents if isinstance(c, TextContent) and c.text]
        message.contents = [TextContent("\n\n".join(texts))] if texts else []
    return segments


def _system(value: Any) -> list[ChatMessage]:
    return _system_turn(value, "system")


def _tool_result(block: dict[str, Any], where: str) -> FunctionResultContent:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.tool_use_id", "expected a non-empty string")
    text = "".join(_texts(block.get("content"), f"{where}.content"))
    if not isinstance(block.get("is_error", False), bool):
        raise invalid(f"{where}.is_error", "expected true or false")
    # An error result is its text: the model reads what went wrong from it.
    return FunctionResultContent(call_id, result=text)


def _tool_use(block: dict[str, Any], where: str) -> FunctionCallContent:
    name = block.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name", "expected a non-empty string")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input", "expected an object")
    call_id = block.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.id", "expected a non-empty string")
    return FunctionCallContent(call_id=call_id, name=name, arguments=arguments)


def _reasoning(block: dict[str, Any], where: str) -> ReasoningContent:
    """A ``thinking`` block (its text and signature) or a ``redacted_thinking`` one (its
    data), passed back as received: a signature is never checked, shown or recorded."""
    if block["type"] == "redacted_thinking":
        data = block.get("data")
        if not isinstance(data, str) or not data:
            raise invalid(f"{where}.data", "expected a non-empty string")
        return ReasoningContent(protected=data, redacted=True)
    thinking = block.get("thinking", "")
    if not isinstance(thinking, str):
        raise invalid(f"{where}.thinking", "expected a string")
    signature = block.get("signature")
    if signature is not None and not isinstance(signature, str):
        raise invalid(f"{where}.signature", "expected a string")
    return ReasoningContent(thinking, protected=signature or None)


def _turn(raw: Any, index: int) -> list[ChatMessage]:
    """One turn as messages: a user turn's tool results come first, as tool messages (the
    API puts them first in the turn), then its text. A ``system`` turn (Claude Code sends
    them in the middle of the conversation) is a system message where it stands: each route
    places it as its format allows."""
    param = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise invalid(param, "expected a message object")
    role = raw.get("role")
    if role not in ("user", "assistant", "system"):
        raise invalid(f"{param}.role", "expected user, assistant or system")
    content = raw.get("content")
    if role == "system":
        return _system_turn(content, f"{param}.content")
    if isinstance(content, str):
        return [ChatMessage(ChatRole.USER if role == "user" else ChatRole.ASSISTANT, content)]
    if not isinstance(content, list):
        raise invalid(f"{param}.content", "expected a string or a list of content blocks")
    contents: list[tuple[Content, dict[str, Any] | None]] = []
    turn: list[ChatMessage] = []
    for position, block in enumerate(content):
        where = f"{param}.content[{position}]"
        kind = _block_type(block, where)
        item: Content
        if kind == "text":
            text = _text(block, where)
            breakpoint_ = _breakpoint(block, where)
            if not text and breakpoint_ is None:
                continue
            item = TextContent(text)
        elif kind == "tool_use" and role == "assistant":
            item = _tool_use(block, where)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            item = _reasoning(block, where)
        elif kind == "tool_result" and role == "user":
            extra = _breakpoint(block, where)
            turn.append(
                ChatMessage(
                    ChatRole.TOOL,
                    [_tool_result(block, where)],
                    additional_properties=None if extra is None else {"cache_control": extra},
                )
            )
            continue
        else:
            raise _unsupported(
                f"{where}.type", f"this content block type is not supported in {role} turns"
            )
        contents.append((item, _breakpoint(block, where)))
    if role == "assistant":
        return _segments(ChatRole.ASSISTANT, contents)
    if contents or not turn:
        turn += _segments(ChatRole.USER, contents)
    return turn


def _tools(value: Any, builtin: list[str]) -> tuple[list[ChatTool], frozenset[str], frozenset[str]]:
    """The request's tools as the pipeline's, their names, and the names of the server tools
    it offered: those are noted in ``builtin`` (their types) and left out, for the gateway's
    built-in tools policy (`pipeline.gateway._builtin_tools`)."""
    if not isinstance(value, list):
        raise invalid("tools", "expected a list of tools")
    tools: list[ChatTool] = []
    names: set[str] = set()
    server: set[str] = set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(where, "expected a tool object")
        kind = tool.get("type") or "custom"
        # A type is a token (``web_search_20250305``): it reaches a response header and the
        # log line when the tool is a built-in one, so nothing else is taken.
        if not isinstance(kind, str) or not _TOOL_TYPE.fullmatch(kind):
            raise invalid(f"{where}.type", "expected a tool type")
        if kind != "custom":
            if kind.startswith(_SERVER_TOOL_PREFIXES):
                builtin.append(kind)
                if isinstance(tool.get("name"), str):
                    server.add(tool["name"])
                continue
            # bash_..., text_editor_..., computer_...: the client runs them, but their
            # definitions are Anthropic's own, which no other route has.
            raise _unsupported(
                f"{where}.type", "Anthropic-defined tools are not supported by this gateway"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise invalid(f"{where}.name", "expected 1-64 letters, digits, underscores or dashes")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{where}.description", "expected a string")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{where}.input_schema", "expected a JSON schema object")
        # A tool definition: every provider writes it in its own format; its other Messages
        # fields (``cache_control``, ``defer_loading``, ``strict``...) go to Anthropic routes.
        extra = {key: value for key, value in tool.items() if key not in _TOOL_FIELDS}
        tools.append(FunctionTool(name, description or None, schema, {API: extra} if extra else {}))
        names.add(name)
    return tools, frozenset(names), frozenset(server)


def _tool_mode(
    value: Any, names: frozenset[str], server: frozenset[str] = frozenset()
) -> ToolChoice:
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or (kind not in TOOL_CHOICES and kind != "tool"):
        raise invalid("tool_choice.type", "expected auto, any, tool or none")
    if value.get("disable_parallel_tool_use") is True:
        raise _unsupported(
            "tool_choice.disable_parallel_tool_use",
            "limiting the model to one tool call is not supported by this gateway",
        )
    if kind != "tool":
        return TOOL_CHOICES[kind]
    name = value.get("name")
    if isinstance(name, str) and name in server and name not in names:
        return ToolChoice.AUTO  # the server tool it named is left out: the model may answer
    if not isinstance(name, str) or name not in names:
        raise invalid("tool_choice.name", "expected the name of a tool in tools")
    return ToolChoice.named(name)  # the one tool the model must call


def _thinking(value: Any, effort: str | None) -> ReasoningOptions | None:
    """``thinking`` as reasoning options: ``enabled`` with its budget, ``adaptive`` (the
    model decides, at the request's effort), ``disabled`` (a budget of 0); None for a type
    the gateway does not know (it goes to Anthropic routes as given)."""
    if not isinstance(value, dict):
        raise invalid("thinking", "expected an object")
    kind = value.get("type")
    if not isinstance(kind, str):
        raise invalid("thinking.type", "expected a string: enabled, adaptive or disabled")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if budget is None:
            raise invalid("thinking.budget_tokens", "Field required", "missing_required")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise invalid("thinking.budget_tokens", "expected a positive integer")
        return ReasoningOptions(effort=effort, budget_tokens=budget)
    if kind == "adaptive":
        return ReasoningOptions(effort=effort)
    if kind == "disabled":
        return ReasoningOptions(effort=effort, budget_tokens=0)
    return None


def _output_config(value: Any, options: ChatOptions) -> str | None:
    """``output_config``: its ``effort`` (returned, as a `ReasoningOptions` effort) and its
    ``format`` (a JSON schema: `response_format`)."""
    if not isinstance(value, dict):
        raise invalid("output_config", "expected an object")
    effort = enum_value(value.get("effort"), "output_config.effort")
    output_format = value.get("format")
    if output_format is not None:
        if not isinstance(output_format, dict):
            raise invalid("output_config.format", "expected a json_schema format object")
        schema = output_format.get("schema")
        if output_format.get("type") != "json_schema" or not isinstance(schema, dict):
            raise invalid("output_config.format", "expected a json_schema format with a schema")
        options.response_format = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        }
    return effort


def _context_management(value: Any) -> None:
    edits = value.get("edits") if isinstance(value, dict) else None
    if not isinstance(edits, list) or not all(
        isinstance(edit, dict) and isinstance(edit.get("type"), str) for edit in edits
    ):
        raise invalid("context_management.edits", "expected a list of edits with a type")


def parse_messages_request(body: bytes, *, session_id: str | None = None) -> ChatRequest:
    """The request a Messages body describes (see the module docstring)."""
    payload = request_object(body)
    for key in sorted(payload):
        if key in _SERVER_FEATURES:
            raise _unsupported(key, _SERVER_FEATURES[key])
        if key not in _KNOWN and key not in _PASSED and key not in _DROPPED:
            raise unsupported_parameter(key)
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "Field required (a model name from /v1/models)", "missing_required")
    # Anthropic requires a limit on every request, and so does the format here.
    max_tokens = integer(payload, "max_tokens", 1)
    if max_tokens is None:
        raise invalid("max_tokens", "Field required", "missing_required")
    raw_messages = payload.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise invalid("messages", "expected a non-empty list of messages", "missing_required")
    messages = _system(payload.get("system"))
    for index, raw in enumerate(raw_messages):
        messages += _turn(raw, index)
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", "expected true or false")
    options = ChatOptions(
        temperature=number(payload, "temperature", 0.0, 1.0),
        top_p=number(payload, "top_p", 0.0, 1.0),
        max_output_tokens=max_tokens,
        session_id=session_id,
    )
    # The caller's own Messages fields, for Anthropic routes: as given (the provider merges
    # them over what the options make).
    scoped: dict[str, Any] = {key: payload[key] for key in _PASSED if key in payload}
    if "context_management" in scoped:
        _context_management(scoped["context_management"])
    # Values of Anthropic's enums the gateway has no word for: Anthropic routes get them
    # as given (in `scoped`), routes of other APIs refuse them.
    untranslated: dict[str, str] = {}
    for key in ("service_tier", "speed"):
        enum_value(payload.get(key), key)
    own_effort = None
    if payload.get("output_config") is not None:
        own_effort = _output_config(payload["output_config"], options)
        scoped["output_config"] = payload["output_config"]
    # An effort this API has that the gateway has no word for (the enum is open) goes to
    # Anthropic routes as given and is `UNTRANSLATED`, which routes of other APIs refuse.
    effort = EFFORT_OF.get(own_effort) if own_effort is not None else None
    if own_effort is not None and effort is None:
        untranslated["output_config.effort"] = own_effort
    thinking = payload.get("thinking")
    if thinking is not None:
        options.reasoning = _thinking(thinking, effort)
        scoped["thinking"] = thinking
        if options.reasoning is None:
            untranslated["thinking.type"] = thinking["type"]
    elif effort is not None:
        options.reasoning = ReasoningOptions(effort=effort)
    if scoped:
        options.additional_properties[ANTHROPIC_EXTRAS] = scoped
    if untranslated:
        options.additional_properties[UNTRANSLATED] = {ANTHROPIC_EXTRAS: untranslated}
    top_k = integer(payload, "top_k", 0)
    if top_k is not None:
        options.additional_properties["top_k"] = top_k
    stop = payload.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise invalid("stop_sequences", "expected a list of non-empty strings")
        options.stop = list(stop) or None
    names: frozenset[str] = frozenset()
    server: frozenset[str] = frozenset()
    builtin: list[str] = []
    if payload.get("tools") is not None:
        tools, names, server = _tools(payload["tools"], builtin)
        options.tools = tools or None
    choice = payload.get("tool_choice")
    if choice is not None:
        mode = _tool_mode(choice, names, server)
        # A choice among tools all left out (server tools) is moot; among none, an error.
        if not options.tools and mode != ToolChoice.NONE and not builtin:
            raise invalid("tool_choice", "needs tools")
        if options.tools:
            options.tool_mode = mode
    metadata = payload.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return ChatRequest(
        model=model,
        messages=messages,
        options=options,
        stream=bool(stream),
        tool_names=names,
        builtin_tools=builtin,
        user=user if isinstance(user, str) and user else None,
        caller=caller_of(payload),
    )


# -- answers ----------------------------------------------------------------------------------


def new_message_id() -> str:
    """A fresh ``msg_`` id: the gateway's own, since failover may change upstreams."""
    return "msg_" + os.urandom(12).hex()


def _tool_use_id() -> str:
    return "toolu_" + os.urandom(12).hex()


def stop_reason(reason: str | None, called_tools: bool) -> str:
    """The Messages stop reason for a finish reason (`FinishReason.of`); without one,
    ``tool_use`` when the model called tools, else ``end_turn``."""
    if reason is not None and reason in KEPT_STOP_REASONS:
        return reason
    finish = FinishReason.of(reason)
    if finish is None:
        return STOP_REASONS[FinishReason.TOOL_CALLS] if called_tools else "end_turn"
    return STOP_REASONS[finish]


def _usage(usage: UsageDetails | None) -> dict[str, int]:
    """Usage as this API counts it: ``input_tokens`` without the prompt-cache reads and
    writes, which are told apart (all 0 when the route said nothing)."""
    usage = usage or _NO_USAGE
    read = usage.cache_read_tokens or 0
    written = usage.cache_write_tokens or 0
    counts = {
        "input_tokens": max(0, (usage.input_tokens or 0) - read - written),
        "cache_write_tokens": written,
        "cache_read_tokens": read,
        "output_tokens": usage.output_tokens or 0,
    }
    body: dict[str, int] = {}
    for name, value in counts.items():  # in the API's order
        put(body, USAGE_FIELDS[name], value)
    return body


_NO_USAGE = UsageDetails()


def _thinking_block(content: ReasoningContent) -> dict[str, Any] | None:
    """A reasoning content as the block a Messages client sends back: its signature only
    when it is Anthropic's (another API's reasoning item, with an `id`, goes out as text
    alone, so it never reaches an Anthropic route as a signature it did not make)."""
    own = content.protected is not None and content.id is None
    if content.redacted:
        return {"type": "redacted_thinking", "data": content.protected} if own else None
    return {
        "type": "thinking",
        "thinking": content.text,
        "signature": content.protected if own else "",
    }


def _content(response: ChatResponse) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for message in response.messages:
        if message.role is not ChatRole.ASSISTANT:
            continue
        for content in message.contents:
            if type(content) is ReasoningContent:
                block = _thinking_block(content)
                if block is not None:
                    blocks.append(block)
                continue
            for block in message_blocks(ChatMessage(ChatRole.ASSISTANT, [content])):
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
    return sse.event(name, dumps(payload))


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
            if type(content) is ReasoningContent:
                out += self._reasoning(content)
            elif isinstance(content, TextContent):
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
                partial = dumps(dict(content.arguments))
                out += self._delta({"type": "input_json_delta", "partial_json": partial})
                out += self._close_block()
        return out

    def _reasoning(self, content: ReasoningContent) -> str:
        """A piece of reasoning: a thinking block's text deltas, then its signature, which
        closes it; a redacted block whole."""
        block = _thinking_block(content)
        if block is None:
            return ""
        if block["type"] == "redacted_thinking":
            return self._open_block(block) + self._close_block()
        out = ""
        if self._open != "thinking":
            out = self._open_block({"type": "thinking", "thinking": "", "signature": ""})
        if content.text:
            out += self._delta({"type": "thinking_delta", "thinking": content.text})
        if block["signature"]:
            out += self._delta({"type": "signature_delta", "signature": block["signature"]})
            out += self._close_block()
        elif content.protected is not None:
            out += self._close_block()  # another API's whole item: the block ends with it
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
        return sse.event("error", error_body(error).decode())


# -- errors -----------------------------------------------------------------------------------

# The Messages API's error type of each status the gateway answers (Anthropic's own
# statuses are 400, 401, 403, 404, 413, 429, 500 and 529; the gateway keeps its status,
# 503 when the models are unavailable, and says so in the type).
_ERROR_TYPES = {
    401: "authentication_error",
    402: "billing_error",  # a spent budget (its message says budget_exceeded)
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


def error_body(error: WireError) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}``."""
    kind = anthropic_error_type(error.status)
    if error.should_retry is False and error.status >= 500:
        # Claude Code retries ``overloaded_error`` for minutes, x-should-retry or not;
        # ``api_error`` it gives up on at once.
        kind = "api_error"
    detail = {"type": kind, "message": error.message}
    return dumps({"type": "error", "error": detail}).encode()


def completion(response: ChatResponse, *, model: str, response_id: str) -> bytes:
    """The body of a non-streaming answer: a ``message`` (`model` when the route named
    none)."""
    content = _content(response)
    called_tools = any(block["type"] == "tool_use" for block in content)
    body = {
        "id": response_id,
        "type": "message",
        "role": "assistant",
        "model": response.model_id or model,
        "content": content,
        "stop_reason": stop_reason(response.finish_reason, called_tools),
        "stop_sequence": None,
        "usage": _usage(response.usage),
    }
    return dumps(body).encode()


def parse_count_tokens_request(body: bytes, *, session_id: str | None = None) -> ChatRequest:
    """A ``count_tokens`` body: a Messages request without ``max_tokens`` (nor ``stream``)."""
    payload = request_object(body)
    payload.setdefault("max_tokens", 1)
    payload.pop("stream", None)
    return parse_messages_request(dumps(payload).encode(), session_id=session_id)
