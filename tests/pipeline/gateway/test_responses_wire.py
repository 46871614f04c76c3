"""The Responses format alone (no server): requests into messages and options, answers and
streams into the API's objects and events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.errors import WireError
from pipeline.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    FunctionTool,
    TextContent,
    ToolChoice,
    UsageDetails,
)
from pipeline.wire.responses.inbound import ResponsesEncoder, completion, parse_responses


def parse(**body: Any) -> Any:
    return parse_responses(json.dumps({"model": "m", "input": "hi", **body}).encode())


def events(stream: str) -> list[dict[str, Any]]:
    """The payloads of an SSE text, checking each event's name is its payload's type."""
    out = []
    for block in stream.strip().split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_items_become_one_conversation() -> None:
    request = parse(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Look"}]},
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]},
            {"type": "message", "role": "assistant", "content": "Checking.", "id": "msg_1"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
        ],
        tools=[{"type": "function", "name": "f"}, {"type": "function", "name": "g"}],
        tool_choice={"type": "function", "name": "g"},
        max_output_tokens=99,
        reasoning={"effort": "low"},
        text={"format": {"type": "json_schema", "name": "r", "schema": {}}},
    )
    assert [m.role for m in request.messages] == [
        ChatRole.SYSTEM,
        ChatRole.USER,
        ChatRole.USER,
        ChatRole.ASSISTANT,
        ChatRole.TOOL,
        ChatRole.TOOL,
    ]
    assert request.messages[2].contents == [DataContent(uri="https://x/a.png")]
    # The calls join the assistant turn before them, as one Chat Completions message would.
    assert request.messages[3].contents == [
        TextContent("Checking."),
        FunctionCallContent(call_id="c1", name="f", arguments={"a": 1}),
        FunctionCallContent(call_id="c2", name="g", arguments={}),
    ]
    assert request.messages[5].contents == [FunctionResultContent("c2", result="two")]
    options = request.options
    assert options.tools == [FunctionTool("f"), FunctionTool("g")]
    assert options.tool_mode == ToolChoice.named("g")
    assert (options.max_output_tokens, options.reasoning_effort) == (99, "low")
    assert options.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": {}},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]},
            "input[0].arguments",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"store": "yes"}, "store"),
    ],
)
def test_a_bad_request_names_its_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(WireError) as raised:
        parse(**body)
    assert (raised.value.status, raised.value.param) == (400, param)


def test_a_whole_answer_keeps_the_models_order_and_echoes_the_request() -> None:
    request = parse(metadata={"k": "v"}, tools=[{"type": "function", "name": "f"}])
    call = FunctionCallContent(call_id="c1", name="f", arguments={"a": 1})
    response = ChatResponse(
        messages=[ChatMessage(ChatRole.ASSISTANT, [TextContent("Let me see."), call])],
        model_id="served",
        finish_reason="tool_calls",
        usage=UsageDetails(3, 4, None),
    )
    body = json.loads(completion(response, request, response_id="resp_1", created=5))
    assert [item["type"] for item in body["output"]] == ["message", "function_call"]
    assert body["output"][1]["call_id"] == "c1" and body["output"][1]["arguments"] == '{"a":1}'
    assert (body["status"], body["model"], body["id"]) == ("completed", "served", "resp_1")
    assert body["usage"]["total_tokens"] == 7
    assert body["metadata"] == {"k": "v"} and body["tools"] == [{"type": "function", "name": "f"}]


def test_a_stream_numbers_its_events_and_opens_a_new_message_after_a_call() -> None:
    encoder = ResponsesEncoder(parse(), model="m", response_id="resp_1", created=5)
    call = FunctionCallContent(call_id="c1", name="f", arguments={})
    text = encoder.update(ChatResponseUpdate(ChatRole.ASSISTANT, [TextContent("a")]))
    text += encoder.update(ChatResponseUpdate(ChatRole.ASSISTANT, [call, TextContent("b")]))
    text += encoder.update(
        ChatResponseUpdate(
            ChatRole.ASSISTANT, [], usage=UsageDetails(1, 2, 3), finish_reason="length"
        )
    )
    sent = events(text + encoder.end())
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    added = [
        (e["output_index"], e["item"]["type"])
        for e in sent
        if e["type"].endswith("added") and "item" in e
    ]
    assert added == [(0, "message"), (1, "function_call"), (2, "message")]
    deltas = [(e["output_index"], e["delta"]) for e in sent if e["type"].endswith("text.delta")]
    assert deltas == [(0, "a"), (2, "b")]
    final = sent[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in final["response"]["output"]] == [
        "message",
        "function_call",
        "message",
    ]
    assert final["response"]["usage"]["total_tokens"] == 3


def test_an_empty_answer_is_one_empty_message_and_an_error_is_two_events() -> None:
    encoder = ResponsesEncoder(parse(), model="m", response_id="resp_1", created=5)
    sent = events(encoder.end())
    assert [e["type"] for e in sent][-1] == "response.completed"
    assert sent[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert sent[-1]["response"]["usage"] is None  # no usage was reported: none is made up
    encoder = ResponsesEncoder(parse(), model="m", response_id="resp_2", created=5)
    encoder.update(ChatResponseUpdate(ChatRole.ASSISTANT, [TextContent("par")]))
    error = WireError(429, "slow down", type="rate_limit_error", code="rate_limit_exceeded")
    sent = events(encoder.error(error))
    assert [e["type"] for e in sent] == ["error", "response.failed"]
    assert sent[0]["code"] == "rate_limit_exceeded" and sent[0]["sequence_number"] == 5
    failed = sent[1]["response"]
    assert failed["error"]["code"] == "rate_limit_exceeded"
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "par"
