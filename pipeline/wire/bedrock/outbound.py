"""Bedrock Converse outbound: a core request as a Converse body; a Converse answer, or the
events of a ConverseStream, as core types; an error as the `ProviderError` of its kind. Pure
functions (the framing and the signature are the provider's); what does not fit is a
`ProviderError` that never quotes the payload. Every content type is matched (mypy checks);
unknown blocks and events are skipped. Reasoning and its signatures: docs/providers.md."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.errors import FailureKind, ProviderError, kind_for_status, provider_error
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
    FunctionTool,
    RawTool,
    ReasoningContent,
    TextContent,
    ToolChoice,
    UsageDetails,
    as_tool_choice,
    checked_text,
    unknown_content,
)
from pipeline.wire._common import (
    cache_counted_apart,
    malformed,
    parse_arguments,
    str_or_none,
    tool_result_text,
)
from pipeline.wire.bedrock.vocab import (
    ANTHROPIC_EFFORT,
    API,
    BEDROCK_EXTRAS,
    CACHE_POINT,
    CONTEXT_MESSAGES,
    DOCUMENT_FORMATS,
    ERROR_KINDS,
    GEO_PREFIXES,
    IMAGE_FORMATS,
    MAX_CACHE_POINTS,
    NOVA_EFFORT,
    OPENAI_EFFORT,
    finish_reason,
    tool_choice,
)
from pipeline.wire.messages.vocab import API as MESSAGES
from pipeline.wire.tools import as_tool, function_definition, raw_body

__all__ = [
    "ConverseStreamReader",
    "build_request",
    "error_for",
    "model_family",
    "parse_response",
    "parse_usage",
]

_ASSISTANT = ChatRole.ASSISTANT

# -- requests ---------------------------------------------------------------------------------


def model_family(model: str) -> str:
    """The family of a model id, an inference profile's or an ARN's (``anthropic``,
    ``amazon.nova``, ``openai``, ``meta``...): what decides where reasoning goes."""
    name = model.rsplit("/", 1)[-1]  # an ARN: its resource id
    for prefix in GEO_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    vendor, _, rest = name.partition(".")
    if vendor == "amazon" and rest.startswith("nova"):
        return "amazon.nova"
    return vendor


def _bytes_of(content: DataContent) -> tuple[str | None, str]:
    """The media type and the base64 bytes of inline data (a data URL's too)."""
    if content.uri is not None:
        header, comma, payload = content.uri[5:].partition(",")
        if not comma or not header.endswith(";base64"):
            raise ValueError("DataContent: only base64 data URLs can be sent to Bedrock")
        return content.media_type or header.removesuffix(";base64") or None, payload
    return content.media_type, base64.b64encode(content.data or b"").decode("ascii")


def _data_block(content: DataContent, documents: list[int]) -> dict[str, Any]:
    uri = content.uri
    source: dict[str, Any]
    if uri is not None and uri.startswith("s3://"):
        media_type, source = content.media_type, {"s3Location": {"uri": uri}}
    elif uri is not None and not uri.startswith("data:"):
        raise ValueError("DataContent sent to Bedrock must be inline data or an s3:// URI")
    else:
        media_type, encoded = _bytes_of(content)
        source = {"bytes": encoded}
    if media_type is not None and media_type in IMAGE_FORMATS:
        return {"image": {"format": IMAGE_FORMATS[media_type], "source": source}}
    if media_type is not None and media_type in DOCUMENT_FORMATS:
        documents.append(len(documents) + 1)
        document = {
            "format": DOCUMENT_FORMATS[media_type],
            "name": f"document-{documents[-1]}",  # required, unique per request
            "source": source,
        }
        return {"document": document}
    raise ValueError(f"DataContent of type {media_type!r} cannot be sent to Bedrock")


def _reasoning_block(content: ReasoningContent) -> dict[str, Any] | None:
    """A reasoning block as Converse takes it back, or None when it cannot go (no
    signature, or another API's reasoning item)."""
    if not content.protected or content.id is not None:
        return None
    if content.redacted:
        return {"reasoningContent": {"redactedContent": content.protected}}
    text = {"text": content.text, "signature": content.protected}
    return {"reasoningContent": {"reasoningText": text}}


def _blocks(message: ChatMessage, documents: list[int]) -> list[dict[str, Any]]:
    """A message's contents as content blocks (empty texts left out: the API refuses them)."""
    blocks: list[dict[str, Any]] = []
    for content in message.contents:
        match content:
            case TextContent(text=text):
                if text:
                    blocks.append({"text": text})
            case DataContent():
                blocks.append(_data_block(content, documents))
            case FunctionCallContent(call_id=call_id, name=name, arguments=arguments):
                use = {"toolUseId": call_id, "name": name, "input": dict(arguments)}
                blocks.append({"toolUse": use})
            case FunctionResultContent(call_id=call_id):
                result: dict[str, Any] = {
                    "toolUseId": call_id,
                    "content": [{"text": tool_result_text(content) or " "}],
                }
                if content.exception is not None:
                    result["status"] = "error"
                blocks.append({"toolResult": result})
            case ReasoningContent():
                reasoning = _reasoning_block(content)
                if reasoning is not None:
                    blocks.append(reasoning)
            case _:
                unknown_content(content)
    return blocks


def _cache_point(value: Any) -> dict[str, Any] | None:
    """A prompt-cache breakpoint (an Anthropic ``cache_control``) as a ``cachePoint``."""
    if not isinstance(value, Mapping):
        return None
    point: dict[str, Any] = {"type": "default"}
    ttl = value.get("ttl")
    if ttl in ("5m", "1h"):
        point["ttl"] = ttl
    return {CACHE_POINT: point}


def _breakpoint_of(extra: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return _cache_point(extra.get("cache_control")) if extra else None


def _conversation(
    messages: Sequence[ChatMessage],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]], bool]:
    """System blocks, the turns (tool results go back in user turns; adjacent turns of a
    role merged, since the API alternates them), the cache points in both, and whether the
    conversation holds tool blocks. Every system message, wherever it is, is folded into
    ``system`` in order; a message's ``cache_control`` is a cache point after its blocks."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    documents: list[int] = []
    uses_tools = False
    for message in messages:
        point = _breakpoint_of(message.additional_properties)
        if message.role is ChatRole.SYSTEM:
            texts = [
                {"text": c.text} for c in message.contents if type(c) is TextContent and c.text
            ]
            system += texts
            if texts and point is not None:
                system.append(point)
                points.append(point)
            continue
        blocks = _blocks(message, documents)
        if not blocks:
            continue
        uses_tools = uses_tools or any("toolUse" in b or "toolResult" in b for b in blocks)
        if point is not None:
            blocks.append(point)
            points.append(point)
        role = "assistant" if message.role is ChatRole.ASSISTANT else "user"
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns, points, uses_tools


def _tool(tool: ChatTool) -> list[dict[str, Any]]:
    """A tool as ``toolConfig.tools`` entries: its ``toolSpec`` (with the tool's Converse
    fields), and a cache point after it when it carries a prompt-cache breakpoint (the
    Messages API's ``cache_control``, which Converse takes as a ``cachePoint``); a raw tool
    of this API as it is."""
    match as_tool(tool, API):
        case RawTool() as raw:
            return [raw_body(raw, API)]
        case definition:
            described = function_definition(definition, API, "inputSchema")
            described["inputSchema"] = {"json": described["inputSchema"]}
            entries: list[dict[str, Any]] = [{"toolSpec": described}]
            if type(definition) is FunctionTool:
                point = _breakpoint_of(definition.additional_properties.get(MESSAGES))
                if point is not None:
                    entries.append(point)
            return entries


def _tool_config(
    options: ChatOptions, uses_tools: bool, points: list[dict[str, Any]]
) -> dict[str, Any] | None:
    if not options.tools:
        return None
    choice = as_tool_choice(options.tool_mode, options.tools)
    if choice == ToolChoice.NONE and not uses_tools:
        return None  # no tool may be called, and none was: the tools would change nothing
    tools = [entry for tool in options.tools for entry in _tool(tool)]
    points[:0] = [entry for entry in tools if CACHE_POINT in entry]  # the tools come first
    config: dict[str, Any] = {"tools": tools}
    member = None if choice is None else tool_choice(choice)
    if member is not None:
        config["toolChoice"] = member
    return config


def _drop_earliest_cache_points(body: dict[str, Any], points: list[dict[str, Any]]) -> None:
    """Beyond `MAX_CACHE_POINTS`, the earliest are left out (a later one caches a longer
    prefix, the earlier ones included)."""
    extra = {id(point) for point in points[: max(0, len(points) - MAX_CACHE_POINTS)]}
    if not extra:
        return
    config = body.get("toolConfig")
    blocks: list[list[dict[str, Any]]] = [body.get("system", [])]
    blocks += [turn["content"] for turn in body["messages"]]
    if config is not None:
        blocks.append(config["tools"])
    for list_ in blocks:
        list_[:] = [block for block in list_ if id(block) not in extra]


def _effort(options: ChatOptions) -> tuple[str | None, int | None]:
    reasoning = options.reasoning
    effort = (reasoning.effort if reasoning is not None else None) or options.reasoning_effort
    return effort, reasoning.budget_tokens if reasoning is not None else None


def _reasoning(options: ChatOptions, family: str) -> tuple[dict[str, Any], str | None]:
    """The model fields (``additionalModelRequestFields``) and the ``outputConfig.effort``
    of the options' reasoning, for the model's family:

    * Anthropic's models: a budget is ``thinking`` ``enabled`` with it (0: ``disabled``); an
      effort alone is ``adaptive`` thinking at that ``outputConfig.effort``; ``none`` is
      ``disabled`` (as the Messages provider maps them);
    * Amazon Nova: an effort is ``reasoningConfig`` at that ``maxReasoningEffort``; ``none``
      or a budget of 0 ``disabled`` (a budget has no Nova field);
    * OpenAI's open-weight models: ``reasoning_effort``;
    * any other family has no reasoning field: the options are dropped.
    """
    effort, budget = _effort(options)
    if effort is None and budget is None:
        return {}, None
    off = effort == "none" or budget == 0
    if family == "anthropic":
        if effort == "none":
            return {"thinking": {"type": "disabled"}}, None
        mapped = ANTHROPIC_EFFORT.get(effort, effort) if effort is not None else None
        if budget == 0:
            return {"thinking": {"type": "disabled"}}, mapped
        if budget is not None:
            return {"thinking": {"type": "enabled", "budget_tokens": budget}}, mapped
        return {"thinking": {"type": "adaptive"}}, mapped
    if family == "amazon.nova":
        if off:
            return {"reasoningConfig": {"type": "disabled"}}, None
        if effort is None:
            return {}, None
        level = NOVA_EFFORT.get(effort, effort)
        return {"reasoningConfig": {"type": "enabled", "maxReasoningEffort": level}}, None
    if family == "openai" and effort is not None and effort != "none":
        return {"reasoning_effort": OPENAI_EFFORT.get(effort, effort)}, None
    return {}, None


def _text_format(value: Any) -> dict[str, Any] | None:
    """`ChatOptions.response_format` as ``outputConfig.textFormat``: a JSON schema (the API
    has no JSON mode without one: other formats are left out)."""
    if not isinstance(value, Mapping):
        return None
    name: Any = None
    if value.get("type") == "json_schema" and not isinstance(value.get("schema"), Mapping):
        value = value.get("json_schema")  # Chat Completions' shape
        if not isinstance(value, Mapping):
            return None
    schema = value.get("schema")
    if not isinstance(schema, Mapping):
        return None
    name = value.get("name")
    definition: dict[str, Any] = {"schema": json.dumps(schema)}
    if isinstance(name, str) and name:
        definition["name"] = name
    description = value.get("description")
    if isinstance(description, str) and description:
        definition["description"] = description
    return {"type": "json_schema", "structure": {"jsonSchema": definition}}


# The request's own fields: the scoped extras never replace them.
_OWN_FIELDS = frozenset({"messages", "system", "modelId"})


def _merge_extras(body: dict[str, Any], extras: Mapping[str, Any]) -> None:
    """The caller's own Converse fields (`BEDROCK_EXTRAS`), as given: an object field is
    merged key by key into what the options made."""
    for key, value in extras.items():
        if key in _OWN_FIELDS:
            continue
        current = body.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            body[key] = {**current, **value}
        else:
            body[key] = value


def build_request(
    messages: Sequence[ChatMessage],
    options: ChatOptions | None,
    *,
    model: str,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """The JSON body of a Converse (or ConverseStream) request for `model` (which goes in the
    URL, not the body).

    `max_output_tokens` (else `max_tokens`), `temperature`, `top_p` and `stop` are
    ``inferenceConfig``; `seed` has no field and is not sent; a JSON-schema
    `response_format` is ``outputConfig.textFormat``; reasoning goes where the model's
    family takes it (`_reasoning`). The dict under `BEDROCK_EXTRAS` in
    `additional_properties` is the caller's own Converse fields; the other
    `additional_properties` (another API's sampling fields) have no Converse field and are
    left out, since the API refuses fields it does not know.
    """
    system, turns, points, uses_tools = _conversation(messages)
    if not turns:
        raise ValueError("Bedrock needs at least one user or assistant message with content")
    body: dict[str, Any] = {"messages": turns}
    if system:
        body["system"] = system
    inference: dict[str, Any] = {}
    limit = options.max_output_tokens if options is not None else None
    limit = limit if limit is not None else max_tokens
    if limit is not None:
        inference["maxTokens"] = limit
    if options is None:
        if inference:
            body["inferenceConfig"] = inference
        _drop_earliest_cache_points(body, points)
        return body
    if options.temperature is not None:
        inference["temperature"] = options.temperature
    if options.top_p is not None:
        inference["topP"] = options.top_p
    if options.stop:
        inference["stopSequences"] = list(options.stop)
    if inference:
        body["inferenceConfig"] = inference
    config = _tool_config(options, uses_tools, points)
    if config is not None:
        body["toolConfig"] = config
    fields, effort = _reasoning(options, model_family(model))
    if fields:
        body["additionalModelRequestFields"] = fields
    output: dict[str, Any] = {}
    if effort is not None:
        output["effort"] = effort
    text_format = _text_format(options.response_format)
    if text_format is not None:
        output["textFormat"] = text_format
    if output:
        body["outputConfig"] = output
    scoped = options.additional_properties.get(BEDROCK_EXTRAS)
    if isinstance(scoped, Mapping):
        _merge_extras(body, scoped)
    _drop_earliest_cache_points(body, points)
    return body


# -- answers ----------------------------------------------------------------------------------


def parse_usage(value: Any) -> UsageDetails | None:
    """``usage``: input tokens include those read from and written to the prompt cache
    (which Converse counts apart, as the Messages API does), also told apart."""
    if not isinstance(value, Mapping):
        return None
    return cache_counted_apart(
        value.get("inputTokens"),
        value.get("cacheReadInputTokens"),
        value.get("cacheWriteInputTokens"),
        value.get("outputTokens"),
    )


def _call(
    call_id: Any, name: Any, arguments: Any, custom: frozenset[str], provider: str
) -> FunctionCallContent:
    """A tool call; one of a custom tool (offered as a function of ``input``) as a custom
    call, when its arguments are that one string."""
    if not isinstance(name, str) or not name:
        raise malformed(provider, "a toolUse block has no name")
    decoded = parse_arguments(arguments, provider)
    call_id = str_or_none(call_id) or ""
    text = decoded.get(CUSTOM_TOOL_INPUT)
    if name in custom and isinstance(text, str) and len(decoded) == 1:
        return FunctionCallContent.custom_call(call_id, name, text)
    return FunctionCallContent(call_id=call_id, name=name, arguments=decoded)


def _reasoning_content(block: Any, provider: str) -> ReasoningContent:
    if not isinstance(block, Mapping):
        raise malformed(provider, "a reasoningContent block is not an object")
    redacted = block.get("redactedContent")
    if redacted is not None:
        if not isinstance(redacted, str):
            raise malformed(provider, "reasoning's redactedContent is not base64 text")
        return ReasoningContent(protected=redacted, redacted=True)
    text_block = block.get("reasoningText")
    text = text_block.get("text", "") if isinstance(text_block, Mapping) else None
    signature = text_block.get("signature") if isinstance(text_block, Mapping) else None
    if not isinstance(text, str) or not isinstance(signature, str | None):
        raise malformed(provider, "a reasoningText's text or signature is not a string")
    return ReasoningContent(text, protected=signature or None)


def parse_response(
    payload: Any, provider: str, model: str | None, custom_tools: frozenset[str] = frozenset()
) -> ChatResponse:
    """A Converse answer (Converse names no model: the response reports the one asked
    for; `custom_tools`: the names of the request's custom tools)."""
    if not isinstance(payload, Mapping):
        raise malformed(provider, "the body is not a JSON object")
    output = payload.get("output")
    message = output.get("message") if isinstance(output, Mapping) else None
    blocks = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(blocks, list):
        raise malformed(provider, "the answer has no output.message.content list")
    contents: list[Content] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            raise malformed(provider, "a content block is not an object")
        if "text" in block:
            text = block["text"]
            if not isinstance(text, str):
                raise malformed(provider, "a text block's text is not a string")
            last = contents[-1] if contents else None
            if type(last) is TextContent:
                contents[-1] = TextContent(last.text + text)  # as a stream assembles it
            elif text:
                contents.append(TextContent(text))
        elif "toolUse" in block:
            use = block["toolUse"]
            if not isinstance(use, Mapping):
                raise malformed(provider, "a toolUse block is not an object")
            contents.append(
                _call(
                    use.get("toolUseId"), use.get("name"), use.get("input"), custom_tools, provider
                )
            )
        elif "reasoningContent" in block:
            contents.append(_reasoning_content(block["reasoningContent"], provider))
    return ChatResponse(
        messages=[ChatMessage(ChatRole.ASSISTANT, contents)],
        model_id=model,
        finish_reason=finish_reason(payload.get("stopReason")),
        usage=parse_usage(payload.get("usage")),
    )


# -- errors -----------------------------------------------------------------------------------


def error_for(
    error_type: str | None,
    message: Any,
    provider: str,
    *,
    status_code: int | None = None,
    url: str | None = None,
) -> ProviderError:
    """The `ProviderError` of a Converse error: its type (``x-amzn-ErrorType``, or a
    stream's exception: `ERROR_KINDS`), else its HTTP status. The message is only looked at
    to tell a prompt that does not fit (`CONTEXT_MESSAGES`), and never copied."""
    kind = ERROR_KINDS.get(error_type or "")
    if kind is None:
        kind = kind_for_status(status_code) if status_code is not None else FailureKind.UNKNOWN
    if (
        kind is FailureKind.REQUEST_INVALID
        and isinstance(message, str)
        and message[:64].lower().startswith(CONTEXT_MESSAGES)
    ):
        kind = FailureKind.CONTEXT_LENGTH_EXCEEDED
    return provider_error(
        kind, provider=provider, status_code=status_code, code=error_type, url=url
    )


# -- streams ----------------------------------------------------------------------------------


class _Block:
    __slots__ = ("call_id", "kind", "name", "parts", "signature")

    def __init__(self, kind: str, call_id: Any = None, name: Any = None) -> None:
        self.kind = kind
        self.call_id = call_id
        self.name = name
        self.parts: list[str] = []
        self.signature: str | None = None


class ConverseStreamReader:
    """Turns ConverseStream events, ``(event type, payload)``, into updates: text and
    reasoning deltas as they come, a tool call whole when its block stops (a reasoning
    block's signature too), and once the stream is complete one last update with the
    finish reason (``messageStop``) and the usage (``metadata``)."""

    def __init__(
        self, provider: str, model: str | None, custom_tools: frozenset[str] = frozenset()
    ) -> None:
        self.provider = provider
        self.model = model
        self.custom_tools = custom_tools
        self._blocks: dict[int, _Block] = {}
        self._finish_reason: str | None = None
        self._usage: UsageDetails | None = None

    def _update(self, contents: list[Content]) -> ChatResponseUpdate:
        # Positional: this runs for every event.
        return ChatResponseUpdate(_ASSISTANT, contents, None, self.model)

    def _index(self, payload: Mapping[str, Any]) -> int:
        index = payload.get("contentBlockIndex")
        if type(index) is not int:
            raise malformed(self.provider, "a content block event has no integer index")
        return index

    def feed(self, payload: Any) -> ChatResponseUpdate | None:
        event, body = payload
        if type(body) is not dict:
            raise malformed(self.provider, f"a {event} event is not a JSON object")
        if event == "contentBlockDelta":
            return self._delta(self._index(body), body.get("delta"))
        if event == "contentBlockStart":
            index = self._index(body)
            start = body.get("start")
            use = start.get("toolUse") if type(start) is dict else None
            if type(use) is dict:
                self._blocks[index] = _Block("toolUse", use.get("toolUseId"), use.get("name"))
            else:
                self._blocks[index] = _Block("other")
            return None
        if event == "contentBlockStop":
            block = self._blocks.pop(self._index(body), None)
            if block is None:
                return None  # a text block: nothing pending
            if block.kind == "toolUse":
                raw = "".join(block.parts)
                call = _call(block.call_id, block.name, raw, self.custom_tools, self.provider)
                return self._update([call])
            if block.kind == "reasoning" and block.signature:
                # The signature ends the block: `ChatResponse.from_updates` joins the
                # reasoning pieces before it into one block.
                return self._update([ReasoningContent(protected=block.signature)])
            return None
        if event == "messageStop":
            self._finish_reason = finish_reason(body.get("stopReason"))
            return None
        if event == "metadata":
            self._usage = parse_usage(body.get("usage"))
            return None
        return None  # messageStart, and events added after this was written

    def _delta(self, index: int, delta: Any) -> ChatResponseUpdate | None:
        if type(delta) is not dict:
            raise malformed(self.provider, "a contentBlockDelta without a delta object")
        text = delta.get("text")
        if text is not None:
            if type(text) is not str:
                raise malformed(self.provider, "a text delta that is not text")
            return self._update([checked_text(text)]) if text else None
        block = self._blocks.get(index)
        use = delta.get("toolUse")
        if use is not None:
            part = use.get("input") if type(use) is dict else None
            if block is None or block.kind != "toolUse" or type(part) is not str:
                raise malformed(self.provider, "a toolUse delta outside a toolUse block")
            block.parts.append(part)
            return None
        reasoning = delta.get("reasoningContent")
        if reasoning is not None:
            if type(reasoning) is not dict:
                raise malformed(self.provider, "a reasoningContent delta is not an object")
            if block is None:
                block = self._blocks[index] = _Block("reasoning")
            elif block.kind != "reasoning":
                raise malformed(self.provider, "a reasoning delta inside another block")
            return self._reasoning_delta(block, reasoning)
        return None  # citations, images, tool results: not for the caller

    def _reasoning_delta(self, block: _Block, delta: dict[str, Any]) -> ChatResponseUpdate | None:
        if "redactedContent" in delta:
            data = delta["redactedContent"]
            if type(data) is not str:
                raise malformed(self.provider, "reasoning's redactedContent is not base64 text")
            return self._update([ReasoningContent(protected=data, redacted=True)])
        if "signature" in delta:
            signature = delta["signature"]
            if type(signature) is not str:
                raise malformed(self.provider, "a reasoning signature is not a string")
            block.signature = (block.signature or "") + signature
            return None
        text = delta.get("text")
        if text is None:
            return None
        if type(text) is not str:
            raise malformed(self.provider, "a reasoning delta's text is not a string")
        return self._update([ReasoningContent(text)]) if text else None

    def finish(self) -> ChatResponseUpdate | None:
        if any(block.kind == "toolUse" for block in self._blocks.values()):
            raise malformed(self.provider, "the stream ended inside a toolUse block")
        if self._usage is None and self._finish_reason is None:
            return None
        return ChatResponseUpdate(
            _ASSISTANT, [], None, self.model, self._finish_reason, self._usage
        )
