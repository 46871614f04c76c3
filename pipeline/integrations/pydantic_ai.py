"""A Pydantic AI ``Model`` over a pipeline: ``Agent(PipelineModel(chat))``.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import anyio
from pydantic_ai.exceptions import (
    ModelAPIError,
    ModelAuthenticationError,
    ModelConnectionError,
    ModelContextWindowExceededError,
    ModelHTTPError,
    ModelNotFoundError,
    ModelRateLimitError,
    ModelRequestRejectedError,
    ModelServerError,
    ModelTimeoutError,
    ModelUnavailableError,
    UnexpectedModelBehavior,
    UserError,
)
from pydantic_ai.messages import (
    BinaryContent,
    CachePoint,
    FileUrl,
    FinishReason,
    InstructionPart,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ModelResponsePart,
    ModelResponseStreamEvent,
    RetryPromptPart,
    SystemPromptPart,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.messages import TextContent as PydanticTextContent
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models._tool_choice import resolve_tool_choice
from pydantic_ai.profiles import ModelProfileSpec
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.usage import RequestUsage

from pipeline import _scope
from pipeline.client import metadata_of
from pipeline.errors import FailureKind, ProviderError, RoutingError, classify
from pipeline.integrations._common import (
    AgentTool,
    ServedRoute,
    append_message,
    check_agent_pipeline,
    ensure_no_tool_results,
    ensure_not_tool_results,
    route_report,
    served_route,
)
from pipeline.types import (
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
    TextContent,
    ToolChoice,
    UsageDetails,
)

__all__ = ["PipelineModel", "PipelineStreamedResponse"]

_ADAPTER = "PipelineModel"
_SYSTEM = "chat-pipeline"

# The pipeline's finish reasons are the Chat Completions ones (every provider maps to them).
_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_call",
    "function_call": "tool_call",
    "content_filter": "content_filter",
}


class PipelineModel(Model):
    """A Pydantic AI model that sends every request through `chat` (a `ChatPipeline` or
    any `ChatClient`); see the module docstring for what it promises.

    `model_name` defaults to the pipeline's name (``build(name=...)``), else its model id,
    else ``"pipeline"``. `settings` and `profile` are Pydantic AI's: the default profile
    produces structured output through an output tool, which every provider of the pipeline
    supports; a profile with ``supports_json_schema_output=True`` lets ``NativeOutput`` send a
    JSON-schema response format (OpenAI-compatible routes honour it).
    """

    # Settings the pipeline has no field for: Pydantic AI warns about the ones that change
    # what a request guarantees (timeout, max_retries, extra_headers, parallel_tool_calls)
    # and ignores the tuning knobs. Deadlines and retries are the pipeline's own layers.
    unsupported_settings = frozenset(
        {
            "top_k",
            "timeout",
            "max_retries",
            "parallel_tool_calls",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "extra_headers",
            "service_tier",
        }
    )

    def __init__(
        self,
        chat: Any,
        *,
        model_name: str | None = None,
        settings: ModelSettings | None = None,
        profile: ModelProfileSpec | None = None,
    ) -> None:
        super().__init__(settings=settings, profile=profile)
        self.chat = check_agent_pipeline(chat, _ADAPTER)
        if model_name is not None and (not isinstance(model_name, str) or not model_name):
            raise ValueError("PipelineModel: model_name must be a non-empty string or None")
        metadata = metadata_of(self.chat)
        self._model_name = model_name or metadata.name or metadata.model_id or "pipeline"

    @property
    def model_name(self) -> str:
        """The pipeline's name (or the name given)."""
        return self._model_name

    @property
    def system(self) -> str:
        """``"chat-pipeline"``: the served route's provider is on each response."""
        return _SYSTEM

    @property
    def provider(self) -> None:
        return None

    @property
    def base_url(self) -> str | None:
        return None

    # -- requests ------------------------------------------------------------------------

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        model_settings, model_request_parameters = self.prepare_request(
            model_settings, model_request_parameters
        )
        conversation = self._conversation(messages, model_request_parameters)
        options = self._options(model_settings, model_request_parameters)
        report, token = route_report()
        try:
            response = await self.chat.get_response(conversation, options)
        except Exception as exc:
            mapped = _model_error(exc, self._error_model(report), in_stream=False)
            if mapped is None:
                raise
            raise mapped from exc
        finally:
            _scope.exit_report(token)
        ensure_no_tool_results(response.messages, _ADAPTER)
        return self._model_response(response, served_route(report))

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: Any = None,
    ) -> AsyncGenerator[StreamedResponse, None]:
        model_settings, model_request_parameters = self.prepare_request(
            model_settings, model_request_parameters
        )
        conversation = self._conversation(messages, model_request_parameters)
        options = self._options(model_settings, model_request_parameters)
        streamed = PipelineStreamedResponse(
            model_request_parameters=model_request_parameters,
            _model=self,
            _stream=self.chat.get_streaming_response(conversation, options),
        )
        try:
            # Read the first update here: a pipeline that fails before output raises before
            # the agent holds a stream, which is where FallbackModel can still fall back.
            await streamed._open()
            yield streamed
        finally:
            # Closing releases every layer beneath; it must run even inside a cancelled
            # scope (a Pydantic AI timeout), so it is shielded.
            with anyio.CancelScope(shield=True):
                await streamed.close_stream()

    def _error_model(self, report: _scope.RouteReport) -> str:
        """The model an error names: the route's that failed last, else this model's."""
        return served_route(report).model_id or self._model_name

    # -- requests out ----------------------------------------------------------------------

    def _conversation(
        self, messages: Sequence[ModelMessage], parameters: ModelRequestParameters
    ) -> list[ChatMessage]:
        conversation: list[ChatMessage] = []
        for message in messages:
            if isinstance(message, ModelRequest):
                _request_messages(message, conversation)
            elif isinstance(message, ModelResponse):
                turn = _response_contents(message.parts)
                if turn:
                    conversation.append(ChatMessage(ChatRole.ASSISTANT, turn))
            else:  # pragma: no cover - ModelMessage has two members
                raise UserError(f"{_ADAPTER}: unknown message type {type(message).__name__}")
        instructions = InstructionPart.join(self._get_instruction_parts(messages, parameters) or [])
        if instructions:
            # After the leading system prompts, as the providers' own adapters place them.
            leading = 0
            while leading < len(conversation) and conversation[leading].role is ChatRole.SYSTEM:
                leading += 1
            conversation.insert(leading, ChatMessage(ChatRole.SYSTEM, instructions))
        if not conversation:
            raise UserError(f"{_ADAPTER}: the request has no messages to send")
        return conversation

    def _options(
        self, settings: ModelSettings | None, parameters: ModelRequestParameters
    ) -> ChatOptions:
        settings = settings or {}
        options = ChatOptions(
            max_output_tokens=settings.get("max_tokens"),
            temperature=settings.get("temperature"),
            top_p=settings.get("top_p"),
            seed=settings.get("seed"),
        )
        stop = settings.get("stop_sequences")
        if stop:
            options.stop = list(stop)
        extra = settings.get("extra_body")
        if isinstance(extra, dict):
            options.additional_properties = dict(extra)
        definitions = list(parameters.declared_tool_defs.values())
        if definitions:
            options.tools, options.tool_mode = _tools(settings, parameters, definitions)
        if parameters.output_mode == "native" and parameters.output_object is not None:
            schema: dict[str, Any] = {
                "name": parameters.output_object.name or "final_result",
                "schema": parameters.output_object.json_schema,
            }
            if parameters.output_object.description:
                schema["description"] = parameters.output_object.description
            if parameters.output_object.strict is not None:
                schema["strict"] = parameters.output_object.strict
            options.response_format = {"type": "json_schema", "json_schema": schema}
        elif parameters.output_mode == "prompted" and self.profile.get(
            "supports_json_object_output", False
        ):
            options.response_format = "json_object"
        return options

    # -- responses in ----------------------------------------------------------------------

    def _model_response(self, response: ChatResponse, served: ServedRoute) -> ModelResponse:
        parts: list[ModelResponsePart] = []
        for message in response.messages:
            for content in message.contents:
                part = _response_part(content)
                if part is not None:
                    parts.append(part)
        return ModelResponse(
            parts=parts,
            usage=_usage(response.usage),
            model_name=response.model_id or served.model_id or self._model_name,
            provider_name=served.provider_name or metadata_of(self.chat).provider_name,
            provider_details=served.as_metadata() or None,
            provider_response_id=response.response_id,
            finish_reason=_finish_reason(response.finish_reason),
        )


@dataclass
class PipelineStreamedResponse(StreamedResponse):
    """The agent's view of one streamed pipeline request: text deltas and whole tool calls
    as Pydantic AI events, usage as it arrives, the served model and route at the end."""

    _model: PipelineModel
    _stream: AsyncGenerator[ChatResponseUpdate, None]
    _timestamp: datetime = field(default_factory=lambda: datetime.now(UTC))
    _served_model: str | None = field(default=None, init=False)
    _first: ChatResponseUpdate | None = field(default=None, init=False)
    _report: _scope.RouteReport = field(default_factory=_scope.RouteReport, init=False)
    _output_seen: bool = field(default=False, init=False)
    _closed: bool = field(default=False, init=False)
    # Usage that never arrives makes the request unmeasured (Pydantic AI's convention).
    _usage_received: bool | None = field(default=False, init=False)

    async def _open(self) -> None:
        """Read the first update (the routers below take this request's report then)."""
        report, token = route_report()
        self._report = report
        try:
            self._first = await self._next()
        finally:
            _scope.exit_report(token)

    async def _next(self) -> ChatResponseUpdate | None:
        try:
            update = await self._stream.__anext__()
        except StopAsyncIteration:
            return None
        except Exception as exc:
            mapped = _model_error(
                exc, self._model._error_model(self._report), in_stream=self._output_seen
            )
            if mapped is None:
                raise
            raise mapped from exc
        ensure_not_tool_results(update.role, _ADAPTER)
        self._output_seen = True
        return update

    async def _get_event_iterator(self) -> AsyncIterator[ModelResponseStreamEvent]:
        update, self._first = self._first, None
        while update is not None:
            for event in self._events(update):
                yield event
            update = await self._next()
        served = served_route(self._report)
        self.provider_details = served.as_metadata() or None
        self._served_model = self._served_model or served.model_id

    def _events(self, update: ChatResponseUpdate) -> Iterator[ModelResponseStreamEvent]:
        if update.model_id:
            self._served_model = update.model_id
        if update.response_id:
            self.provider_response_id = update.response_id
        if update.finish_reason:
            self.finish_reason = _finish_reason(update.finish_reason)
        if update.usage is not None:
            self._add_usage(_usage(update.usage), reported=True)
        for content in update.contents:
            if type(content) is TextContent:
                if content.text:
                    yield from self._parts_manager.handle_text_delta(
                        vendor_part_id="content", content=content.text
                    )
            elif isinstance(content, FunctionCallContent):
                # The pipeline streams each tool call whole, once its arguments are complete.
                yield self._parts_manager.handle_tool_call_part(
                    vendor_part_id=content.call_id,
                    tool_name=content.name,
                    args=dict(content.arguments),
                    tool_call_id=content.call_id,
                )
            else:
                raise UnexpectedModelBehavior(
                    f"{_ADAPTER}: the pipeline streamed {type(content).__name__}, which a "
                    "model response cannot carry"
                )

    async def close_stream(self) -> None:
        if not self._closed:
            self._closed = True
            await self._stream.aclose()

    @property
    def model_name(self) -> str:
        return self._served_model or self._model.model_name

    @property
    def provider_name(self) -> str | None:
        served = served_route(self._report)
        return served.provider_name or metadata_of(self._model.chat).provider_name

    @property
    def provider_url(self) -> None:
        return None

    @property
    def timestamp(self) -> datetime:
        return self._timestamp


# -- mapping ---------------------------------------------------------------------------------


def _user_contents(content: str | Sequence[Any]) -> list[Content]:
    if isinstance(content, str):
        return [TextContent(content)]
    contents: list[Content] = []
    for item in content:
        if isinstance(item, str):
            contents.append(TextContent(item))
        elif isinstance(item, PydanticTextContent):  # StructuredContent too: its text
            contents.append(TextContent(item.content))
        elif isinstance(item, BinaryContent):
            contents.append(DataContent(data=item.data, media_type=item.media_type))
        elif isinstance(item, FileUrl):
            contents.append(DataContent(uri=item.url, media_type=item.media_type))
        elif isinstance(item, CachePoint):
            continue  # a prompt-caching hint for providers that have one; the pipeline has none
        else:
            raise UserError(
                f"{_ADAPTER}: a user prompt item of type {type(item).__name__} cannot be sent "
                "through the pipeline"
            )
    return contents


def _request_messages(message: ModelRequest, conversation: list[ChatMessage]) -> None:
    for part in message.parts:
        if isinstance(part, SystemPromptPart):
            append_message(conversation, ChatRole.SYSTEM, [TextContent(part.content)])
        elif isinstance(part, UserPromptPart):
            append_message(conversation, ChatRole.USER, _user_contents(part.content))
        elif isinstance(part, ToolReturnPart):
            result = FunctionResultContent(part.tool_call_id, part.model_response_str())
            append_message(conversation, ChatRole.TOOL, [result])
        elif isinstance(part, RetryPromptPart):  # legacy parts in a stored history
            if part.tool_name is None:
                append_message(conversation, ChatRole.USER, [TextContent(part.model_response())])
            else:
                result = FunctionResultContent(part.tool_call_id, part.model_response())
                append_message(conversation, ChatRole.TOOL, [result])
        else:
            raise UserError(
                f"{_ADAPTER}: a request part of type {type(part).__name__} cannot be sent "
                "through the pipeline (call the model through an Agent, which prepares the "
                "messages first)"
            )


def _response_contents(parts: Sequence[ModelResponsePart]) -> list[Content]:
    contents: list[Content] = []
    for part in parts:
        if isinstance(part, TextPart):
            if part.content:
                contents.append(TextContent(part.content))
        elif isinstance(part, ToolCallPart):
            contents.append(
                FunctionCallContent(part.tool_call_id, part.tool_name, part.args_as_dict())
            )
        elif isinstance(part, ThinkingPart):
            # Reasoning belongs to the model that produced it; the pipeline's messages have
            # no place for it, and the route that answers next may be another model.
            continue
        else:
            raise UserError(
                f"{_ADAPTER}: an earlier response part of type {type(part).__name__} cannot "
                "be sent through the pipeline"
            )
    return contents


def _response_part(content: Content) -> ModelResponsePart | None:
    if type(content) is TextContent:
        return TextPart(content.text) if content.text else None
    if isinstance(content, FunctionCallContent):
        return ToolCallPart(content.name, dict(content.arguments), tool_call_id=content.call_id)
    raise UnexpectedModelBehavior(
        f"{_ADAPTER}: the pipeline answered with {type(content).__name__}, which a model "
        "response cannot carry"
    )


def _tools(
    settings: ModelSettings,
    parameters: ModelRequestParameters,
    definitions: list[ToolDefinition],
) -> tuple[list[ChatTool], ToolChoice | None]:
    """The tool definitions to offer and the pipeline's ``tool_mode`` for them."""
    choice = resolve_tool_choice(settings, parameters)
    mode: ToolChoice
    if isinstance(choice, tuple):
        how, names = choice
        definitions = [d for d in definitions if d.name in names]
        # One required tool is named; several are a restricted list the model must use.
        if how == "required" and len(definitions) == 1:
            mode = ToolChoice.named(definitions[0].name)
        else:
            mode = _MODES[how]
    else:
        mode = _MODES[choice]
    tools: list[ChatTool] = [
        AgentTool(d.name, d.description, d.parameters_json_schema) for d in definitions
    ]
    return tools, None if mode == ToolChoice.AUTO else mode


_MODES = {"auto": ToolChoice.AUTO, "none": ToolChoice.NONE, "required": ToolChoice.REQUIRED}
"""pydantic-ai's resolved tool choices (which tools, and whether one must be called)."""


def _usage(usage: UsageDetails | None) -> RequestUsage:
    if usage is None:
        return RequestUsage(unmeasured_requests=1)
    return RequestUsage(
        input_tokens=usage.input_tokens or 0, output_tokens=usage.output_tokens or 0
    )


def _finish_reason(reason: str | None) -> FinishReason | None:
    return None if reason is None else _FINISH_REASONS.get(reason)


# -- errors ----------------------------------------------------------------------------------

_CATEGORIES: dict[FailureKind, type[ModelAPIError]] = {
    FailureKind.RATE_LIMITED: ModelRateLimitError,
    # The route's account is out of credit: unavailable for a long while (the pipeline
    # fails over on it, so FallbackModel's default falls back too).
    FailureKind.QUOTA_EXHAUSTED: ModelUnavailableError,
    FailureKind.CIRCUIT_OPEN: ModelUnavailableError,
    FailureKind.REQUEST_INVALID: ModelRequestRejectedError,
    FailureKind.CONTEXT_LENGTH_EXCEEDED: ModelContextWindowExceededError,
    # Input a provider's filter refused: the request was rejected (a filtered *answer*
    # arrives as a response with finish reason content_filter instead).
    FailureKind.CONTENT_FILTERED: ModelRequestRejectedError,
    FailureKind.AUTHENTICATION: ModelAuthenticationError,
    # A response the pipeline found invalid, and unclassified provider failures: the
    # pipeline fails over on both, so FallbackModel's default falls back on them too.
    FailureKind.INVALID_RESPONSE: ModelAPIError,
    FailureKind.UNKNOWN: ModelAPIError,
}


def _category(kind: FailureKind, status: int | None, exc: Exception) -> type[ModelAPIError]:
    if kind is FailureKind.TRANSIENT:
        if status in (503, 529):
            return ModelUnavailableError
        if status is not None and status >= 500:
            return ModelServerError
        return ModelTimeoutError if isinstance(exc, TimeoutError) else ModelConnectionError
    if kind is FailureKind.REQUEST_INVALID and status == 404:
        return ModelNotFoundError
    return _CATEGORIES[kind]


def _model_error(exc: Exception, model_name: str, *, in_stream: bool) -> ModelAPIError | None:
    """The Pydantic AI error for a pipeline failure, or None when `exc` is not one (a
    programming error, a bad argument: those propagate as they are).

    Provider errors keep their status, Retry-After, provider code and message (the
    pipeline's messages never quote prompts or bodies); other failures name their type
    only.
    """
    status: int | None = None
    retry_after: float | None = None
    code: str | None = None
    if isinstance(exc, ProviderError):
        kind = exc.kind
        status, retry_after, code = exc.status_code, exc.retry_after, exc.code
        message = str(exc)
    else:
        kind = classify(exc)
        if kind is FailureKind.UNKNOWN and not isinstance(exc, RoutingError):
            return None
        message = f"{type(exc).__name__} from the pipeline"
    category = _category(kind, status, exc)
    if status is not None and status >= 400 and not issubclass(category, ModelConnectionError):
        return ModelHTTPError.for_category(
            None if category is ModelAPIError else cast(Any, category),
            status_code=status,
            model_name=model_name,
            retry_after=retry_after,
            provider_error_code=code,
            hint=message,
            in_stream=in_stream,
        )
    return category(
        model_name, message, retry_after=retry_after, provider_error_code=code, in_stream=in_stream
    )
