"""Core chat types shared by every client and layer.

Messages, contents, options and responses are plain dataclasses. A response assembled from
streamed updates (`ChatResponse.from_updates`) equals the one a non-streaming call returns,
so layers can treat both shapes alike.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import (
    Any,
    ClassVar,
    Literal,
    Never,
    NoReturn,
    Protocol,
    TypeAlias,
    cast,
    runtime_checkable,
)

from pipeline.errors import RequestRefusedError

__all__ = [
    "ANTHROPIC_EXTRAS",
    "BEDROCK_EXTRAS",
    "CacheMode",
    "ChatMessage",
    "ChatOptions",
    "ChatResponse",
    "ChatResponseUpdate",
    "ChatRole",
    "ChatTool",
    "Content",
    "CustomTool",
    "DataContent",
    "FinishReason",
    "FunctionCallContent",
    "FunctionResultContent",
    "FunctionTool",
    "GEMINI_EXTRAS",
    "Messages",
    "OPENAI_RESPONSES_EXTRAS",
    "ReasoningContent",
    "RawTool",
    "ReasoningOptions",
    "TextContent",
    "ToolChoice",
    "ToolDefinition",
    "UNTRANSLATED",
    "UsageDetails",
    "as_messages",
]


class ChatRole(StrEnum):
    """Who wrote a message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class FinishReason(StrEnum):
    """Why a model stopped: the Chat Completions values, which every client reports.

    A response's `finish_reason` is one of these when the provider's own value has a
    meaning here (`FinishReason.of`), and the provider's string as it came otherwise. Being
    a `StrEnum`, each compares equal to its string (``FinishReason.STOP == "stop"``).
    """

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"

    @classmethod
    def of(cls, reason: str | None) -> FinishReason | None:
        """The finish reason a provider's value stands for: a Chat Completions value
        (``function_call`` is the legacy ``tool_calls``) or an Anthropic Messages stop
        reason; None for None or a value of no known meaning."""
        return None if reason is None else _FINISH_REASONS.get(reason)


_FINISH_REASONS: dict[str, FinishReason] = {
    **{reason.value: reason for reason in FinishReason},
    "function_call": FinishReason.TOOL_CALLS,
    # Anthropic Messages stop reasons.
    "end_turn": FinishReason.STOP,
    "stop_sequence": FinishReason.STOP,
    "pause_turn": FinishReason.STOP,
    "max_tokens": FinishReason.LENGTH,
    "model_context_window_exceeded": FinishReason.LENGTH,
    "tool_use": FinishReason.TOOL_CALLS,
    "refusal": FinishReason.CONTENT_FILTER,
}


@dataclass(frozen=True, slots=True)
class TextContent:
    """A piece of text."""

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"TextContent.text must be a str, not {type(self.text).__name__}")


_new_object = object.__new__
_set_text = TextContent.__dict__["text"].__set__


def checked_text(text: str) -> TextContent:
    """`TextContent(text)` for a `text` the caller has checked is a str, without the
    dataclass's init and check: the providers make one for every chunk they stream."""
    content: TextContent = _new_object(TextContent)
    _set_text(content, text)
    return content


CUSTOM_TOOL_INPUT = "input"
"""The one argument a custom (free-form) tool has where an API knows only JSON tools: its
input text (see `CustomTool`)."""


@dataclass(frozen=True, slots=True)
class FunctionCallContent:
    """A model's request to call a tool; `arguments` is the decoded JSON object.

    A call of a custom (free-form) tool (`CustomTool`: the model writes plain text, such as
    code, not JSON) has `custom` set and its text as the one argument ``"input"``
    (`FunctionCallContent.custom_call`, `input_text`): an API that has custom tools (the
    Responses API) sends it as one, every other carries it as a JSON call with that one
    string argument, which is the schema `CustomTool.parameters` gives those APIs.
    """

    call_id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    custom: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("FunctionCallContent.name must be a non-empty str")
        if not isinstance(self.arguments, Mapping):
            raise TypeError(
                "FunctionCallContent.arguments must be a mapping, "
                f"not {type(self.arguments).__name__}"
            )
        if self.custom and not isinstance(self.arguments.get(CUSTOM_TOOL_INPUT), str):
            raise TypeError("a custom tool call's arguments must be {'input': <str>}")

    @classmethod
    def custom_call(cls, call_id: str, name: str, input_text: str) -> FunctionCallContent:
        """The call of a custom (free-form) tool whose input is `input_text`."""
        return cls(call_id, name, {CUSTOM_TOOL_INPUT: input_text}, custom=True)

    @property
    def input_text(self) -> str | None:
        """A custom tool call's input text (None for a JSON call)."""
        if not self.custom:
            return None
        text = self.arguments.get(CUSTOM_TOOL_INPUT)
        return text if isinstance(text, str) else None


@dataclass(frozen=True, slots=True)
class FunctionResultContent:
    """The result of a tool call, matched to its call by `call_id`."""

    call_id: str
    result: Any = None
    exception: BaseException | None = None


@dataclass(frozen=True, slots=True)
class DataContent:
    """Binary data, inline (`data`) or by reference (`uri`); exactly one of the two."""

    data: bytes | None = None
    uri: str | None = None
    media_type: str | None = None

    def __post_init__(self) -> None:
        if (self.data is None) == (self.uri is None):
            raise ValueError("DataContent needs exactly one of data= or uri=")


@dataclass(frozen=True, slots=True)
class ReasoningContent:
    """A model's reasoning: its thinking text (possibly a summary, possibly empty) and, in
    `protected`, the provider's opaque proof of it (an Anthropic thinking block's
    `signature` or its `redacted_thinking` data, a Responses reasoning item's
    `encrypted_content`).

    A reasoning model behind a tool loop needs its reasoning back on the next turn exactly
    as it gave it: `protected` is passed back as received, never shown, logged or recorded.
    `id` is the provider's id of the item, where it has one (Responses reasoning items);
    `redacted` marks content the provider sent only in encrypted form (Anthropic's
    `redacted_thinking`). Neither text nor `protected` appears in the repr.
    """

    text: str = ""
    protected: str | None = field(default=None, kw_only=True)
    id: str | None = field(default=None, kw_only=True)
    redacted: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"ReasoningContent.text must be a str, not {type(self.text).__name__}")
        if self.protected is not None and not isinstance(self.protected, str):
            raise TypeError(
                "ReasoningContent.protected must be a str or None, "
                f"not {type(self.protected).__name__}"
            )

    def __repr__(self) -> str:
        return (
            f"ReasoningContent(text=<{len(self.text)} chars>, "
            f"protected={'<set>' if self.protected is not None else None})"
        )


Content: TypeAlias = (
    TextContent | FunctionCallContent | FunctionResultContent | DataContent | ReasoningContent
)
_CONTENT_TYPES = (
    TextContent,
    FunctionCallContent,
    FunctionResultContent,
    DataContent,
    ReasoningContent,
)


def unknown_content(content: Never) -> NoReturn:
    """The last case of a codec's exhaustive ``match`` over `Content`: mypy proves it
    unreachable, so a new content class fails the type check until every codec handles it;
    at run time (an object put in a message's list by hand), a `TypeError` naming the type,
    never the value."""
    raise TypeError(f"{type(content).__name__} is no content type any API can carry")


def _text_of(contents: Sequence[Content]) -> str:
    if len(contents) == 1:  # a streamed update's usual shape: skip the join
        only = contents[0]
        return only.text if type(only) is TextContent else ""
    return "".join(c.text for c in contents if type(c) is TextContent)


@dataclass(slots=True)
class ChatMessage:
    """One message of a conversation.

    `contents` may be given as a plain string, which becomes a single `TextContent`; strings
    in a list of contents become `TextContent`s too.

    `additional_properties` holds what one provider's format says of the message and the
    others ignore (None when there is nothing). The one key the library reads today is
    ``"cache_control"``: an Anthropic prompt-cache breakpoint (e.g. ``{"type":
    "ephemeral"}``) after the message's last content block, which Anthropic routes send on
    that block and every other route leaves out.
    """

    role: ChatRole
    contents: list[Content] = field(default_factory=list)
    author_name: str | None = None
    additional_properties: dict[str, Any] | None = None

    def __init__(
        self,
        role: ChatRole | str,
        contents: str | Content | Iterable[Content | str] = (),
        *,
        author_name: str | None = None,
        additional_properties: dict[str, Any] | None = None,
    ) -> None:
        try:
            self.role = ChatRole(role)
        except ValueError:
            raise ValueError(
                f"unknown chat role {role!r}; expected one of {[r.value for r in ChatRole]}"
            ) from None
        if isinstance(contents, str):
            self.contents = [TextContent(contents)]
        elif isinstance(contents, _CONTENT_TYPES):
            self.contents = [contents]
        else:
            items: list[Content] = []
            for item in contents:
                if isinstance(item, str):
                    items.append(TextContent(item))
                elif isinstance(item, _CONTENT_TYPES):
                    items.append(item)
                else:
                    raise TypeError(
                        "message contents must be content objects or str, "
                        f"not {type(item).__name__}"
                    )
            self.contents = items
        self.author_name = author_name
        self.additional_properties = additional_properties

    @classmethod
    def system(cls, text: str) -> ChatMessage:
        return cls(ChatRole.SYSTEM, text)

    @classmethod
    def user(cls, contents: str | Content | Iterable[Content | str]) -> ChatMessage:
        return cls(ChatRole.USER, contents)

    @classmethod
    def assistant(cls, contents: str | Content | Iterable[Content | str]) -> ChatMessage:
        return cls(ChatRole.ASSISTANT, contents)

    @classmethod
    def tool(cls, contents: Content | Iterable[Content]) -> ChatMessage:
        return cls(ChatRole.TOOL, contents)

    @property
    def text(self) -> str:
        """The concatenated text contents."""
        return _text_of(self.contents)

    def __repr__(self) -> str:
        # Message text stays out of reprs, so a message logged or put in an exception by
        # accident does not leak its content.
        kinds = ", ".join(type(c).__name__ for c in self.contents)
        return f"ChatMessage(role={self.role.value!r}, contents=[{kinds}])"


def checked_message(role: ChatRole, contents: list[Content]) -> ChatMessage:
    """`ChatMessage(role, contents)` for a `role` that is a `ChatRole` and `contents` the
    caller made as content objects (the list is kept, not copied), without the init's
    checks: the gateway makes one for every message of a request."""
    message: ChatMessage = _new_object(ChatMessage)
    message.role = role
    message.contents = contents
    message.author_name = None
    message.additional_properties = None
    return message


Messages: TypeAlias = str | ChatMessage | Sequence[ChatMessage]


@runtime_checkable
class ToolDefinition(Protocol):
    """A tool as a model is offered it: a name, a description and the JSON schema of its
    arguments (`middleware.tools.Tool` is one; so is any object with these attributes)."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str | None: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class CustomTool:
    """A custom (free-form) tool: the model calls it with plain text (code, a patch), not a
    JSON object, as the Responses API's ``{"type": "custom"}`` tools; `format` is that API's
    input format (``{"type": "text"}``, or a ``grammar``), None for any text.

    It is a `ToolDefinition` too: a provider whose API has no custom tools offers it as a
    function of one string argument, ``"input"`` (`parameters`), and the calls come back
    as `FunctionCallContent.custom_call`, so a route of any API can serve it.
    """

    name: str
    description: str | None = None
    format: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("CustomTool.name must be a non-empty str")

    @property
    def parameters(self) -> Mapping[str, Any]:
        """The JSON schema of the one string argument an API without custom tools sees."""
        return {
            "type": "object",
            "properties": {
                CUSTOM_TOOL_INPUT: {"type": "string", "description": "The tool's input text."}
            },
            "required": [CUSTOM_TOOL_INPUT],
            "additionalProperties": False,
        }


def _no_arguments() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A function tool as a client declared it: its `name`, `description` and the JSON
    schema of its arguments (`parameters`), which every API can send, and the fields only
    some APIs have, in `additional_properties` under each API's name (``{"messages":
    {"cache_control": {...}}}``; the names are the wire APIs', see `RawTool`): a route
    speaking one of those APIs adds its fields to the tool, the others leave them out."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=_no_arguments)
    additional_properties: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("FunctionTool.name must be a non-empty str")
        if not isinstance(self.parameters, Mapping):
            raise TypeError("FunctionTool.parameters must be a JSON schema mapping")


@dataclass(frozen=True, slots=True)
class RawTool:
    """A tool in one API's own shape, which no other API has (a built-in tool such as the
    Responses API's ``{"type": "web_search"}``, an Anthropic server tool): a route speaking
    `api` sends `body` as given; a route of another API cannot, and refuses the request
    (`UnsendableRequestError`) rather than answer without the tool.

    `api` is the wire API's name, as the packages of `pipeline.wire` are named:
    ``"chat_completions"``, ``"responses"`` (OpenAI's), ``"messages"`` (Anthropic's),
    ``"gemini"`` (Google's, Vertex AI's too), ``"bedrock"`` (Bedrock's Converse).
    """

    api: str
    body: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.api, str) or not self.api:
            raise ValueError("RawTool.api must be a wire API's name")
        if not isinstance(self.body, Mapping):
            raise TypeError(f"RawTool.body must be a mapping, not {type(self.body).__name__}")

    def __repr__(self) -> str:
        return f"RawTool(api={self.api!r}, body=<{len(self.body)} fields>)"


ChatTool: TypeAlias = ToolDefinition | RawTool
"""What `ChatOptions.tools` holds: tool definitions (`FunctionTool`, `CustomTool`,
`middleware.tools.Tool`, any object with a name, a description and parameters), which every
API writes in its own shape, and `RawTool`s, which only their own API's routes send.

A mapping in a provider's shape (a Chat Completions ``{"type": "function", "function":
{...}}``, a Messages ``{"name", "input_schema"}``) is still read, as the function or custom
tool it describes, with a `DeprecationWarning`; one of another shape is taken, as before, for
a tool in the shape of whichever route's API sends it: a `RawTool` says which API it is."""


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether the model must call a tool, and which (after Microsoft.Extensions.AI's
    `ChatToolMode`): `ToolChoice.AUTO` (the model decides), `ToolChoice.NONE` (it calls
    none), `ToolChoice.REQUIRED` (it calls at least one of the tools offered) or
    `ToolChoice.named(name)` (it calls that tool: `mode` is ``"required"``, `name` is set).

    A tool may have any name, ``"none"`` included: `ToolChoice.named("none")` asks for a
    call of that tool, never for no call. Each wire API writes a choice its own way.
    """

    mode: Literal["auto", "none", "required"]
    name: str | None = None

    AUTO: ClassVar[ToolChoice]
    NONE: ClassVar[ToolChoice]
    REQUIRED: ClassVar[ToolChoice]

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "none", "required"):
            raise ValueError("ToolChoice.mode must be 'auto', 'none' or 'required'")
        if self.name is not None and (
            self.mode != "required" or not isinstance(self.name, str) or not self.name
        ):
            raise ValueError("a named ToolChoice is ToolChoice.named(<a non-empty tool name>)")

    @classmethod
    def named(cls, name: str) -> ToolChoice:
        """The model must call the tool called `name`."""
        return cls("required", name)

    def __repr__(self) -> str:
        if self.name is not None:
            return f"ToolChoice.named({self.name!r})"
        return f"ToolChoice.{self.mode.upper()}"


ToolChoice.AUTO = ToolChoice("auto")
ToolChoice.NONE = ToolChoice("none")
ToolChoice.REQUIRED = ToolChoice("required")
_TOOL_MODES: dict[str, ToolChoice] = {
    "auto": ToolChoice.AUTO,
    "none": ToolChoice.NONE,
    "required": ToolChoice.REQUIRED,
}


def as_tool_choice(value: object, tools: Iterable[object] | None = None) -> ToolChoice | None:
    """`value` as a `ToolChoice`: a choice (or None) as it is; a string, the deprecated
    form of `ChatOptions.tool_mode`, with a `DeprecationWarning`: ``"auto"``, ``"none"``
    and ``"required"`` are those modes, any other string a tool's name. A mode word is
    ambiguous when one of `tools` has that name: `ValueError` (say `ToolChoice.NONE` or
    `ToolChoice.named("none")`)."""
    if value is None or type(value) is ToolChoice:
        return value
    if not isinstance(value, str) or not value:
        raise TypeError(f"ChatOptions.tool_mode must be a ToolChoice, not {type(value).__name__}")
    warnings.warn(
        "ChatOptions.tool_mode as a string is deprecated: use ToolChoice.AUTO, "
        "ToolChoice.NONE, ToolChoice.REQUIRED or ToolChoice.named(name)",
        DeprecationWarning,
        stacklevel=4,  # the caller of ChatOptions(...) or of with_()
    )
    mode = _TOOL_MODES.get(value)
    if mode is None:
        return ToolChoice.named(value)
    if any(getattr(tool, "name", None) == value for tool in tools or ()):
        raise ValueError(
            f"tool_mode {value!r} is ambiguous: a tool is named {value!r}; use "
            f"ToolChoice.{value.upper()} or ToolChoice.named({value!r})"
        )
    return mode


def as_messages(messages: Messages) -> list[ChatMessage]:
    """Normalize the accepted message shapes to a list of `ChatMessage`.

    Raises `TypeError` for anything but a str, a `ChatMessage` or a sequence of them, and
    `RequestRefusedError` (a `ValueError`, ``param="messages"``) for an empty sequence. A
    list of messages is returned as is (not copied); layers that change the list copy it
    first.
    """
    if type(messages) is list:
        for message in messages:
            if type(message) is not ChatMessage and not isinstance(message, ChatMessage):
                raise TypeError(
                    f"messages must contain ChatMessage objects, not {type(message).__name__}"
                )
        if not messages:
            raise RequestRefusedError(
                "messages: must not be empty (the conversation holds no message)", param="messages"
            )
        return messages
    if isinstance(messages, str):
        return [ChatMessage(ChatRole.USER, messages)]
    if isinstance(messages, ChatMessage):
        return [messages]
    if messages is None:
        raise TypeError("messages must be a str, a ChatMessage or a sequence of them, not None")
    if isinstance(messages, Sequence):
        return as_messages(list(cast(Sequence[ChatMessage], messages)))
    raise TypeError(
        "messages must be a str, a ChatMessage or a sequence of them, "
        f"not {type(messages).__name__}"
    )


@dataclass(frozen=True, slots=True)
class ReasoningOptions:
    """How much a reasoning model may think, and what it shows of it.

    `effort` is an OpenAI level (``"none"``, ``"minimal"``, ``"low"``, ``"medium"``,
    ``"high"``, ``"xhigh"``, ``"max"``): OpenAI's enum is open, so OpenAI routes send
    other values as they are, and a route of another API refuses a value it cannot
    translate (`RequestRefusedError`); `budget_tokens` an
    Anthropic-style thinking budget (`0` turns thinking off); `summary` the Responses API's
    reasoning summary (``"auto"``, ``"concise"``, ``"detailed"``). Each provider maps what its
    API has and drops the rest: a route that cannot think answers without thinking.
    """

    effort: str | None = None
    budget_tokens: int | None = None
    summary: str | None = None

    def __post_init__(self) -> None:
        if self.effort is not None and not isinstance(self.effort, str):
            raise TypeError("ReasoningOptions.effort must be a str or None")
        if self.budget_tokens is not None and (
            isinstance(self.budget_tokens, bool)
            or not isinstance(self.budget_tokens, int)
            or self.budget_tokens < 0
        ):
            raise ValueError("ReasoningOptions.budget_tokens must be a non-negative int or None")
        if self.summary is not None and not isinstance(self.summary, str):
            raise TypeError("ReasoningOptions.summary must be a str or None")


class CacheMode(StrEnum):
    """What a response cache (`middleware.cache`) does with one request: ``use`` (answer
    from the cache when it can, store the answer when it calls), ``refresh`` (call the
    provider, store the new answer) or ``bypass`` (call the provider, store nothing)."""

    USE = "use"
    REFRESH = "refresh"
    BYPASS = "bypass"


ANTHROPIC_EXTRAS = "anthropic"
"""The `ChatOptions.additional_properties` key whose dict only Anthropic routes send."""

OPENAI_RESPONSES_EXTRAS = "openai_responses"
"""The `ChatOptions.additional_properties` key whose dict only OpenAI Responses routes send
(``prompt_cache_key``, ``prompt_cache_retention``: OpenAI's prompt cache, which no other
API has)."""

BEDROCK_EXTRAS = "bedrock"
"""The `ChatOptions.additional_properties` key whose dict only Bedrock routes send (Converse
fields: ``guardrailConfig``, ``additionalModelRequestFields``, ``performanceConfig``...)."""

GEMINI_EXTRAS = "gemini"
"""The `ChatOptions.additional_properties` key whose dict only Gemini and Vertex AI Gemini
routes send (``safetySettings``, ``cachedContent``, ``generationConfig`` fields...)."""

UNTRANSLATED = "untranslated"
"""The `ChatOptions.additional_properties` key of values a caller sent in its own API's
vocabulary that the options have no word for, ``{scope: {field: value}}`` (e.g.
``{"anthropic": {"output_config.effort": "ultra"}}``; the value itself travels in that
scope's fields). A vendor's enum is open: a route of that API sends the value as given; a
route of another API cannot translate it and refuses the request (`RequestRefusedError`)
rather than drop it."""

PROVIDER_EXTRAS = frozenset(
    {ANTHROPIC_EXTRAS, OPENAI_RESPONSES_EXTRAS, BEDROCK_EXTRAS, GEMINI_EXTRAS, UNTRANSLATED}
)
"""Keys of `ChatOptions.additional_properties` scoped to one provider's format: every other
provider leaves them out of its requests (`UNTRANSLATED`: every provider)."""


@dataclass(slots=True)
class ChatOptions:
    """Per-request options. Layers never mutate a caller's object: they work on `clone()`.

    `additional_properties` are provider-specific request fields, merged into the body each
    provider sends (never overriding what the request needs). One entry is scoped: under
    ``"anthropic"`` (`ANTHROPIC_EXTRAS`), a dict of Messages API fields (``thinking``
    details, ``context_management``, ``output_config``, ``metadata``...) that only Anthropic
    routes send, each as given, and every other route drops: so a caller's own Messages
    fields reach an Anthropic route untouched without being refused elsewhere. Likewise
    ``"openai_responses"`` (`OPENAI_RESPONSES_EXTRAS`) for OpenAI Responses routes only,
    ``"bedrock"`` (`BEDROCK_EXTRAS`) for Bedrock routes only, and ``"gemini"``
    (`GEMINI_EXTRAS`) for Gemini routes (Gemini API and Vertex AI) only.

    `tool_mode` is a `ToolChoice`; a string is still taken where it is unambiguous, with a
    `DeprecationWarning` (see `as_tool_choice`).
    """

    model_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    tools: list[ChatTool] | None = None
    tool_mode: ToolChoice | None = None
    response_format: Any = None
    reasoning_effort: str | None = None
    session_id: str | None = None
    additional_properties: dict[str, Any] = field(default_factory=dict)
    reasoning: ReasoningOptions | None = None
    cache: CacheMode | None = None
    """What a response cache does with this request (None: ``CacheMode.USE``); never
    reaches a provider."""

    def __post_init__(self) -> None:
        if self.tool_mode is not None and type(self.tool_mode) is not ToolChoice:
            self.tool_mode = as_tool_choice(self.tool_mode, self.tools)

    def clone(self) -> ChatOptions:
        """An independent copy: its lists and dicts are copies too.

        `stop` and `tools` are new lists of the same items (tool definitions are shared).
        In `response_format` and `additional_properties` every dict and list is copied, at
        any depth and without recursion, so no nesting is too deep to clone; a structure
        referring to itself is copied with the same shape. Any other value (strings,
        numbers, a model class, your own objects) is shared: treat those as immutable.
        """
        # Field by field into a bare instance: a third of the cost of `__init__`'s keywords,
        # on a path every layer that changes options takes once per request or attempt.
        clone: ChatOptions = _new_object(ChatOptions)
        clone.model_id = self.model_id
        clone.temperature = self.temperature
        clone.top_p = self.top_p
        clone.max_output_tokens = self.max_output_tokens
        clone.stop = None if self.stop is None else list(self.stop)
        clone.seed = self.seed
        clone.tools = None if self.tools is None else list(self.tools)
        clone.tool_mode = self.tool_mode
        response_format = self.response_format
        clone.response_format = None if response_format is None else _copy_json(response_format)
        clone.reasoning_effort = self.reasoning_effort
        clone.session_id = self.session_id
        additional = self.additional_properties
        clone.additional_properties = _copy_json(additional) if additional else {}
        clone.reasoning = self.reasoning
        clone.cache = self.cache
        if clone.tool_mode is not None and type(clone.tool_mode) is not ToolChoice:
            clone.__post_init__()  # a string assigned after construction: as `__init__` would
        return clone

    def with_(self, **changes: Any) -> ChatOptions:
        """A clone with the given fields replaced; unknown field names raise `TypeError`."""
        clone = self.clone()
        names = _OPTION_FIELDS
        for key, value in changes.items():
            if key not in names:
                raise TypeError(f"ChatOptions has no field {key!r}")
            setattr(clone, key, value)
        if "tool_mode" in changes:
            clone.__post_init__()
        return clone

    def __repr__(self) -> str:
        # Tools and additional properties may carry user data; show only which fields are set.
        set_fields = [
            f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, {}, [])
        ]
        return f"ChatOptions(set={set_fields})"


_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(ChatOptions))
_new_object = object.__new__


def session_options(session_id: str | None) -> ChatOptions:
    """`ChatOptions(session_id=session_id)`, every other field its default: a clone of the
    defaults (field by field, a third of `__init__`'s cost), which the gateway makes for
    every request that sets no option."""
    options = _DEFAULT_OPTIONS.clone()
    options.session_id = session_id
    return options


_DEFAULT_OPTIONS = ChatOptions()  # never handed out: `session_options` clones it


def _copy_json(value: Any) -> Any:
    """`value` with every dict and list in it copied, at any depth. A loop over the copies
    still to fill, not recursion: JSON nested thousands of levels deep is copied like any
    other. A dict or list met twice is copied once (so self-reference keeps its shape);
    everything else is shared."""
    kind = type(value)
    if kind is not dict and kind is not list:
        return value
    root = value.copy()
    copies: dict[int, Any] = {id(value): root}
    pending: list[Any] = [root]
    while pending:
        container = pending.pop()
        # Each copy still holds the originals: replace each nested dict or list by its copy.
        items = container.items() if type(container) is dict else enumerate(container)
        for key, item in items:
            kind = type(item)
            if kind is dict or kind is list:
                copied = copies.get(id(item))
                if copied is None:
                    copied = copies[id(item)] = item.copy()
                    pending.append(copied)
                container[key] = copied
    return root


@dataclass(frozen=True, slots=True)
class UsageDetails:
    """Token counts of one response; `None` means the provider did not say.

    `input_tokens` counts every input token, those read from or written to a prompt cache
    included (as OpenAI counts them; the Anthropic providers add Anthropic's separate counts
    in); `cache_read_tokens` and `cache_write_tokens` say how many of them the cache served or
    stored. `reasoning_tokens` are the part of `output_tokens` the model spent thinking.
    """

    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None

    def __add__(self, other: UsageDetails) -> UsageDetails:
        def add(a: int | None, b: int | None) -> int | None:
            if a is None:
                return b
            if b is None:
                return a
            return a + b

        return UsageDetails(
            add(self.input_tokens, other.input_tokens),
            add(self.output_tokens, other.output_tokens),
            add(self.total_tokens, other.total_tokens),
            add(self.reasoning_tokens, other.reasoning_tokens),
            add(self.cache_read_tokens, other.cache_read_tokens),
            add(self.cache_write_tokens, other.cache_write_tokens),
        )


@dataclass(slots=True)
class ChatResponseUpdate:
    """One streamed piece of a response.

    `value` is set only on the update a response-validation layer adds after a streamed
    response validated (an update with no contents): the validated object, as on
    `ChatResponse.value`. `raw_representation` is what the provider sent for it, when the
    provider was asked to keep it (the gateway's forwarded path: the events of one read of
    the stream, as `pipeline.providers._forwarding` keeps them); None otherwise.
    """

    role: ChatRole | None = ChatRole.ASSISTANT
    contents: list[Content] = field(default_factory=list)
    response_id: str | None = None
    model_id: str | None = None
    finish_reason: str | None = None
    usage: UsageDetails | None = None
    value: Any = None
    raw_representation: Any = field(default=None, compare=False, repr=False)

    @property
    def text(self) -> str:
        return _text_of(self.contents)

    def __repr__(self) -> str:
        kinds = ", ".join(type(c).__name__ for c in self.contents)
        return (
            f"ChatResponseUpdate(role={self.role}, contents=[{kinds}], "
            f"finish_reason={self.finish_reason!r})"
        )


def _merge_reasoning(previous: Content, piece: ReasoningContent) -> ReasoningContent | None:
    """One reasoning block from a streamed block and its next piece, or None when `piece`
    starts a block of its own: streams send a block's thinking in pieces and its protected
    part (a signature) last, so a block that has its protected part, or is redacted, is
    complete."""
    if (
        type(previous) is not ReasoningContent
        or previous.protected is not None
        or previous.redacted
        or piece.redacted
        or (piece.id is not None and previous.id is not None and piece.id != previous.id)
    ):
        return None
    return ReasoningContent(
        previous.text + piece.text, protected=piece.protected, id=previous.id or piece.id
    )


@dataclass(slots=True)
class ChatResponse:
    """A complete response: usually one assistant message, more when tools were called.

    `value` is the validated object when a response-validation layer checked the response
    (`use_response_validation`: the parsed model instance, the decoded JSON, or what the
    caller's check returned); `None` otherwise. `raw_representation` is what the provider
    sent, when it was asked to keep it (the gateway's forwarded path: the decoded body);
    None otherwise.
    """

    messages: list[ChatMessage] = field(default_factory=list)
    response_id: str | None = None
    model_id: str | None = None
    finish_reason: str | None = None
    usage: UsageDetails | None = None
    value: Any = None
    raw_representation: Any = field(default=None, compare=False, repr=False)

    @property
    def text(self) -> str:
        """The text of the last message: the final answer."""
        return self.messages[-1].text if self.messages else ""

    def to_updates(self) -> list[ChatResponseUpdate]:
        """The response as updates, one per message; the last carries finish reason, usage
        and `value`."""
        updates = [
            ChatResponseUpdate(
                role=m.role,
                contents=list(m.contents),
                response_id=self.response_id,
                model_id=self.model_id,
            )
            for m in self.messages
        ]
        if not updates:
            updates.append(ChatResponseUpdate(response_id=self.response_id, model_id=self.model_id))
        updates[-1].finish_reason = self.finish_reason
        updates[-1].usage = self.usage
        updates[-1].value = self.value
        return updates

    @classmethod
    def from_updates(cls, updates: Iterable[ChatResponseUpdate]) -> ChatResponse:
        """Assemble streamed updates: adjacent text of one role is joined into one message.

        A role change or an update carrying a tool result starts a new message; the last
        non-empty response id, model id, finish reason and `value` win; usage is summed.
        """
        messages: list[ChatMessage] = []
        response_id = model_id = finish_reason = None
        usage: UsageDetails | None = None
        value: Any = None
        current: ChatMessage | None = None
        # Adjacent text pieces are joined once, when the run of text ends: joining them
        # piece by piece would copy the text so far on every update.
        text: list[str] = []
        for update in updates:
            response_id = update.response_id or response_id
            model_id = update.model_id or model_id
            finish_reason = update.finish_reason or finish_reason
            if update.value is not None:
                value = update.value
            if update.usage is not None:
                usage = update.usage if usage is None else usage + update.usage
            role = update.role or (current.role if current else ChatRole.ASSISTANT)
            if update.contents:
                if current is None or current.role != role:
                    if text and current is not None:
                        current.contents.append(TextContent("".join(text)))
                        text.clear()
                    current = ChatMessage(role)
                    messages.append(current)
                for content in update.contents:
                    if type(content) is TextContent:
                        text.append(content.text)
                        continue
                    if text:
                        current.contents.append(TextContent("".join(text)))
                        text.clear()
                    if type(content) is ReasoningContent and current.contents:
                        merged = _merge_reasoning(current.contents[-1], content)
                        if merged is not None:
                            current.contents[-1] = merged
                            continue
                    current.contents.append(content)
        if text and current is not None:
            current.contents.append(TextContent("".join(text)))
        return cls(
            messages=messages,
            response_id=response_id,
            model_id=model_id,
            finish_reason=finish_reason,
            usage=usage,
            value=value,
        )

    def __repr__(self) -> str:
        return (
            f"ChatResponse(messages={len(self.messages)}, response_id={self.response_id!r}, "
            f"model_id={self.model_id!r}, finish_reason={self.finish_reason!r})"
        )
