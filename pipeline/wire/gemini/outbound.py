"""Core -> a Gemini ``generateContent`` request; Gemini answers and stream chunks -> core (an
answer is read as a stream of one chunk). Pure functions; what does not fit is a
`ProviderError` that never quotes the payload. Every content type is matched (mypy checks);
unknown part kinds are skipped, as the API asks. Thought signatures: docs/providers.md."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.errors import FailureKind, ProviderError, provider_error
from pipeline.types import (
    CUSTOM_TOOL_INPUT,
    GEMINI_EXTRAS,
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
    error_from_payload,
    int_or_none,
    malformed,
    str_or_none,
    tool_result_text,
)
from pipeline.wire.gemini.vocab import (
    API,
    EFFORT_ALIASES,
    FINISH_REASONS,
    GENERATION_EXTRAS,
    NO_THINKING_EFFORT,
    ROLES,
    THINKING_LEVELS,
    THOUGHT_SIGNATURE_PLACEHOLDER,
    UNSENT_EXTRAS,
    tool_config,
)
from pipeline.wire.tools import as_tool, function_definition, raw_body

__all__ = ["GeminiStreamReader", "build_request", "parse_response", "parse_usage"]

_ASSISTANT = ChatRole.ASSISTANT
_USER = ROLES[ChatRole.USER]
_MODEL = ROLES[ChatRole.ASSISTANT]

# -- requests ---------------------------------------------------------------------------------


def _data_part(content: DataContent) -> dict[str, Any]:
    media_type = content.media_type
    uri = content.uri
    if uri is not None and uri.startswith("data:"):
        # A data URL is inline data, which the API takes as base64 with its type.
        header, comma, payload = uri[5:].partition(",")
        if not comma or not header.endswith(";base64"):
            raise ValueError("DataContent: only base64 data URLs can be sent to Gemini")
        media_type = media_type or header.removesuffix(";base64")
        if not media_type:
            raise ValueError("DataContent sent to Gemini as data needs a media_type")
        return {"inlineData": {"mimeType": media_type, "data": payload}}
    if uri is not None:
        reference: dict[str, Any] = {"fileUri": uri}
        if media_type:
            reference["mimeType"] = media_type
        return {"fileData": reference}
    if not media_type:
        raise ValueError("DataContent sent to Gemini as data needs a media_type")
    encoded = base64.b64encode(content.data or b"").decode("ascii")
    return {"inlineData": {"mimeType": media_type, "data": encoded}}


def _function_response(content: FunctionResultContent, names: Mapping[str, str]) -> dict[str, Any]:
    """A tool result: the API matches it to its call by the function's name, which only the
    call in the conversation knows."""
    name = names.get(content.call_id)
    if name is None:
        raise ValueError(
            "a tool result whose call is not in the conversation: Gemini needs the call's "
            "function name"
        )
    response: dict[str, Any]
    if content.exception is not None and content.result is None:
        response = {"error": tool_result_text(content)}
    elif isinstance(content.result, Mapping | list) and _encodable(content.result):
        response = {"output": content.result}  # structured, as the tool returned it
    else:
        response = {"output": tool_result_text(content)}
    return {"functionResponse": {"id": content.call_id, "name": name, "response": response}}


def _parts(message: ChatMessage, names: dict[str, str]) -> list[dict[str, Any]]:
    """A message's contents as parts; a model turn's reasoning as thought parts, and its
    signatures on the parts they came with."""
    parts: list[dict[str, Any]] = []
    model = message.role is _ASSISTANT
    signature: str | None = None  # waiting for the next part that is no thought
    for content in message.contents:
        part: dict[str, Any]
        match content:
            case TextContent():
                if not content.text:
                    continue
                part = {"text": content.text}
            case DataContent():
                part = _data_part(content)
            case FunctionCallContent():
                names[content.call_id] = content.name
                call = {"id": content.call_id, "name": content.name}
                part = {"functionCall": {**call, "args": dict(content.arguments)}}
            case FunctionResultContent():
                part = _function_response(content, names)
            case ReasoningContent():
                # Another API's encrypted reasoning (Anthropic's redacted thinking, a
                # Responses reasoning item) means nothing here; thought text and signatures
                # go back on a model turn only.
                if not model or content.redacted or content.id is not None:
                    continue
                if content.text:
                    parts.append({"text": content.text, "thought": True})
                if content.protected:
                    signature = content.protected
                continue
            case _:
                unknown_content(content)
        if signature is not None:
            part["thoughtSignature"] = signature
            signature = None
        parts.append(part)
    if signature is not None:
        parts.append({"text": "", "thoughtSignature": signature})
    return parts


def _sign_current_turn(contents: list[dict[str, Any]]) -> None:
    """Give the first function call of each model turn after the last user input a
    signature when it has none (`THOUGHT_SIGNATURE_PLACEHOLDER`): Gemini 3 refuses those
    turns without one, and a conversation from another API or route has none."""
    start = 0
    for index, content in enumerate(contents):
        if content["role"] == _USER and any("functionResponse" not in p for p in content["parts"]):
            start = index + 1
    for content in contents[start:]:
        if content["role"] != _MODEL:
            continue
        for part in content["parts"]:
            if "functionCall" in part:
                part.setdefault("thoughtSignature", THOUGHT_SIGNATURE_PLACEHOLDER)
                break


def _conversation(messages: Sequence[ChatMessage]) -> tuple[list[str], list[dict[str, Any]]]:
    """System texts, in order (a system message anywhere: the API has one place for
    them), and the contents; adjacent turns of one role are merged, tool results going
    back in the user turn."""
    system: list[str] = []
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name
    for message in messages:
        if message.role is ChatRole.SYSTEM:
            system += [c.text for c in message.contents if type(c) is TextContent and c.text]
            continue
        parts = _parts(message, names)
        if not parts:
            continue
        role = _MODEL if message.role is _ASSISTANT else _USER
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"] += parts
        else:
            contents.append({"role": role, "parts": parts})
    _sign_current_turn(contents)
    return system, contents


def _tools(tools: Sequence[ChatTool]) -> list[dict[str, Any]]:
    """The tools' function declarations (JSON Schema as written: ``parameters`` takes only
    the API's OpenAPI subset; a raw one, with a name, as it is), then the other raw tools of
    this API (``googleSearch``...)."""
    declarations: list[dict[str, Any]] = []
    own: list[dict[str, Any]] = []
    for tool in tools:
        match as_tool(tool, API):
            case RawTool() as raw:
                body = raw_body(raw, API)
                (declarations if "name" in body else own).append(body)
            case definition:
                declarations.append(function_definition(definition, API, "parametersJsonSchema"))
    return ([{"functionDeclarations": declarations}] if declarations else []) + own


def _thinking(options: ChatOptions) -> dict[str, Any] | None:
    """``thinkingConfig``: a budget as ``thinkingBudget`` (0: off), else an effort as
    ``thinkingLevel`` (``none``: a budget of 0); the API takes one of the two. A reasoning
    summary asks for thought summaries (``includeThoughts``)."""
    reasoning = options.reasoning
    effort = (reasoning.effort if reasoning is not None else None) or options.reasoning_effort
    budget = reasoning.budget_tokens if reasoning is not None else None
    config: dict[str, Any] = {}
    if budget is not None:
        config["thinkingBudget"] = budget
    elif effort == NO_THINKING_EFFORT:
        config["thinkingBudget"] = 0
    elif effort is not None:
        effort = EFFORT_ALIASES.get(effort, effort)
        config["thinkingLevel"] = THINKING_LEVELS.get(effort, effort)
    summary = reasoning.summary if reasoning is not None else None
    if summary not in (None, "none") and config.get("thinkingBudget") != 0:
        config["includeThoughts"] = True
    return config or None


def _output_format(value: Any) -> dict[str, Any]:
    """`ChatOptions.response_format` as ``generationConfig`` fields: JSON, with the schema
    when it has one (``responseJsonSchema`` takes JSON Schema as written)."""
    if value is None or value == "text":
        return {}
    if value in ("json", "json_object"):
        return {"responseMimeType": "application/json"}
    if isinstance(value, Mapping):
        kind = value.get("type")
        if kind == "text":
            return {}
        if kind == "json_object":
            return {"responseMimeType": "application/json"}
        schema: Any = None
        if kind == "json_schema":
            schema = value.get("schema")
            nested = value.get("json_schema")
            if schema is None and isinstance(nested, Mapping):
                schema = nested.get("schema")
        elif kind is None:
            schema = value.get("schema")  # a bare {"name", "schema"}
        if isinstance(schema, Mapping):
            return {"responseMimeType": "application/json", "responseJsonSchema": dict(schema)}
    raise ValueError("response_format must be 'text', 'json' or a JSON-schema format with a schema")


def _merge(into: dict[str, Any], extras: Mapping[str, Any]) -> None:
    """The caller's own fields (`GEMINI_EXTRAS`), as given: objects merged key by key into
    what the options made."""
    for key, value in extras.items():
        current = into.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            _merge(current, value)
        else:
            into[key] = value


def build_request(messages: Sequence[ChatMessage], options: ChatOptions | None) -> dict[str, Any]:
    """The JSON body of a ``generateContent`` request (the model is in the URL).

    `ChatOptions.reasoning` becomes ``thinkingConfig`` (`_thinking`), a JSON
    `response_format` ``responseMimeType`` and ``responseJsonSchema``; `tool_mode` the
    ``toolConfig``. Other APIs' sampling fields in `additional_properties` go where this
    API has them (`GENERATION_EXTRAS`), OpenAI's fields it has none for are left out
    (`UNSENT_EXTRAS`), any other is set on the body as given; the dict under
    `GEMINI_EXTRAS` is the caller's own fields, merged last (``safetySettings``,
    ``cachedContent``, ``generationConfig`` fields...).
    """
    system, contents = _conversation(messages)
    if not contents:
        raise ValueError("Gemini needs at least one user or assistant message with content")
    body: dict[str, Any] = {"contents": contents}
    if system:
        body["systemInstruction"] = {"parts": [{"text": text} for text in system]}
    if options is None:
        return body
    config: dict[str, Any] = {}
    if options.max_output_tokens is not None:
        config["maxOutputTokens"] = options.max_output_tokens
    if options.temperature is not None:
        config["temperature"] = options.temperature
    if options.top_p is not None:
        config["topP"] = options.top_p
    if options.stop:
        config["stopSequences"] = list(options.stop)
    if options.seed is not None:
        config["seed"] = options.seed
    config.update(_output_format(options.response_format))
    thinking = _thinking(options)
    if thinking is not None:
        config["thinkingConfig"] = thinking
    if options.tools:
        body["tools"] = _tools(options.tools)
        choice = as_tool_choice(options.tool_mode, options.tools)
        if choice is not None:
            body["toolConfig"] = tool_config(choice)
    scoped: Any = None
    for key, value in options.additional_properties.items():
        if key == GEMINI_EXTRAS:
            scoped = value
        elif key in GENERATION_EXTRAS:
            config.setdefault(GENERATION_EXTRAS[key], value)
        elif key not in UNSENT_EXTRAS and key != "contents":
            body.setdefault(key, value)
    if config:
        body["generationConfig"] = config
    if isinstance(scoped, Mapping):
        _merge(body, {k: v for k, v in scoped.items() if k != "contents"})
    return body


# -- answers ----------------------------------------------------------------------------------


def parse_usage(value: Any) -> UsageDetails | None:
    """``usageMetadata``: input tokens are the prompt's (cached ones included, and told
    apart as `cache_read_tokens`) and a tool's prompt; output tokens are the answer's and
    the thoughts' (`reasoning_tokens`)."""
    if not isinstance(value, Mapping):
        return None
    prompt = int_or_none(value.get("promptTokenCount"))
    tool_prompt = int_or_none(value.get("toolUsePromptTokenCount"))
    candidates = int_or_none(value.get("candidatesTokenCount"))
    thoughts = int_or_none(value.get("thoughtsTokenCount"))
    input_tokens = None if prompt is None else prompt + (tool_prompt or 0)
    output_tokens = (
        None if candidates is None and thoughts is None else (candidates or 0) + (thoughts or 0)
    )
    total = int_or_none(value.get("totalTokenCount"))
    if total is None and input_tokens is not None and output_tokens is not None:
        total = input_tokens + output_tokens
    return UsageDetails(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        total_tokens=total,
        reasoning_tokens=thoughts,
        cache_read_tokens=int_or_none(value.get("cachedContentTokenCount")),
    )


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A ``finishReason`` as the finish reason every client reports; one of no known
    meaning as it came."""
    if reason is None:
        return None
    known = FINISH_REASONS.get(reason)
    if known is FinishReason.STOP and called:
        return FinishReason.TOOL_CALLS
    return known or reason


def _blocked(feedback: Any, provider: str) -> ProviderError | None:
    """The error for a prompt the API refused to answer (``promptFeedback.blockReason``),
    or None: a filter's refusal, which no other route is asked."""
    reason = feedback.get("blockReason") if isinstance(feedback, Mapping) else None
    if reason is None:
        return None
    return provider_error(
        FailureKind.CONTENT_FILTERED,
        "the prompt was blocked",
        provider=provider,
        code=str_or_none(reason) or "blocked",
    )


def new_call_id() -> str:
    """An id for a function call the API gave none (ids tie results to their calls)."""
    return "call_" + uuid.uuid4().hex[:24]


class GeminiStreamReader:
    """Turns ``generateContent`` chunks into updates: each chunk's parts as they come (a
    function call arrives whole), and, once the stream ended after a ``finishReason``, one
    last update with the finish reason and the usage (the last ``usageMetadata``: each
    chunk repeats the counts so far), so usage is never counted twice."""

    __slots__ = ("_called", "_custom", "_finish", "_model_id", "_response_id", "_usage", "provider")

    def __init__(self, provider: str, custom_tools: frozenset[str] = frozenset()) -> None:
        self.provider = provider
        self._custom = custom_tools
        self._response_id: str | None = None
        self._model_id: str | None = None
        self._usage: Any = None
        self._finish: str | None = None
        self._called = False

    def feed(self, payload: Any) -> ChatResponseUpdate | None:
        if type(payload) is not dict:
            raise malformed(self.provider, "a chunk is not a JSON object")
        error = payload.get("error")
        if error is not None:
            raise error_from_payload(error, self.provider)
        response_id = payload.get("responseId")
        if type(response_id) is str:
            self._response_id = response_id
        model = payload.get("modelVersion")
        if type(model) is str:
            self._model_id = model
        usage = payload.get("usageMetadata")
        if usage is not None:
            self._usage = usage
        candidates = payload.get("candidates")
        if not candidates:
            blocked = _blocked(payload.get("promptFeedback"), self.provider)
            if blocked is not None:
                raise blocked
            if candidates is None or type(candidates) is list:
                return None
        if type(candidates) is not list or type(candidates[0]) is not dict:
            raise malformed(self.provider, "candidates is not a list of objects")
        candidate = candidates[0]
        reason = candidate.get("finishReason")
        if reason is not None:
            if type(reason) is not str:
                raise malformed(self.provider, "a finishReason is not a string")
            self._finish = reason
        content = candidate.get("content")
        if content is None:
            return None
        if type(content) is not dict:
            raise malformed(self.provider, "a candidate's content is not an object")
        parts = content.get("parts")
        if parts is None:
            return None
        if type(parts) is not list:
            raise malformed(self.provider, "a content's parts is not a list")
        contents = self._contents(parts)
        if not contents:
            return None
        return ChatResponseUpdate(_ASSISTANT, contents, self._response_id, self._model_id)

    def _contents(self, parts: list[Any]) -> list[Content]:
        if len(parts) == 1:
            # A streamed text chunk's usual shape: one text part and nothing else.
            only = parts[0]
            if type(only) is dict and len(only) == 1:
                text = only.get("text")
                if type(text) is str:
                    return [checked_text(text)] if text else []
        contents: list[Content] = []
        for part in parts:
            if type(part) is not dict:
                raise malformed(self.provider, "a part is not an object")
            signature = part.get("thoughtSignature")
            if signature is not None:
                if type(signature) is not str:
                    raise malformed(self.provider, "a thoughtSignature is not a string")
                # Kept where the API checks it: on a function call (or data); one on text
                # ends a streamed answer, where no API that shows reasoning first has a
                # place for it (see the module docstring).
                if signature and "text" not in part:
                    contents.append(ReasoningContent(protected=signature))
            text = part.get("text")
            if text is not None:
                if type(text) is not str:
                    raise malformed(self.provider, "a part's text is not a string")
                if text:
                    thought = part.get("thought") is True
                    contents.append(ReasoningContent(text) if thought else checked_text(text))
                continue
            call = part.get("functionCall")
            if call is not None:
                contents.append(self._call(call))
                continue
            data = part.get("inlineData")
            if data is not None:
                contents.append(self._data(data))
        return contents

    def _call(self, call: Any) -> FunctionCallContent:
        if type(call) is not dict:
            raise malformed(self.provider, "a functionCall is not an object")
        name = call.get("name")
        if type(name) is not str or not name:
            raise malformed(self.provider, "a functionCall has no name")
        args = call.get("args")
        if args is None:
            args = {}
        elif type(args) is not dict:
            raise malformed(self.provider, "a functionCall's args is not an object")
        call_id = call.get("id")
        if type(call_id) is not str or not call_id:
            call_id = new_call_id()
        self._called = True
        text = args.get(CUSTOM_TOOL_INPUT)
        if name in self._custom and type(text) is str and len(args) == 1:
            # A custom tool, offered as a function of its input text.
            return FunctionCallContent.custom_call(call_id, name, text)
        return FunctionCallContent(call_id, name, args)

    def _data(self, data: Any) -> DataContent:
        encoded = data.get("data") if type(data) is dict else None
        media_type = data.get("mimeType") if type(data) is dict else None
        if type(encoded) is not str or type(media_type) is not str:
            raise malformed(self.provider, "inlineData without base64 data and a mimeType")
        try:
            decoded = base64.b64decode(encoded, validate=True)
        except ValueError:
            raise malformed(self.provider, "inlineData that is not base64") from None
        return DataContent(data=decoded, media_type=media_type)

    def last(self) -> ChatResponseUpdate | None:
        """The finish reason and the usage, once the answer is complete."""
        usage = parse_usage(self._usage)
        finish = _finish_reason(self._finish, self._called)
        if usage is None and finish is None:
            return None
        return ChatResponseUpdate(_ASSISTANT, [], self._response_id, self._model_id, finish, usage)

    def finish(self) -> ChatResponseUpdate | None:
        if self._finish is None:
            # The stream has no end event: a chunk with a finishReason is its last.
            raise provider_error(
                FailureKind.TRANSIENT,
                "the stream ended before a finishReason",
                provider=self.provider,
                code="incomplete_stream",
            )
        return self.last()


def parse_response(
    payload: Any, provider: str, custom_tools: frozenset[str] = frozenset()
) -> ChatResponse:
    """A ``generateContent`` answer: read as the one chunk of a stream, so both call shapes
    give the same response."""
    if type(payload) is not dict:
        raise malformed(provider, "the body is not a JSON object")
    reader = GeminiStreamReader(provider, custom_tools)
    first = reader.feed(payload)
    if not payload.get("candidates"):
        raise malformed(provider, "the answer has no candidates")
    response = ChatResponse.from_updates([u for u in (first, reader.last()) if u is not None])
    if not response.messages:
        response.messages.append(ChatMessage(_ASSISTANT, []))  # an answer with no parts
    return response


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True
