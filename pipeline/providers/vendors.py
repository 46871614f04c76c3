"""OpenAI-compatible vendors by name: Groq, Mistral, DeepSeek, Together, Fireworks, OpenRouter,
xAI and vLLM, each `OpenAIChatClient` with its endpoint, key variable and the fields it
refuses or names otherwise (``provider = "groq"`` and a model is a route).

What each one changes in a Chat Completions request, from the vendor's documentation, is
in its class's docstring and in ``docs/providers.md``; a field a vendor refuses is left out
(another route's options never break this one), a field it names otherwise is renamed.
Failure boundaries are `OpenAIChatClient`'s.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Unpack

from pipeline.providers._base import StreamReader
from pipeline.providers._vendors import VENDORS, Vendor
from pipeline.providers.openai import ClientOptions, OpenAIChatClient
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    Messages,
    ReasoningContent,
    as_messages,
)

__all__ = [
    "DeepSeekChatClient",
    "FireworksChatClient",
    "GroqChatClient",
    "MistralChatClient",
    "OpenRouterChatClient",
    "TogetherChatClient",
    "VLLMChatClient",
    "VENDOR_CLIENTS",
    "XAIChatClient",
]


class _VendorChatClient(OpenAIChatClient):
    """A vendor's Chat Completions endpoint (`vendor`'s URL unless `base_url` says another;
    its key from `api_key` or the vendor's variable, required on the vendor's own endpoint)
    and what the vendor refuses (`refused`, left out) or names otherwise (`renamed`)."""

    vendor: ClassVar[Vendor]
    max_tokens_field = "max_tokens"
    refused: ClassVar[frozenset[str]] = frozenset()
    """Request fields the vendor refuses: left out of its requests."""
    renamed: ClassVar[Mapping[str, str]] = {}
    """Request fields the vendor names otherwise: sent under its name."""
    names_messages: ClassVar[bool] = True
    """Whether the vendor takes a message's ``name`` (`ChatMessage.author_name`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.provider_name = cls.vendor.provider_name
        cls.api_key_env = cls.vendor.key_variable
        # The key is required where the vendor's own endpoint needs one.
        cls.default_base_url = cls.vendor.base_url if cls.vendor.key_required else ""

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(
            model, api_key=api_key, base_url=base_url or self.vendor.base_url, **options
        )

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        body = super()._body(messages, options, stream)
        for field in self.refused.intersection(body):
            del body[field]
        for field, name in self.renamed.items():
            if field in body:
                body.setdefault(name, body.pop(field))
        if not self.names_messages:
            for message in body["messages"]:
                message.pop("name", None)
        self._adapt(body, as_messages(messages), options)
        return body

    def _adapt(
        self, body: dict[str, Any], messages: list[ChatMessage], options: ChatOptions | None
    ) -> None:
        """What else the vendor's wire needs (none by default)."""


def _effort(options: ChatOptions | None) -> tuple[str | None, int | None]:
    if options is None:
        return None, None
    reasoning = options.reasoning
    effort = (reasoning.effort if reasoning is not None else None) or options.reasoning_effort
    return effort, reasoning.budget_tokens if reasoning is not None else None


class GroqChatClient(_VendorChatClient):
    """Groq (``GROQ_API_KEY``). Groq refuses ``logprobs``, ``top_logprobs``,
    ``logit_bias``, ``n`` other than 1 and a message's ``name``: they are left out.
    Reasoning comes back in ``reasoning``; ``reasoning_effort`` is sent as it is."""

    vendor = VENDORS["groq"]
    max_tokens_field = "max_completion_tokens"
    refused = frozenset({"logprobs", "top_logprobs", "logit_bias", "n"})
    names_messages = False


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHANUMERIC = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def mistral_call_id(call_id: str) -> str:
    """A tool call id as Mistral takes it (nine letters or digits): its own as they are,
    another API's mapped to one, the same every time."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    digits = []
    for _ in range(9):
        number, digit = divmod(number, 62)
        digits.append(_ALPHANUMERIC[digit])
    return "".join(digits)


def _mistral_content(message: dict[str, Any]) -> None:
    """A Mistral message (or delta) whose ``content`` is a list of chunks (a reasoning
    model's ``thinking`` and ``text`` chunks), as Chat Completions says it: ``content`` text
    and ``reasoning_content``."""
    content = message.get("content")
    if type(content) is not list:
        return
    texts: list[str] = []
    thoughts: list[str] = []
    for chunk in content:
        if type(chunk) is not dict:
            continue
        if chunk.get("type") == "text" and type(chunk.get("text")) is str:
            texts.append(chunk["text"])
        elif chunk.get("type") == "thinking" and type(chunk.get("thinking")) is list:
            thoughts += [
                part["text"]
                for part in chunk["thinking"]
                if type(part) is dict and type(part.get("text")) is str
            ]
    message["content"] = "".join(texts)
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)


def _mistral_choices(payload: Any, key: str) -> Any:
    if type(payload) is dict and type(payload.get("choices")) is list:
        for choice in payload["choices"]:
            if type(choice) is dict and type(choice.get(key)) is dict:
                _mistral_content(choice[key])
    return payload


class _MistralStream:
    """A stream reader fed Mistral's chunks with their content lists as Chat Completions
    text and reasoning."""

    __slots__ = ("_reader",)

    def __init__(self, reader: StreamReader) -> None:
        self._reader = reader

    def feed(self, payload: Any) -> ChatResponseUpdate | None:
        return self._reader.feed(_mistral_choices(payload, "delta"))

    def finish(self) -> ChatResponseUpdate | None:
        return self._reader.finish()


class MistralChatClient(_VendorChatClient):
    """Mistral (``MISTRAL_API_KEY``), whose API refuses fields it does not know: ``seed`` is
    sent as ``random_seed``; ``stream_options`` (Mistral's streams end with their usage
    anyway), ``logit_bias``, ``logprobs``, ``top_logprobs`` and ``verbosity`` are left
    out. Tool call ids are nine letters or digits there: another API's ids are mapped to
    such ids (the same one each time, in the call and in its result). A reasoning effort is
    ``reasoning_effort`` ``high`` (``none`` stays ``none``), the two values Mistral takes;
    a reasoning model's content chunks come back as text and reasoning."""

    vendor = VENDORS["mistral"]
    refused = frozenset({"stream_options", "logit_bias", "logprobs", "top_logprobs", "verbosity"})
    renamed: ClassVar[Mapping[str, str]] = {"seed": "random_seed"}

    def _adapt(
        self, body: dict[str, Any], messages: list[ChatMessage], options: ChatOptions | None
    ) -> None:
        for message in body["messages"]:
            for call in message.get("tool_calls") or ():
                call["id"] = mistral_call_id(call["id"])
            if "tool_call_id" in message:
                message["tool_call_id"] = mistral_call_id(message["tool_call_id"])
        effort = body.get("reasoning_effort")
        if effort is not None:
            body["reasoning_effort"] = "none" if effort == "none" else "high"

    def _parse_response_for(self, payload: Any, options: ChatOptions | None) -> ChatResponse:
        return super()._parse_response_for(_mistral_choices(payload, "message"), options)

    def _stream_reader_for(self, options: ChatOptions | None) -> StreamReader:
        return _MistralStream(super()._stream_reader_for(options))


class DeepSeekChatClient(_VendorChatClient):
    """DeepSeek (``DEEPSEEK_API_KEY``). Reasoning is DeepSeek's ``thinking`` switch: an
    effort (or a budget) turns it on, with ``reasoning_effort`` ``high`` or ``max`` (lower
    efforts are ``high``, ``xhigh`` is ``max``); ``none`` (or a budget of 0) turns it off.
    An assistant turn with tool calls carries its ``reasoning_content`` back, as DeepSeek
    requires in a tool loop (it refuses the turn without it). ``logprobs`` and
    ``top_logprobs``, which thinking refuses, are left out."""

    vendor = VENDORS["deepseek"]
    refused = frozenset({"logprobs", "top_logprobs"})

    _EFFORTS: ClassVar[dict[str, str]] = {"max": "max", "xhigh": "max"}

    def _adapt(
        self, body: dict[str, Any], messages: list[ChatMessage], options: ChatOptions | None
    ) -> None:
        effort, budget = _effort(options)
        body.pop("reasoning_effort", None)
        if effort == "none" or budget == 0:
            body["thinking"] = {"type": "disabled"}
        elif effort is not None or budget is not None:
            body["thinking"] = {"type": "enabled"}
            body["reasoning_effort"] = self._EFFORTS.get(effort or "", "high")
        # Each assistant message with tool calls: its reasoning, in order.
        thoughts = [
            "".join(c.text for c in message.contents if isinstance(c, ReasoningContent))
            for message in messages
            if message.role is ChatRole.ASSISTANT
        ]
        sent = [m for m in body["messages"] if m.get("role") == "assistant"]
        for message, thought in zip(sent, thoughts, strict=False):
            if thought and message.get("tool_calls"):
                message["reasoning_content"] = thought


class TogetherChatClient(_VendorChatClient):
    """Together AI (``TOGETHER_API_KEY``): ``max_tokens``; reasoning comes back in
    ``reasoning`` and ``reasoning_effort`` is sent as it is."""

    vendor = VENDORS["together"]


class FireworksChatClient(_VendorChatClient):
    """Fireworks AI (``FIREWORKS_API_KEY``): ``max_tokens``; ``presence_penalty``,
    ``frequency_penalty`` and ``best_of``, which Fireworks does not support, are left out."""

    vendor = VENDORS["fireworks"]
    refused = frozenset({"presence_penalty", "frequency_penalty", "best_of"})


class OpenRouterChatClient(_VendorChatClient):
    """OpenRouter (``OPENROUTER_API_KEY``): reasoning is its ``reasoning`` object (an effort
    as ``effort``, a budget as ``max_tokens``, ``none`` or a budget of 0 as ``enabled:
    false``), never ``reasoning_effort``. `app_url` and `app_name` are sent as the
    ``HTTP-Referer`` and ``X-Title`` headers OpenRouter attributes requests by."""

    vendor = VENDORS["openrouter"]

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        app_url: str | None = None,
        app_name: str | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        headers = dict(options.get("default_headers") or {})
        if app_url:
            headers["HTTP-Referer"] = app_url
        if app_name:
            headers["X-Title"] = app_name
        options["default_headers"] = headers
        super().__init__(model, api_key=api_key, base_url=base_url, **options)

    def _adapt(
        self, body: dict[str, Any], messages: list[ChatMessage], options: ChatOptions | None
    ) -> None:
        effort, budget = _effort(options)
        body.pop("reasoning_effort", None)
        if effort == "none" or budget == 0:
            body["reasoning"] = {"enabled": False}
        elif budget is not None:
            body["reasoning"] = {"max_tokens": budget}
        elif effort is not None:
            body["reasoning"] = {"effort": effort}


class XAIChatClient(_VendorChatClient):
    """xAI (``XAI_API_KEY``): ``max_completion_tokens``; ``presence_penalty`` and
    ``frequency_penalty``, which its reasoning models refuse, are left out. Reasoning comes
    back in ``reasoning_content``; ``reasoning_effort`` is sent as it is (only some Grok
    models take it: the others refuse the request)."""

    vendor = VENDORS["xai"]
    max_tokens_field = "max_completion_tokens"
    refused = frozenset({"presence_penalty", "frequency_penalty"})


class VLLMChatClient(_VendorChatClient):
    """A vLLM server (default ``http://localhost:8000/v1``; ``VLLM_API_KEY`` when it was
    started with ``--api-key``): ``max_tokens``; reasoning parsers' ``reasoning_content``
    (or ``reasoning``) comes back as reasoning."""

    vendor = VENDORS["vllm"]


VENDOR_CLIENTS: dict[str, type[_VendorChatClient]] = {
    "groq": GroqChatClient,
    "mistral": MistralChatClient,
    "deepseek": DeepSeekChatClient,
    "together": TogetherChatClient,
    "fireworks": FireworksChatClient,
    "openrouter": OpenRouterChatClient,
    "xai": XAIChatClient,
    "vllm": VLLMChatClient,
}
"""The client class of each ``provider =`` preset."""
