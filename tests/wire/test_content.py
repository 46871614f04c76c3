"""Every content class of `pipeline.types` walked through every outbound codec, in every
role: it is sent, or it is one of the drops the codec's module docstring names (each listed
here with why); never lost silently. A new content class fails `SAMPLES` until it is walked
(and mypy fails each codec's exhaustive ``match`` until it is handled)."""

from __future__ import annotations

import base64
import json
import typing

import pytest

from pipeline.types import (
    ChatMessage,
    ChatRole,
    Content,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    ReasoningContent,
    TextContent,
)
from tests.wire.apis import APIS, WireApi

SAMPLES: dict[type, tuple[Content, str]] = {
    TextContent: (TextContent("CANARY-text"), "CANARY-text"),
    DataContent: (
        DataContent(data=b"CANARY-data", media_type="image/png"),
        base64.b64encode(b"CANARY-data").decode(),
    ),
    FunctionCallContent: (
        FunctionCallContent("call_1", "lookup", {"q": "CANARY-argument"}),
        "CANARY-argument",
    ),
    FunctionResultContent: (FunctionResultContent("call_1", "CANARY-result"), "CANARY-result"),
    # A Responses reasoning item (an id and its encrypted content): what the other APIs
    # cannot verify, so the walk sees their drops too.
    ReasoningContent: (
        ReasoningContent("CANARY-reasoning", protected="CANARY-proof", id="rs_1"),
        "CANARY-proof",
    ),
}
"""One instance of each content class, and what of it shows in a request that sends it."""

_ALL_ROLES = frozenset(ChatRole)
_NOT_USER = frozenset({ChatRole.SYSTEM, ChatRole.ASSISTANT, ChatRole.TOOL})
_NOT_ASSISTANT = frozenset({ChatRole.SYSTEM, ChatRole.USER, ChatRole.TOOL})

DROPS: dict[str, dict[type, frozenset[ChatRole]]] = {
    "chat_completions": {
        ReasoningContent: _ALL_ROLES,  # these servers take no reasoning back
        DataContent: _NOT_USER,  # image parts exist in user messages only
        TextContent: frozenset({ChatRole.TOOL}),  # a tool message is its results
        FunctionCallContent: frozenset({ChatRole.TOOL}),
    },
    "responses": {
        ReasoningContent: _NOT_ASSISTANT,  # reasoning items are the model's turn's
        DataContent: _NOT_USER,  # image parts exist in user messages only
        TextContent: frozenset({ChatRole.TOOL}),  # a tool message is its results
    },
    "messages": {
        ReasoningContent: _ALL_ROLES,  # another API's reasoning item: no Anthropic signature
        # The system prompt is text.
        DataContent: frozenset({ChatRole.SYSTEM}),
        FunctionCallContent: frozenset({ChatRole.SYSTEM}),
        FunctionResultContent: frozenset({ChatRole.SYSTEM}),
    },
    "gemini": {
        ReasoningContent: _ALL_ROLES,  # another API's reasoning item: no thought signature
        # The system instruction is text.
        DataContent: frozenset({ChatRole.SYSTEM}),
        FunctionCallContent: frozenset({ChatRole.SYSTEM}),
        FunctionResultContent: frozenset({ChatRole.SYSTEM}),
    },
    "bedrock": {
        ReasoningContent: _ALL_ROLES,  # another API's reasoning item: no Converse signature
        # The system prompt is text.
        DataContent: frozenset({ChatRole.SYSTEM}),
        FunctionCallContent: frozenset({ChatRole.SYSTEM}),
        FunctionResultContent: frozenset({ChatRole.SYSTEM}),
    },
}
"""Per API, the content classes its codec leaves out, and in which roles (the module
docstrings say so)."""


def test_every_content_class_has_a_sample() -> None:
    assert set(SAMPLES) == set(typing.get_args(Content))


def test_every_api_says_what_it_drops() -> None:
    assert set(DROPS) == {api.name for api in APIS}


@pytest.mark.parametrize("role", list(ChatRole), ids=[role.value for role in ChatRole])
@pytest.mark.parametrize("kind", list(SAMPLES), ids=[kind.__name__ for kind in SAMPLES])
def test_each_content_is_sent_or_a_documented_drop(
    api: WireApi, kind: type, role: ChatRole
) -> None:
    content, shows = SAMPLES[kind]
    # A call and its result first (an API that matches results to calls by name finds it),
    # and a user turn after: every API then has a conversation to send.
    conversation = [
        ChatMessage.user("hi"),
        ChatMessage.assistant(FunctionCallContent("call_1", "lookup", {"q": "x"})),
        ChatMessage.tool(FunctionResultContent("call_1", "x")),
        ChatMessage(role, [content]),
        ChatMessage.user("and?"),
    ]
    body = json.dumps(api.build(conversation))
    dropped = role in DROPS[api.name].get(kind, frozenset())
    assert (shows not in body) is dropped, f"{kind.__name__} in a {role.value} message is " + (
        "sent, yet listed as dropped" if dropped else "dropped, yet not listed"
    )


def test_an_object_that_is_no_content_is_refused_by_type_never_by_value(api: WireApi) -> None:
    message = ChatMessage.assistant("fine")
    message.contents.append("CANARY-not-content")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^str is no content type") as raised:
        api.build([ChatMessage.user("hi"), message])
    assert "CANARY" not in str(raised.value)
