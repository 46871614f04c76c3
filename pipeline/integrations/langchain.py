"""A LangChain chat model over a pipeline: ``PipelineChatModel(chat=pipeline)``.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages import ChatMessage as RoleMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import ToolCall, tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from pipeline import _scope
from pipeline.client import metadata_of
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
from pipeline.integrations._loop import HomeLoop
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatRole,
    Content,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    ToolChoice,
    UsageDetails,
)

__all__ = ["PipelineChatModel"]

_ADAPTER = "PipelineChatModel"

_ROLES = {
    "system": ChatRole.SYSTEM,
    "developer": ChatRole.SYSTEM,
    "user": ChatRole.USER,
    "human": ChatRole.USER,
    "assistant": ChatRole.ASSISTANT,
    "ai": ChatRole.ASSISTANT,
}
# Content blocks of an AI turn that repeat what `tool_calls` says, or are a model's own
# reasoning: the pipeline sends tool calls from `tool_calls` and has no place for reasoning.
_SKIPPED_AI_BLOCKS = frozenset(
    {"tool_use", "tool_call", "tool_call_chunk", "function_call", "reasoning", "thinking"}
)
_OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "max_output_tokens": "max_output_tokens",
    "response_format": "response_format",
    "reasoning_effort": "reasoning_effort",
}


class PipelineChatModel(BaseChatModel):
    """A LangChain chat model that sends every request through `chat` (a `ChatPipeline` or
    any `ChatClient`); see the module docstring for what it promises.

    `options` (a `ChatOptions`) are the base of every request's options (cloned, never
    changed); bound and per-call keyword arguments override them. `model_name` names the
    model in LangChain's tracing (default: the pipeline's name or model id).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    chat: Any = Field(exclude=True)
    """The pipeline (or any `ChatClient`) every request goes through."""
    options: Any = Field(default=None, exclude=True)
    """A `ChatOptions` every request starts from, or None."""
    model_name: str | None = None
    """The model's name in LangChain's tracing (default: the pipeline's)."""

    _home: HomeLoop = PrivateAttr()

    @model_validator(mode="after")
    def _check(self) -> PipelineChatModel:
        self.chat = check_agent_pipeline(self.chat, _ADAPTER)
        if self.options is not None and not isinstance(self.options, ChatOptions):
            raise TypeError(
                f"{_ADAPTER}: options must be ChatOptions or None, "
                f"not {type(self.options).__name__}"
            )
        if self.model_name is None:
            metadata = metadata_of(self.chat)
            self.model_name = metadata.name or metadata.model_id or "pipeline"
        self._home = HomeLoop(_ADAPTER)
        # A model dropped without close() still stops its private loop (if it started one).
        weakref.finalize(self, self._home.close)
        return self

    @property
    def _llm_type(self) -> str:
        return "chat-pipeline"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name}

    # -- tools -----------------------------------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer `tools` (anything ``convert_to_openai_tool`` takes) to the model; the
        answer's ``tool_calls`` say which to run. `tool_choice`: see the module docstring."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            _tool_mode(tool_choice, [_agent_tool(t).name for t in formatted])  # checked here
            kwargs["tool_choice"] = tool_choice
        return self.bind(tools=formatted, **kwargs)

    # -- calls -----------------------------------------------------------------------------

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        conversation, options = self._request(messages, stop, kwargs)
        return self._home.run_blocking(self._respond(conversation, options))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        conversation, options = self._request(messages, stop, kwargs)
        return await self._home.run(self._respond(conversation, options))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        conversation, options = self._request(messages, stop, kwargs)
        chunks = self._chunks(conversation, options)
        try:
            while True:
                try:
                    chunk = self._home.run_blocking(_next_chunk(chunks))
                except StopAsyncIteration:
                    return
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            self._home.run_blocking(_close(chunks))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        conversation, options = self._request(messages, stop, kwargs)
        chunks = self._chunks(conversation, options)
        try:
            while True:
                try:
                    chunk = await self._home.run(_next_chunk(chunks))
                except StopAsyncIteration:
                    return
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            await self._home.run(_close(chunks))

    def close(self) -> None:
        """Close the pipeline on the event loop it ran on, and stop the private loop (for
        code that called the model synchronously; async code may `await aclose()`)."""
        try:
            self._home.run_blocking(self.chat.aclose())
        finally:
            self._home.close()

    async def aclose(self) -> None:
        """Close the pipeline on the event loop it ran on, and stop the private loop."""
        try:
            await self._home.run(self.chat.aclose())
        finally:
            self._home.close()

    # -- the pipeline side (runs on the home loop) --------------------------------------

    async def _respond(self, conversation: list[ChatMessage], options: ChatOptions) -> ChatResult:
        report, token = route_report()
        try:
            response = await self.chat.get_response(conversation, options)
        finally:
            _scope.exit_report(token)
        ensure_no_tool_results(response.messages, _ADAPTER)
        message = _ai_message(response, served_route(report), self.model_name)
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _chunks(
        self, conversation: list[ChatMessage], options: ChatOptions
    ) -> AsyncGenerator[ChatGenerationChunk, None]:
        usage: UsageDetails | None = None
        finish_reason = response_id = model_id = None
        calls = 0
        async with contextlib.aclosing(
            self.chat.get_streaming_response(conversation, options)
        ) as stream:
            # The first read is where the routers below take this request's report.
            report, token = route_report()
            try:
                update = await anext(stream, None)
            finally:
                _scope.exit_report(token)
            while update is not None:
                ensure_not_tool_results(update.role, _ADAPTER)
                if update.usage is not None:
                    usage = update.usage if usage is None else usage + update.usage
                finish_reason = update.finish_reason or finish_reason
                response_id = update.response_id or response_id
                model_id = update.model_id or model_id
                for content in update.contents:
                    if type(content) is TextContent:
                        if content.text:
                            yield ChatGenerationChunk(message=AIMessageChunk(content=content.text))
                    elif isinstance(content, FunctionCallContent):
                        chunk = tool_call_chunk(
                            name=content.name,
                            args=json.dumps(dict(content.arguments)),
                            id=content.call_id,
                            index=calls,
                        )
                        calls += 1
                        message = AIMessageChunk(content="", tool_call_chunks=[chunk])
                        yield ChatGenerationChunk(message=message)
                    else:
                        raise ValueError(
                            f"{_ADAPTER}: the pipeline streamed {type(content).__name__}, "
                            "which an AI message cannot carry"
                        )
                update = await anext(stream, None)
        summary = ChatResponse(
            response_id=response_id, model_id=model_id, finish_reason=finish_reason, usage=usage
        )
        last = AIMessageChunk(
            content="",
            usage_metadata=_usage_metadata(usage),
            response_metadata=_response_metadata(summary, served_route(report), self.model_name),
            chunk_position="last",
        )
        yield ChatGenerationChunk(message=last)

    # -- requests out ----------------------------------------------------------------------

    def _request(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[list[ChatMessage], ChatOptions]:
        return _conversation(messages), self._options(stop, kwargs)

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> ChatOptions:
        options = self.options.clone() if self.options is not None else ChatOptions()
        if stop:
            options.stop = list(stop)
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        for key, value in kwargs.items():
            if value is None:
                continue
            field_name = _OPTION_FIELDS.get(key)
            if field_name is not None:
                setattr(options, field_name, value)
            else:
                # The pipeline's escape hatch: extra fields for the provider's request body.
                options.additional_properties[key] = value
        if tools:
            definitions = [_agent_tool(t) for t in tools]
            options.tools = list(definitions)
            if tool_choice is not None and tool_choice is not False:
                options.tool_mode = _tool_mode(tool_choice, [d.name for d in definitions])
        elif tool_choice not in (None, False, "none", "auto"):
            raise ValueError(f"{_ADAPTER}: tool_choice {tool_choice!r} needs bound tools")
        return options


async def _next_chunk(chunks: AsyncIterator[ChatGenerationChunk]) -> ChatGenerationChunk:
    return await anext(chunks)


async def _close(chunks: AsyncGenerator[ChatGenerationChunk, None]) -> None:
    await chunks.aclose()


# -- messages ------------------------------------------------------------------------------


def _text(content: str | list[str | dict[str, Any]], *, skip: frozenset[str] = frozenset()) -> str:
    if isinstance(content, str):
        return content
    pieces: list[str] = []
    for block in content:
        if isinstance(block, str):
            pieces.append(block)
        elif block.get("type") == "text":
            pieces.append(str(block.get("text", "")))
        elif block.get("type") not in skip:
            raise ValueError(
                f"{_ADAPTER}: a content block of type {block.get('type')!r} cannot be sent "
                "through the pipeline here"
            )
    return "".join(pieces)


def _data_block(block: Mapping[str, Any]) -> DataContent:
    """An image, audio or file block, by URL or inline (OpenAI's ``image_url`` form and
    LangChain's standard blocks)."""
    mime = block.get("mime_type") or block.get("media_type")
    image_url = block.get("image_url")
    if image_url is not None:
        url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
        return DataContent(uri=str(url), media_type=mime)
    if block.get("url"):
        return DataContent(uri=str(block["url"]), media_type=mime)
    encoded = block.get("base64") or block.get("data")
    if isinstance(encoded, str):
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{_ADAPTER}: a {block.get('type')} block is not base64") from exc
        return DataContent(data=data, media_type=mime)
    raise ValueError(f"{_ADAPTER}: a {block.get('type')} block has neither a URL nor data")


def _user_contents(content: str | list[str | dict[str, Any]]) -> list[Content]:
    if isinstance(content, str):
        return [TextContent(content)]
    contents: list[Content] = []
    for block in content:
        if isinstance(block, str):
            contents.append(TextContent(block))
        elif block.get("type") == "text":
            contents.append(TextContent(str(block.get("text", ""))))
        elif block.get("type") in ("image_url", "image", "audio", "file", "video"):
            contents.append(_data_block(block))
        else:
            raise ValueError(
                f"{_ADAPTER}: a content block of type {block.get('type')!r} cannot be sent "
                "through the pipeline"
            )
    return contents


def _conversation(messages: Sequence[BaseMessage]) -> list[ChatMessage]:
    conversation: list[ChatMessage] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            append_message(conversation, ChatRole.SYSTEM, [TextContent(_text(message.content))])
        elif isinstance(message, HumanMessage):
            append_message(conversation, ChatRole.USER, _user_contents(message.content))
        elif isinstance(message, AIMessage):
            contents: list[Content] = []
            text = _text(message.content, skip=_SKIPPED_AI_BLOCKS)
            if text:
                contents.append(TextContent(text))
            contents.extend(
                FunctionCallContent(call["id"] or "", call["name"], call["args"])
                for call in message.tool_calls
            )
            append_message(conversation, ChatRole.ASSISTANT, contents)
        elif isinstance(message, ToolMessage):
            result = FunctionResultContent(message.tool_call_id, _text(message.content))
            append_message(conversation, ChatRole.TOOL, [result])
        elif isinstance(message, RoleMessage) and message.role in _ROLES:
            role = _ROLES[message.role]
            append_message(conversation, role, _user_contents(message.content))
        else:
            raise ValueError(
                f"{_ADAPTER}: a {type(message).__name__} cannot be sent through the pipeline"
            )
    if not conversation:
        raise ValueError(f"{_ADAPTER}: no messages to send")
    return conversation


def _agent_tool(tool: Any) -> AgentTool:
    """A bound tool (OpenAI's format, or anything ``convert_to_openai_tool`` takes) as a
    definition the pipeline offers the model."""
    formatted = tool if _is_openai_tool(tool) else convert_to_openai_tool(tool)
    function = formatted["function"]
    return AgentTool(
        function["name"],
        function.get("description") or None,
        function.get("parameters") or {"type": "object", "properties": {}},
    )


def _is_openai_tool(tool: Any) -> bool:
    return (
        isinstance(tool, Mapping)
        and tool.get("type") == "function"
        and isinstance(tool.get("function"), Mapping)
    )


def _tool_mode(choice: str | bool | dict[str, Any], names: Sequence[str]) -> ToolChoice:
    """The pipeline's ``tool_mode`` for a LangChain ``tool_choice`` (a tool named as a mode
    word is chosen by a dict: ``{"type": "function", "function": {"name": "none"}}``)."""
    if choice is True:
        return ToolChoice.REQUIRED
    if isinstance(choice, str) and choice in _MODES:
        return _MODES[choice]
    name: Any = choice
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else choice.get("name")
    if isinstance(name, str) and name in names:
        return ToolChoice.named(name)
    raise ValueError(
        f"{_ADAPTER}: tool_choice {choice!r} names no bound tool; expected 'auto', 'none', "
        f"'required', 'any', True or one of {list(names)}"
    )


_MODES = {
    "auto": ToolChoice.AUTO,
    "none": ToolChoice.NONE,
    "any": ToolChoice.REQUIRED,
    "required": ToolChoice.REQUIRED,
}
"""LangChain's ``tool_choice`` words (``any`` is Anthropic's, ``required`` OpenAI's)."""


# -- responses -----------------------------------------------------------------------------


def _usage_metadata(usage: UsageDetails | None) -> UsageMetadata | None:
    if usage is None:
        return None
    input_tokens = usage.input_tokens or 0
    output_tokens = usage.output_tokens or 0
    total = usage.total_tokens if usage.total_tokens is not None else input_tokens + output_tokens
    return UsageMetadata(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=total)


def _response_metadata(
    response: ChatResponse, served: ServedRoute, model_name: str | None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "model_name": response.model_id or served.model_id or model_name,
        "finish_reason": response.finish_reason,
    }
    if response.response_id:
        metadata["response_id"] = response.response_id
    metadata.update(served.as_metadata())
    return metadata


def _ai_message(response: ChatResponse, served: ServedRoute, model_name: str | None) -> AIMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for message in response.messages:
        for content in message.contents:
            if type(content) is TextContent:
                texts.append(content.text)
            elif isinstance(content, FunctionCallContent):
                calls.append(
                    tool_call(name=content.name, args=dict(content.arguments), id=content.call_id)
                )
            else:
                raise ValueError(
                    f"{_ADAPTER}: the pipeline answered with {type(content).__name__}, which "
                    "an AI message cannot carry"
                )
    return AIMessage(
        content="".join(texts),
        tool_calls=calls,
        usage_metadata=_usage_metadata(response.usage),
        response_metadata=_response_metadata(response, served, model_name),
    )
