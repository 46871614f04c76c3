"""A forwarded whole Chat Completions answer (`forwarded_response`, `ForwardedResponse`)
against the parsed path's (`parse_response`): every field the layers read is the same, the
message is made only when something reads it, and any other answer (tool calls, reasoning,
garbage) is parsed whole, garbage refused with the parsed path's typed error."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from pipeline._forward import ForwardedResponse
from pipeline.errors import ProviderError
from pipeline.providers import OpenAIChatClient
from pipeline.providers._forwarding import forwarded_response
from pipeline.types import ChatResponse, TextContent

_MESSAGES_SLOT = ChatResponse.__dict__["messages"]


def answer(message: Any, finish: Any = "stop", **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    head = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "m"}
    return {**head, "choices": [choice], "usage": usage, **extra}


def assistant(content: Any = "Hello, wörld ✓", **fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **fields}


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
DETAILED_USAGE = {
    "prompt_tokens": 20,
    "completion_tokens": 9,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 4, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 6, "accepted_prediction_tokens": 0},
}
# Answers of one message of text: read lazily.
TEXT_ANSWERS: dict[str, dict[str, Any]] = {
    "text": answer(assistant()),
    "text-and-refusal-null": answer(assistant(refusal=None, annotations=[])),
    "refusal": answer(assistant(None, refusal="I can't help with that.")),
    "empty-text": answer(assistant("")),
    "no-content": answer({"role": "assistant"}),
    "length-stop": answer(assistant("Hel"), "length"),
    "content-filter": answer(assistant(""), "content_filter"),
    "no-finish-reason": answer(assistant(), None),
    "an-odd-finish-reason": answer(assistant(), 3),
    "no-tool-calls": answer(assistant(tool_calls=[])),
    "null-tool-calls": answer(assistant(tool_calls=None)),
    "null-reasoning": answer(assistant(reasoning_content=None, reasoning=None)),
    "usage-details": answer(assistant(), usage=DETAILED_USAGE),
    "no-usage": {k: v for k, v in answer(assistant()).items() if k != "usage"},
    "usage-null": answer(assistant(), usage=None),
    "usage-not-an-object": answer(assistant(), usage=[5, 7]),
    "odd-counts": answer(
        assistant(),
        usage={
            "prompt_tokens": "5",
            "completion_tokens": True,
            "total_tokens": 1.5,
            "prompt_tokens_details": None,
            "completion_tokens_details": [],
        },
    ),
    "no-ids": {k: v for k, v in answer(assistant()).items() if k not in ("id", "model")},
    "odd-ids": answer(assistant(), id=5, model=None),
    "two-choices": {
        **answer(assistant()),
        "choices": [
            {"index": 0, "message": assistant("first"), "finish_reason": "stop"},
            {"index": 1, "message": assistant("second"), "finish_reason": "length"},
        ],
    },
    "extra-fields": answer(assistant(), system_fingerprint="fp", service_tier="default"),
    "an-empty-error": answer(assistant(), error=None),
}
# Answers the forwarded read leaves to the parsed path whole.
PARSED_ANSWERS: dict[str, dict[str, Any]] = {
    "tool-calls": answer(assistant(None, tool_calls=[CALL]), "tool_calls"),
    "tool-calls-and-text": answer(assistant("Calling.", tool_calls=[CALL, CALL]), "tool_calls"),
    "reasoning_content": answer(assistant("Hi.", reasoning_content="Think first.")),
    "reasoning": answer(assistant("Hi.", reasoning="Think first."), usage=DETAILED_USAGE),
    "empty-reasoning": answer(assistant("Hi.", reasoning_content="")),
}
GARBAGE: dict[str, Any] = {
    "not-an-object": [answer(assistant())],
    "an-error": {"error": {"message": "overloaded", "type": "server_error"}},
    "no-choices": {"id": "x", "model": "m"},
    "choices-not-a-list": answer(assistant()) | {"choices": {"0": assistant()}},
    "empty-choices": answer(assistant()) | {"choices": []},
    "a-choice-not-an-object": answer(assistant()) | {"choices": ["text"]},
    "no-message": answer(None),
    "a-message-not-an-object": answer("Hello"),
    "content-a-number": answer(assistant(5)),
    "content-a-list": answer(assistant([{"type": "text", "text": "Hi"}])),
    "tool-calls-a-string": answer(assistant(tool_calls="f")),
    "a-tool-call-without-a-name": answer(assistant(tool_calls=[{"id": "c", "function": {}}])),
    "arguments-not-json": answer(
        assistant(tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{"}}]),
    ),
    "reasoning-a-number": answer(assistant(reasoning_content=5)),
}


@pytest.fixture
def client() -> OpenAIChatClient:
    return OpenAIChatClient("m", api_key="sk-test", base_url="http://127.0.0.1:9/v1")


def fields(response: ChatResponse) -> tuple[Any, ...]:
    """Every field a layer may read, by name (a dataclass's own ``__eq__`` compares only
    responses of one class)."""
    return tuple(
        getattr(response, field.name)
        for field in dataclasses.fields(ChatResponse)
        if field.name != "raw_representation"
    )


@pytest.mark.parametrize("name", [*TEXT_ANSWERS, *PARSED_ANSWERS])
def test_a_forwarded_answer_reads_as_the_parsed_one(client: OpenAIChatClient, name: str) -> None:
    payload = TEXT_ANSWERS.get(name) or PARSED_ANSWERS[name]
    reference = client._parse_response_for(copy.deepcopy(payload), None)
    response = client._forwarded_response(payload, None)
    assert response.raw_representation is payload  # what the gateway writes from
    assert (type(response) is ForwardedResponse) is (name in TEXT_ANSWERS)
    if name in TEXT_ANSWERS:  # nothing made of the message until it is read
        with pytest.raises(AttributeError):
            _MESSAGES_SLOT.__get__(response)
    assert (response.finish_reason, response.usage) == (
        reference.finish_reason,
        reference.usage,
    )
    assert (response.response_id, response.model_id) == (reference.response_id, reference.model_id)
    assert fields(response) == fields(reference)
    assert response == reference and reference == response
    assert response.text == reference.text
    assert response.messages is response.messages  # made once, then kept
    assert payload == TEXT_ANSWERS.get(name, PARSED_ANSWERS.get(name))  # not changed


def test_the_usage_details_are_read_whole(client: OpenAIChatClient) -> None:
    response = client._forwarded_response(TEXT_ANSWERS["usage-details"], None)
    assert response.usage is not None
    assert dataclasses.asdict(response.usage) == {
        "input_tokens": 20,
        "output_tokens": 9,
        "total_tokens": 29,
        "reasoning_tokens": 6,
        "cache_read_tokens": 16,
        "cache_write_tokens": 4,
    }
    odd = client._forwarded_response(TEXT_ANSWERS["odd-counts"], None).usage
    assert odd is not None and set(dataclasses.asdict(odd).values()) == {None}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_is_the_parsed_paths_typed_error(client: OpenAIChatClient, name: str) -> None:
    assert forwarded_response(GARBAGE[name]) is None
    with pytest.raises(ProviderError) as parsed:
        client._parse_response_for(copy.deepcopy(GARBAGE[name]), None)
    with pytest.raises(ProviderError) as forwarded:
        client._forwarded_response(GARBAGE[name], None)
    assert type(forwarded.value) is type(parsed.value)
    assert (forwarded.value.kind, forwarded.value.code, str(forwarded.value)) == (
        parsed.value.kind,
        parsed.value.code,
        str(parsed.value),
    )


def test_a_forwarded_response_changes_copies_and_prints_as_a_parsed_one(
    client: OpenAIChatClient,
) -> None:
    payload = TEXT_ANSWERS["text"]
    reference = client._parse_response_for(copy.deepcopy(payload), None)
    response = client._forwarded_response(payload, None)
    assert repr(response).replace("ForwardedResponse", "ChatResponse") == repr(reference)
    assert dataclasses.replace(response, value=1) == dataclasses.replace(reference, value=1)
    assert copy.copy(response) == reference
    response.messages[0].contents.append(TextContent(" more"))  # a layer's own change stays
    assert response.text == "Hello, wörld ✓ more"
    replaced = client._forwarded_response(payload, None)
    replaced.messages = []
    assert replaced.messages == [] and replaced.text == ""
