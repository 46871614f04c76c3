"""The Responses API as the gateway serves it: `parse_responses` turns a body into a
`ResponsesRequest` (or a `WireError` naming the field), `completion` writes a whole answer
and `ResponsesEncoder` the typed, numbered events of a streamed one; `resume` completes a
stored conversation. What is mapped, refused and written: docs/concepts/wire.md."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline._json import json_body
from pipeline.types import (
    CUSTOM_TOOL_INPUT,
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
    user_of,
)
from pipeline.wire.responses.vocab import (
    ENCRYPTED_REASONING,
    INCOMPLETE_REASON_OF,
    USAGE_FIELDS,
    read_tool_choice,
)
from pipeline.wire.tools import openai_function_fields

__all__ = [
    "ResponsesEncoder",
    "ResponsesRequest",
    "completion",
    "new_response_id",
    "parse_responses",
    "resume",
]

# -- requests ---------------------------------------------------------------------------------

_KNOWN = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "text",
        "reasoning",
        "parallel_tool_calls",
        "store",
        "truncation",
        "include",
        "top_logprobs",
    }
)
# Fields describing the caller, its billing or the transport: accepted, not passed on.
_DROPPED = frozenset(
    {
        "metadata",
        "user",
        "service_tier",
        "safety_identifier",
        "stream_options",
        "client_metadata",
    }
)
# OpenAI's prompt cache: sent to OpenAI Responses routes (`OPENAI_RESPONSES_EXTRAS`) only,
# where it decides which cached prefix a request can reuse; no other API has it.
_PROMPT_CACHE = ("prompt_cache_key", "prompt_cache_retention")
# Built-in tools: run by OpenAI's own servers, by no route behind the gateway (what happens
# to them is `[gateway] builtin_tools`, see `pipeline.gateway._builtin_tools`).
_BUILTIN = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer",
        "local_shell",
        "shell",
        "apply_patch",
        "mcp",
        "tool_search",
    }
)
# ``reasoning`` keys: effort and summary are passed on; ``context`` (which turns' reasoning
# the model sees, Codex sends ``"all_turns"``) is what sending the whole conversation does.
_REASONING_KEYS = frozenset({"effort", "summary", "generate_summary", "context"})
# The prefix of the ids the gateway gives reasoning that came without one (another API's
# thinking): such an id names nothing upstream, and is taken off when the item comes back.
_GATEWAY_REASONING = "rs_gw_"
# Fields whose meaning the gateway cannot keep, and why.
_REFUSED = {
    "conversation": (
        "conversations are not supported by this gateway: send the whole conversation in "
        "input, or continue a stored response with previous_response_id"
    ),
    "background": "background responses are not supported by this gateway",
    "prompt": "prompt templates are not supported by this gateway",
    "max_tool_calls": "built-in tools are not supported by this gateway",
}
# Every top-level field the format knows (the others are a 400): checked once per field.
_ACCEPTED = (
    _KNOWN | _DROPPED | frozenset(_REFUSED) | frozenset(_PROMPT_CACHE) | {"previous_response_id"}
)
_ROLES = {
    "user": ChatRole.USER,
    "system": ChatRole.SYSTEM,
    "developer": ChatRole.SYSTEM,
    "assistant": ChatRole.ASSISTANT,
}


@dataclass(slots=True)
class ResponsesRequest(ChatRequest):
    """A Responses request: what the pipeline is asked, and what the answer echoes back
    (the request's own instructions, tools and settings, as the API does)."""

    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    metadata: dict[str, Any] = field(default_factory=dict)
    include_reasoning: bool = False
    """``include: ["reasoning.encrypted_content"]``: reasoning items carry their
    encrypted content (what a route gave as `ReasoningContent.protected`)."""
    reasoning: dict[str, Any] = field(default_factory=dict)
    """The request's ``reasoning`` (effort, summary), echoed."""
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Flattened tool name -> (namespace, name), for tools sent inside a ``namespace``."""
    custom_tools: frozenset[str] = field(default_factory=frozenset)
    """The (flattened) names of the custom (free-form) tools."""
    store: bool | None = None
    """``store`` as sent (None: not sent, which the API takes as true)."""
    previous_response_id: str | None = None
    """The stored response this one continues."""
    items: list[dict[str, Any]] = field(default_factory=list)
    """``input`` as a list of items (a string is one user message), as sent."""
    references: list[int] = field(default_factory=list)
    """The positions in `items` of ``item_reference`` items (left out of `messages` until
    `resume` put the items they name in their place)."""
    names: _Names | None = None
    """How the request's tool names were flattened (for `resume`)."""
    answer: dict[str, Any] | None = None
    """The ``response`` object the client was sent, once the answer is complete."""
    withheld: dict[str, str] = field(default_factory=dict)
    """The encrypted content of the answer's reasoning items that the answer did not show
    (the request did not include it), by item id: kept with a stored response, as the
    route gave it, so a continuation passes it back."""


def _unsupported(param: str, why: str) -> WireError:
    return WireError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def _parts(content: Any, param: str, role: ChatRole) -> list[Content]:
    """A message's ``content``: a string, or a list of content parts."""
    if isinstance(content, str):
        return [TextContent(content)] if content else []
    if not isinstance(content, list):
        raise invalid(param, "expected a string or a list of content parts")
    parts: list[Content] = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.text", "expected a string")
            parts.append(TextContent(text))
        elif kind == "refusal" and role is ChatRole.ASSISTANT:
            text = part.get("refusal")
            if not isinstance(text, str):
                raise invalid(f"{where}.refusal", "expected a string")
            parts.append(TextContent(text))
        elif kind == "input_image" and role is ChatRole.USER:
            url = part.get("image_url")
            if part.get("file_id") is not None or not isinstance(url, str) or not url:
                raise _unsupported(
                    f"{where}.image_url", "images are taken as URLs (file ids are not supported)"
                )
            parts.append(DataContent(uri=url))
        elif kind == "input_file":
            raise _unsupported(f"{where}.type", "files are not supported by this gateway")
        else:
            raise invalid(f"{where}.type", "this content part type is not supported here")
    return parts


def _arguments(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, str):
        raise invalid(param, "expected a JSON object in a string")
    try:
        # Bounded like the body: the arguments are JSON of their own, in a string.
        arguments = json_body(raw.encode()) if raw.strip() else {}
    except ValueError:
        raise invalid(param, "is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise invalid(param, "expected a JSON object")
    return arguments


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}.{key}", "expected a non-empty string", "missing_required")
    return value


def _output_text(output: Any, param: str) -> str:
    """A ``function_call_output``'s output: a string, or text parts."""
    if isinstance(output, str):
        return output
    parts = _parts(output, param, ChatRole.TOOL)
    return "".join(p.text for p in parts if isinstance(p, TextContent))


class _Names:
    """Tool names as the pipeline sees them, one per tool: a tool of a ``namespace`` is
    flattened to its own name, or ``namespace__name`` where another tool has that name.
    Every flattened name is unique: one that would still collide (a tool named
    ``namespace__name`` itself, two namespaces flattening alike) or run past the 64
    characters a function name may have gets a name of its own made from a hash of both
    parts, so each call the model makes maps back to exactly the tool it was made for."""

    def __init__(self) -> None:
        self.flat: dict[tuple[str | None, str], str] = {}
        self.back: dict[str, tuple[str, str]] = {}

    def plan(self, entries: list[tuple[str | None, str]]) -> None:
        tools = list(dict.fromkeys(entries))  # a tool listed twice is one tool
        counts: dict[str, int] = {}
        for _, name in tools:
            counts[name] = counts.get(name, 0) + 1
        taken: set[str] = set()
        qualified: list[tuple[str, str]] = []
        # Names kept as they are first (top-level tools, and namespaced ones whose name no
        # other tool has), so a qualified name never takes a name a tool has of its own.
        for namespace, name in tools:
            if namespace is None or counts[name] == 1:
                self.flat[(namespace, name)] = name
                taken.add(name)
                if namespace is not None:
                    self.back[name] = (namespace, name)
            else:
                qualified.append((namespace, name))
        for namespace, name in qualified:
            flat = f"{namespace}__{name}"
            if flat in taken or len(flat) > _MAX_TOOL_NAME:
                flat = _hashed_name(namespace, name, taken)
            self.flat[(namespace, name)] = flat
            self.back[flat] = (namespace, name)
            taken.add(flat)

    def of(self, namespace: Any, name: str) -> str:
        key = (namespace if isinstance(namespace, str) and namespace else None, name)
        return self.flat.get(key, name)


_MAX_TOOL_NAME = 64


def _hashed_name(namespace: str, name: str, taken: set[str]) -> str:
    """A function name for a namespaced tool whose plain qualified name is taken or too
    long: a prefix of it and a hash of both parts (deterministic: the same tools get the
    same names on every turn)."""
    digest = hashlib.sha256(f"{namespace}\x00{name}".encode()).hexdigest()
    prefix = "".join(c if c.isalnum() or c in "_-" else "_" for c in f"{namespace}__{name}")
    for attempt in range(len(digest) // 8):
        candidate = f"{prefix[: _MAX_TOOL_NAME - 9]}_{digest[attempt * 8 : attempt * 8 + 8]}"
        if candidate not in taken:
            return candidate
    raise invalid("tools", "too many tools flatten to the same name")  # pragma: no cover


def _assistant(messages: list[ChatMessage]) -> ChatMessage:
    """The assistant turn an output item joins: the last message when it is the model's."""
    last = messages[-1] if messages else None
    if last is not None and last.role is ChatRole.ASSISTANT:
        return last
    message = ChatMessage(ChatRole.ASSISTANT)
    messages.append(message)
    return message


def _reasoning_input(item: Mapping[str, Any], where: str) -> ReasoningContent:
    """A ``reasoning`` item sent back: its summary text, encrypted content and id."""
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise invalid(f"{where}.summary", "expected a list of summary parts")
    texts: list[str] = []
    for index, part in enumerate(summary):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise invalid(f"{where}.summary[{index}].text", "expected a string")
        texts.append(text)
    encrypted = item.get("encrypted_content")
    if encrypted is not None and not isinstance(encrypted, str):
        raise invalid(f"{where}.encrypted_content", "expected a string")
    item_id = item.get("id")
    if item_id is not None and not isinstance(item_id, str):
        raise invalid(f"{where}.id", "expected a string")
    if item_id is not None and item_id.startswith(_GATEWAY_REASONING):
        item_id = None  # the gateway's own id: the route gave none
    return ReasoningContent("\n\n".join(texts), protected=encrypted, id=item_id)


def _conversation(source: Any, names: _Names) -> list[ChatMessage]:
    """``input``: a string (one user message) or a list of items, in order. A model's
    reasoning, text and calls join one assistant turn, as one Chat Completions message
    carries its text and tool calls. ``additional_tools`` items were read by `_tools`."""
    if isinstance(source, str):
        return [ChatMessage(ChatRole.USER, source)]
    if not isinstance(source, list) or not source:
        raise invalid("input", "expected a string or a non-empty list of items", "missing_required")
    messages: list[ChatMessage] = []
    for index, item in enumerate(source):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid(where, "expected an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            role_name = item.get("role")
            role = _ROLES.get(role_name) if isinstance(role_name, str) else None
            if role is None:
                raise invalid(f"{where}.role", "expected user, system, developer or assistant")
            parts = _parts(item.get("content"), f"{where}.content", role)
            if role is ChatRole.ASSISTANT:
                _assistant(messages).contents.extend(parts)
            else:
                messages.append(ChatMessage(role, parts))
        elif kind == "function_call":
            name = names.of(item.get("namespace"), _string(item, "name", where))
            call = FunctionCallContent(
                call_id=_string(item, "call_id", where),
                name=name,
                arguments=_arguments(item.get("arguments"), f"{where}.arguments"),
            )
            _assistant(messages).contents.append(call)
        elif kind == "custom_tool_call":
            text = item.get("input")
            if not isinstance(text, str):
                raise invalid(f"{where}.input", "expected a string", "missing_required")
            name = names.of(item.get("namespace"), _string(item, "name", where))
            custom = FunctionCallContent.custom_call(_string(item, "call_id", where), name, text)
            _assistant(messages).contents.append(custom)
        elif kind == "reasoning":
            _assistant(messages).contents.append(_reasoning_input(item, where))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string(item, "call_id", where)
            text = _output_text(item.get("output"), f"{where}.output")
            messages.append(ChatMessage(ChatRole.TOOL, FunctionResultContent(call_id, result=text)))
        elif kind == "additional_tools":
            continue
        elif kind == "item_reference":
            # A stored item, put in its place by `resume` before the pipeline is called.
            _string(item, "id", where)
        else:
            raise invalid(
                f"{where}.type",
                "expected message, reasoning, function_call, function_call_output, "
                "custom_tool_call, custom_tool_call_output, item_reference or additional_tools",
            )
    return messages


def _tool_entries(value: Any, param: str) -> list[tuple[str, dict[str, Any], str | None]]:
    """The tools of a ``tools`` list, namespaces opened: (where, tool, namespace)."""
    if not isinstance(value, list):
        raise invalid(param, "expected a list of tools")
    entries: list[tuple[str, dict[str, Any], str | None]] = []
    for index, tool in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict):
            raise invalid(where, "expected a tool object")
        if tool.get("type") == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise invalid(f"{where}.name", "expected a namespace name")
            if not tool.get("tools"):  # as the API: a namespace holds tools
                raise invalid(f"{where}.tools", "expected a non-empty list of tools")
            inner = _tool_entries(tool["tools"], f"{where}.tools")
            entries += [(w, t, namespace) for w, t, ns in inner if ns is None]
        else:
            entries.append((where, tool, None))
    return entries


def _tools(
    sources: list[tuple[str, Any]], request: ResponsesRequest, names: _Names
) -> list[ChatTool]:
    """The tools of ``tools`` and of ``additional_tools`` input items, as the pipeline's
    tools: function tools as `FunctionTool`s, custom tools as `CustomTool`s,
    the tools of a namespace flattened (`_Names`); built-in tools are noted in
    `request.builtin_tools` and left out."""
    entries: list[tuple[str, dict[str, Any], str | None]] = []
    for param, value in sources:
        entries += _tool_entries(value, param)
    kept: list[tuple[str, dict[str, Any], str | None, str]] = []
    for where, tool, namespace in entries:
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise invalid(f"{where}.type", "expected a tool type")
        if kind in _BUILTIN:
            request.builtin_tools.append(str(kind))
            continue
        if kind not in ("function", "custom"):
            raise _unsupported(
                f"{where}.type", "expected a function, custom, namespace or built-in tool"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not (0 < len(name) <= 64) or not name.isascii():
            raise invalid(f"{where}.name", "expected a tool name of 1-64 characters")
        kept.append((where, tool, namespace, name))
    names.plan([(namespace, name) for _, _, namespace, name in kept])
    chat_tools: list[ChatTool] = []
    flat_names: set[str] = set()
    custom: set[str] = set()
    for where, tool, namespace, name in kept:
        flat = names.of(namespace, name)
        if flat in flat_names:
            continue  # the same tool again (Codex repeats additional_tools in history)
        flat_names.add(flat)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{where}.description", "expected a string")
        if tool.get("type") == "custom":
            fmt = tool.get("format")
            if fmt is not None and not isinstance(fmt, dict):
                raise invalid(f"{where}.format", "expected a format object")
            chat_tools.append(CustomTool(flat, description or None, fmt))
            custom.add(flat)
            continue
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{where}.parameters", "expected a JSON schema object")
        fields = {k: v for k, v in tool.items() if k not in _FUNCTION_FIELDS and v is not None}
        chat_tools.append(
            FunctionTool(
                flat,
                description or None,
                parameters if parameters is not None else {"type": "object", "properties": {}},
                openai_function_fields(fields),
            )
        )
    request.tool_names = frozenset(flat_names)
    request.namespaces = dict(names.back)
    request.custom_tools = frozenset(custom)
    return chat_tools


_FUNCTION_FIELDS = frozenset({"type", "name", "description", "parameters"})


def _tool_mode(value: Any, names: frozenset[str]) -> ToolChoice:
    choice = read_tool_choice(value)
    kind = value.get("type") if isinstance(value, dict) else None
    if choice is None and kind not in ("function", "custom"):
        raise _unsupported(
            "tool_choice", "expected auto, none, required or a function (no built-in tools)"
        )
    if choice is None or (choice.name is not None and choice.name not in names):
        raise invalid("tool_choice.name", "names a function that is not in tools")
    return choice


def _text_format(value: Any) -> tuple[dict[str, Any], Any]:
    """``text``: the format as sent (echoed) and as a Chat Completions response format."""
    if not isinstance(value, dict):
        raise invalid("text", "expected an object")
    for key in value:
        if key not in ("format", "verbosity"):
            raise _unsupported(f"text.{key}", "this parameter is not supported by this gateway")
    text_format = value.get("format", {"type": "text"})
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind == "json_schema":
        schema = {k: v for k, v in text_format.items() if k != "type"}
        if not isinstance(schema.get("name"), str) or not isinstance(schema.get("schema"), dict):
            raise invalid("text.format", "a json_schema format needs a name and a schema")
        return text_format, {"type": "json_schema", "json_schema": schema}
    if kind not in ("text", "json_object"):
        raise invalid("text.format.type", "expected text, json_object or json_schema")
    return text_format, text_format


def _refuse_what_changes_meaning(payload: Mapping[str, Any]) -> None:
    for key, why in _REFUSED.items():
        if payload.get(key) is not None:
            raise _unsupported(key, why)
    store = payload.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid("store", "expected true or false")
    previous = payload.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise invalid("previous_response_id", "expected a response id")
    if payload.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", "only truncation 'disabled' is supported")
    include = payload.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise invalid("include", "expected a list")
        for index, value in enumerate(include):
            if value != ENCRYPTED_REASONING:
                raise _unsupported(
                    f"include[{index}]",
                    f"only {ENCRYPTED_REASONING!r} is supported by this gateway",
                )
    if payload.get("top_logprobs"):
        raise _unsupported("top_logprobs", "log probabilities are not supported")


def parse_responses(body: bytes, *, session_id: str | None = None) -> ResponsesRequest:
    """The request a Responses body describes (see the module docstring)."""
    payload = request_object(body)
    for key in sorted(payload):
        if key not in _ACCEPTED:
            raise _unsupported(key, "this parameter is not supported by this gateway")
    _refuse_what_changes_meaning(payload)
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required (a model name from /v1/models)", "missing_required")
    source = payload.get("input")
    request = ResponsesRequest(model=model, messages=[], options=ChatOptions())
    tool_sources: list[tuple[str, Any]] = []
    if payload.get("tools") is not None:
        tool_sources.append(("tools", payload["tools"]))
    if isinstance(source, list):
        # Codex sends its tools as an input item (its "code mode"), besides or instead of
        # ``tools``.
        for index, item in enumerate(source):
            if isinstance(item, dict) and item.get("type") == "additional_tools":
                tool_sources.append((f"input[{index}].tools", item.get("tools", [])))
    names = _Names()
    chat_tools = _tools(tool_sources, request, names) if tool_sources else []
    messages = _conversation(source, names)
    instructions = payload.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "expected a string")
        if instructions:
            messages.insert(0, ChatMessage(ChatRole.SYSTEM, instructions))
    request.names = names
    request.store = payload.get("store")
    request.previous_response_id = payload.get("previous_response_id")
    if isinstance(source, str):
        request.items = [{"type": "message", "role": "user", "content": source}]
    elif isinstance(source, list):  # (`_conversation` checked it is one)
        request.items = source
        request.references = [
            index for index, item in enumerate(source) if item.get("type") == "item_reference"
        ]
    if not messages and not request.references and request.previous_response_id is None:
        # Only ``additional_tools`` items, and nothing stored to resume: nothing to answer.
        raise invalid("input", "holds no message and no instructions", "missing_required")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", "expected true or false")
    options = ChatOptions(
        temperature=number(payload, "temperature", 0.0, 2.0),
        top_p=number(payload, "top_p", 0.0, 1.0),
        max_output_tokens=integer(payload, "max_output_tokens", 1),
        session_id=session_id,
    )
    request.messages = messages
    request.options = options
    request.stream = bool(stream)
    request.include_reasoning = ENCRYPTED_REASONING in (payload.get("include") or [])
    if isinstance(payload.get("tools"), list):
        request.tools = list(payload["tools"])
    if chat_tools:
        options.tools = chat_tools
    choice = payload.get("tool_choice")
    if choice is not None:
        request.tool_choice = choice
        mode = _tool_mode(choice, request.tool_names)
        if options.tools:
            options.tool_mode = mode
        elif mode not in (ToolChoice.NONE, ToolChoice.AUTO) and not request.builtin_tools:
            raise invalid("tool_choice", "needs tools")
    parallel = payload.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("parallel_tool_calls", "expected true or false")
        request.parallel_tool_calls = parallel
        options.additional_properties["parallel_tool_calls"] = parallel
    # Vendor enums are open: any string (see `enum_value`).
    enum_value(payload.get("service_tier"), "service_tier")
    enum_value(payload.get("prompt_cache_retention"), "prompt_cache_retention")
    prompt_cache = {key: payload[key] for key in _PROMPT_CACHE if payload.get(key) is not None}
    if prompt_cache:
        options.additional_properties[OPENAI_RESPONSES_EXTRAS] = prompt_cache
    if payload.get("text") is not None:
        request.text_format, options.response_format = _text_format(payload["text"])
        verbosity = enum_value(payload["text"].get("verbosity"), "text.verbosity")
        if verbosity is not None:
            options.additional_properties["verbosity"] = verbosity
    reasoning = payload.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("reasoning", "expected an object")
        for key, value in reasoning.items():
            if key not in _REASONING_KEYS and value is not None:
                raise _unsupported(
                    f"reasoning.{key}", "only reasoning.effort and reasoning.summary are supported"
                )
        effort = enum_value(reasoning.get("effort"), "reasoning.effort")
        summary_param = (
            "reasoning.summary" if "summary" in reasoning else "reasoning.generate_summary"
        )
        summary = enum_value(
            reasoning.get("summary", reasoning.get("generate_summary")), summary_param
        )
        if summary == "none":
            summary = None
        request.reasoning = {"effort": effort, "summary": summary}
        if effort is not None or summary is not None:
            options.reasoning = ReasoningOptions(effort=effort, summary=summary)
            options.reasoning_effort = effort  # for layers that read the older field
    metadata = payload.get("metadata")
    if metadata is not None:
        # Echoed in the answer, where the API declares it strings: checked as the API does.
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise invalid("metadata", "expected an object of strings")
        request.metadata = metadata
    request.instructions = instructions if isinstance(instructions, str) else None
    request.user = user_of(payload)
    request.caller = caller_of(payload)
    return request


def resume(request: ResponsesRequest, items: list[dict[str, Any]]) -> None:
    """Make `items` (a stored conversation, then the request's input with its references
    resolved) the conversation the pipeline is asked, after the request's own
    instructions (a stored response's are not carried over, as the API does)."""
    messages = _conversation(items, request.names or _Names()) if items else []
    if request.instructions:
        messages.insert(0, ChatMessage(ChatRole.SYSTEM, request.instructions))
    if not messages:
        raise invalid("input", "the conversation is empty", "missing_required")
    request.messages = messages


# -- answers ----------------------------------------------------------------------------------


def new_response_id() -> str:
    """A fresh ``resp_`` id: the gateway's own, since failover may change upstreams."""
    return "resp_" + os.urandom(12).hex()


def _item_id(prefix: str) -> str:
    return prefix + os.urandom(8).hex()


# Why a response stopped short, by the finish reason the pipeline reports.
def _incomplete_reason(finish_reason: str | None) -> str | None:
    reason = FinishReason.of(finish_reason)
    return INCOMPLETE_REASON_OF.get(reason) if reason is not None else None


def _usage(usage: UsageDetails | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt = usage.input_tokens or 0
    output = usage.output_tokens or 0
    # What the route reported of its prompt cache and reasoning; 0 when it said nothing.
    counts = {
        "input_tokens": prompt,
        "cache_read_tokens": usage.cache_read_tokens or 0,
        "cache_write_tokens": usage.cache_write_tokens or 0,
        "output_tokens": output,
        "reasoning_tokens": usage.reasoning_tokens or 0,
        "total_tokens": usage.total_tokens if usage.total_tokens is not None else prompt + output,
    }
    body: dict[str, Any] = {}
    for name, path in USAGE_FIELDS.items():  # in the API's order
        put(body, path, counts[name])
    return body


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status != "in_progress" else [],
    }


def _custom_input(call: FunctionCallContent, request: ChatRequest) -> str | None:
    """The input text of a call of a custom tool: a custom call's, or the ``input`` of a
    route that offered the tool as a function of that one argument."""
    if call.custom:
        return call.input_text or ""
    custom = request.custom_tools if isinstance(request, ResponsesRequest) else frozenset()
    text = call.arguments.get(CUSTOM_TOOL_INPUT)
    if call.name in custom and isinstance(text, str):
        return text
    return None


def _call_item(
    item_id: str, call: FunctionCallContent, request: ChatRequest, status: str, *, empty: bool
) -> dict[str, Any]:
    """A ``function_call`` or ``custom_tool_call`` item (arguments or input left empty while
    in progress), under the tool's own name and namespace."""
    namespaces = request.namespaces if isinstance(request, ResponsesRequest) else {}
    namespace, name = namespaces.get(call.name, (None, call.name))
    text = _custom_input(call, request)
    item: dict[str, Any] = {
        "type": "function_call" if text is None else "custom_tool_call",
        "id": item_id,
        "call_id": call.call_id or "call_" + os.urandom(8).hex(),
        "name": name,
    }
    if namespace is not None:
        item["namespace"] = namespace
    if text is None:
        item["arguments"] = "" if empty else dumps(dict(call.arguments))
    else:
        item["input"] = "" if empty else text
    item["status"] = status
    return item


def _reasoning_item(
    item_id: str, text: str, protected: str | None, request: ChatRequest, *, done: bool
) -> dict[str, Any]:
    """A ``reasoning`` item: its text as the summary, its protected part as the encrypted
    content when the request includes it (else withheld, for a stored response)."""
    summary = [{"type": "summary_text", "text": text}] if done and text else []
    item: dict[str, Any] = {"type": "reasoning", "id": item_id, "summary": summary}
    if done and protected is not None and isinstance(request, ResponsesRequest):
        if request.include_reasoning:
            item["encrypted_content"] = protected
        else:
            request.withheld[item_id] = protected
    return item


def _reasoning_id(content: ReasoningContent) -> str:
    return content.id or _item_id(_GATEWAY_REASONING)


def _response_error(error: WireError) -> dict[str, Any]:
    """A failed response's ``error``: its ``code`` is one of the API's (the SDKs validate
    it against their list); the gateway's own code is in the ``error`` event before it."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {"code": code, "message": error.message, "param": error.param, "type": error.type}


def _response(
    request: ChatRequest,
    *,
    response_id: str,
    created: int,
    model: str,
    status: str,
    output: list[Any],
    usage: dict[str, Any] | None = None,
    incomplete: str | None = None,
    error: WireError | None = None,
) -> dict[str, Any]:
    """A ``response`` object, echoing the request's settings as the API does."""
    echo = (
        request
        if isinstance(request, ResponsesRequest)
        else ResponsesRequest(request.model, request.messages, request.options)
    )
    options = request.options
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None if error is None else _response_error(error),
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": echo.instructions,
        "max_output_tokens": options.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": echo.previous_response_id,
        "reasoning": {
            "effort": echo.reasoning.get("effort", options.reasoning_effort),
            "summary": echo.reasoning.get("summary"),
        },
        "store": echo.store is not False,
        "temperature": options.temperature,
        "text": {"format": echo.text_format},
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": options.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": echo.metadata,
    }


def _output(response: ChatResponse, request: ChatRequest) -> list[Any]:
    """The output items of a whole answer: reasoning, text and calls, in the model's
    order."""
    output: list[Any] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            output.append(_message_item(_item_id("msg_"), "".join(text), "completed"))
            text.clear()

    for message in response.messages:
        if message.role is not ChatRole.ASSISTANT:
            continue
        for content in message.contents:
            if type(content) is TextContent:
                text.append(content.text)
            elif type(content) is ReasoningContent:
                flush()
                output.append(
                    _reasoning_item(
                        _reasoning_id(content),
                        content.text,
                        content.protected,
                        request,
                        done=True,
                    )
                )
            elif type(content) is FunctionCallContent:
                flush()
                output.append(
                    _call_item(_item_id("fc_"), content, request, "completed", empty=False)
                )
    if text or not output:
        output.append(_message_item(_item_id("msg_"), "".join(text), "completed"))
    return output


def completion(
    response: ChatResponse, request: ChatRequest, *, response_id: str, created: int
) -> bytes:
    """The body of a non-streaming answer."""
    incomplete = _incomplete_reason(response.finish_reason)
    body = _response(
        request,
        response_id=response_id,
        created=created,
        model=response.model_id or request.model,
        status="completed" if incomplete is None else "incomplete",
        output=_output(response, request),
        usage=_usage(response.usage),
        incomplete=incomplete,
    )
    if isinstance(request, ResponsesRequest):
        request.answer = body
    return dumps(body).encode()


class ResponsesEncoder:
    """The typed events of one streamed answer (see the module docstring), numbered.

    Text and reasoning are forwarded as they arrive (one delta per update); what was sent
    is also kept, since the ``.done`` events and the last event repeat it whole. A
    reasoning item stays open while its pieces come (the route's thinking, then its
    protected part, which ends it) and is done before the next item starts.
    """

    __slots__ = (
        "_created",
        "_finish",
        "_message",
        "_model",
        "_output",
        "_reasoning",
        "_reasoning_protected",
        "_reasoning_summary",
        "_reasoning_text",
        "_request",
        "_response_id",
        "_sequence",
        "_started",
        "_text",
        "_usage",
    )

    def __init__(self, request: ChatRequest, *, model: str, response_id: str, created: int) -> None:
        self._request = request
        self._model = model
        self._response_id = response_id
        self._created = created
        self._sequence = 0
        self._started = False
        self._output: list[Any] = []  # the items done
        self._message: str | None = None  # the id of the message item open, if any
        self._text: list[str] = []
        self._reasoning: str | None = None  # the id of the reasoning item open, if any
        self._reasoning_text: list[str] = []
        self._reasoning_summary = False  # whether its summary part was opened
        self._reasoning_protected: str | None = None
        self._finish: str | None = None
        self._usage: UsageDetails | None = None

    def _event(self, kind: str, fields: dict[str, Any]) -> str:
        fields["sequence_number"] = self._sequence
        self._sequence += 1
        return sse.event(kind, dumps({"type": kind, **fields}))

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return _response(
            self._request,
            response_id=self._response_id,
            created=self._created,
            model=self._model,
            status=status,
            **fields,
        )

    def _start(self) -> str:
        if self._started:
            return ""
        self._started = True
        start = self._response("in_progress", output=[])
        return self._event("response.created", {"response": start}) + self._event(
            "response.in_progress", {"response": start}
        )

    def _open_message(self) -> str:
        self._message = item_id = _item_id("msg_")
        self._text = []
        item = _message_item(item_id, "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = len(self._output)
        return self._event(
            "response.output_item.added", {"output_index": index, "item": item}
        ) + self._event(
            "response.content_part.added",
            {"item_id": item_id, "output_index": index, "content_index": 0, "part": part},
        )

    def _close_message(self) -> str:
        item_id = self._message
        if item_id is None:
            return ""
        self._message = None
        text = "".join(self._text)
        index = len(self._output)
        item = _message_item(item_id, text, "completed")
        self._output.append(item)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return (
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
            + self._event("response.content_part.done", {**where, "part": item["content"][0]})
            + self._event("response.output_item.done", {"output_index": index, "item": item})
        )

    def _reasoning_piece(self, content: ReasoningContent) -> str:
        out = ""
        if self._reasoning is not None and (
            self._reasoning_protected is not None
            or (content.id is not None and content.id != self._reasoning)
        ):
            out += self._close_reasoning()  # a new block of reasoning
        if self._reasoning is None:
            out += self._close_message()
            self._reasoning = item_id = _reasoning_id(content)
            self._reasoning_text = []
            self._reasoning_summary = False
            self._reasoning_protected = None
            item = _reasoning_item(item_id, "", None, self._request, done=False)
            out += self._event(
                "response.output_item.added", {"output_index": len(self._output), "item": item}
            )
        where = {"item_id": self._reasoning, "output_index": len(self._output), "summary_index": 0}
        if content.text:
            if not self._reasoning_summary:
                self._reasoning_summary = True
                part = {"type": "summary_text", "text": ""}
                out += self._event("response.reasoning_summary_part.added", {**where, "part": part})
            self._reasoning_text.append(content.text)
            out += self._event(
                "response.reasoning_summary_text.delta", {**where, "delta": content.text}
            )
        if content.protected is not None:
            self._reasoning_protected = content.protected
            out += self._close_reasoning()
        return out

    def _close_reasoning(self) -> str:
        item_id = self._reasoning
        if item_id is None:
            return ""
        self._reasoning = None
        text = "".join(self._reasoning_text)
        index = len(self._output)
        item = _reasoning_item(item_id, text, self._reasoning_protected, self._request, done=True)
        self._output.append(item)
        out = ""
        if self._reasoning_summary:
            where = {"item_id": item_id, "output_index": index, "summary_index": 0}
            part = {"type": "summary_text", "text": text}
            out += self._event("response.reasoning_summary_text.done", {**where, "text": text})
            out += self._event("response.reasoning_summary_part.done", {**where, "part": part})
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def _call(self, call: FunctionCallContent) -> str:
        out = self._close_reasoning() + self._close_message()
        item_id = _item_id("fc_")
        item = _call_item(item_id, call, self._request, "completed", empty=False)
        added = _call_item(item_id, call, self._request, "in_progress", empty=True)
        index = len(self._output)
        self._output.append(item)
        where = {"item_id": item_id, "output_index": index}
        out += self._event("response.output_item.added", {"output_index": index, "item": added})
        if item["type"] == "custom_tool_call":
            text = item["input"]
            out += self._event("response.custom_tool_call_input.delta", {**where, "delta": text})
            out += self._event("response.custom_tool_call_input.done", {**where, "input": text})
        else:
            arguments = item["arguments"]
            out += self._event(
                "response.function_call_arguments.delta", {**where, "delta": arguments}
            )
            out += self._event(
                "response.function_call_arguments.done",
                {**where, "name": item["name"], "arguments": arguments},
            )
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def update(self, update: ChatResponseUpdate) -> str:
        out = self._start()
        if update.finish_reason is not None:
            self._finish = update.finish_reason
        if update.usage is not None:
            self._usage = update.usage if self._usage is None else self._usage + update.usage
        for content in update.contents:
            if isinstance(content, TextContent):
                if not content.text:
                    continue
                if self._message is None:
                    out += self._close_reasoning() + self._open_message()
                self._text.append(content.text)
                out += self._event(
                    "response.output_text.delta",
                    {
                        "item_id": self._message,
                        "output_index": len(self._output),
                        "content_index": 0,
                        "delta": content.text,
                        "logprobs": [],
                    },
                )
            elif isinstance(content, ReasoningContent):
                out += self._reasoning_piece(content)
            elif isinstance(content, FunctionCallContent):
                out += self._call(content)
        return out

    def end(self) -> str:
        out = self._start() + self._close_reasoning()
        if self._message is None and not self._output:
            out += self._open_message()  # an empty answer is still one (empty) message
        out += self._close_message()
        incomplete = _incomplete_reason(self._finish)
        status = "completed" if incomplete is None else "incomplete"
        final = self._response(
            status, output=self._output, usage=_usage(self._usage), incomplete=incomplete
        )
        if isinstance(self._request, ResponsesRequest):
            self._request.answer = final
        return out + self._event(f"response.{status}", {"response": final})

    def error(self, error: WireError) -> str:
        out = self._start()
        if self._message is not None:
            # The text streamed so far, in the failed response's output, as cut short.
            self._output.append(_message_item(self._message, "".join(self._text), "incomplete"))
            self._message = None
        out += self._event(
            "error", {"code": error.code, "message": error.message, "param": error.param}
        )
        failed = self._response("failed", output=self._output, error=error)
        return out + self._event("response.failed", {"response": failed})
