import dataclasses
from typing import Any

import pytest

from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    DataContent,
    FinishReason,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    UsageDetails,
)
from pipeline.types import (
    CacheMode,
    ReasoningOptions,
    ToolChoice,
    as_messages,
    checked_message,
    checked_text,
    session_options,
)


def test_role_is_str_enum() -> None:
    assert ChatRole("user") is ChatRole.USER
    assert ChatRole.TOOL == "tool"


def test_finish_reason_is_a_str_enum_of_the_chat_completions_values() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "tool_calls", "content_filter"]
    assert FinishReason.STOP == "stop" and f"{FinishReason.LENGTH}" == "length"
    response = ChatResponse(finish_reason=FinishReason.TOOL_CALLS)
    assert response.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("tool_calls", FinishReason.TOOL_CALLS),
        ("content_filter", FinishReason.CONTENT_FILTER),
        ("function_call", FinishReason.TOOL_CALLS),
        ("end_turn", FinishReason.STOP),
        ("stop_sequence", FinishReason.STOP),
        ("pause_turn", FinishReason.STOP),
        ("max_tokens", FinishReason.LENGTH),
        ("model_context_window_exceeded", FinishReason.LENGTH),
        ("tool_use", FinishReason.TOOL_CALLS),
        ("refusal", FinishReason.CONTENT_FILTER),
        ("something_new", None),
        (None, None),
    ],
)
def test_finish_reason_of_a_providers_value(reason: str | None, expected: object) -> None:
    assert FinishReason.of(reason) is expected


def test_message_constructors_and_text() -> None:
    message = ChatMessage.user("hello")
    assert message.role is ChatRole.USER
    assert message.contents == [TextContent("hello")]
    assert message.text == "hello"
    assert ChatMessage.system("s").role is ChatRole.SYSTEM
    assert ChatMessage.assistant([TextContent("a"), TextContent("b")]).text == "ab"
    call = FunctionCallContent("c1", "f", {"x": 1})
    assert ChatMessage.assistant(call).contents == [call]
    assert ChatMessage.tool(FunctionResultContent("c1", 3)).role is ChatRole.TOOL
    assert ChatMessage("assistant", "x").role is ChatRole.ASSISTANT


def test_message_rejects_bad_role_and_contents() -> None:
    with pytest.raises(ValueError, match="unknown chat role 'robot'"):
        ChatMessage("robot", "x")
    with pytest.raises(TypeError, match="content objects"):
        ChatMessage.user([1, 2])  # type: ignore[list-item]


def test_message_repr_hides_text() -> None:
    assert "CANARY" not in repr(ChatMessage.user("CANARY-text"))


def test_contents_validate() -> None:
    with pytest.raises(TypeError):
        TextContent(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly one"):
        DataContent()
    with pytest.raises(ValueError, match="exactly one"):
        DataContent(data=b"x", uri="http://x")
    assert DataContent(uri="file://a", media_type="image/png").uri == "file://a"
    with pytest.raises(ValueError):
        FunctionCallContent("c", "", {})
    with pytest.raises(TypeError):
        FunctionCallContent("c", "f", [1])  # type: ignore[arg-type]


def test_as_messages_accepts_every_shape() -> None:
    one = ChatMessage.user("a")
    assert as_messages("hi")[0].text == "hi"
    assert as_messages(one) == [one]
    assert as_messages((one, one)) == [one, one]
    listed = [one]
    assert as_messages(listed) is listed


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (None, TypeError, "not None"),
        (3, TypeError, "not int"),
        ([], ValueError, "must not be empty"),
        ([ChatMessage.user("a"), "b"], TypeError, "not str"),
    ],
)
def test_as_messages_rejects_bad_input(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        as_messages(value)  # type: ignore[arg-type]


def test_options_clone_is_independent() -> None:
    options = ChatOptions(
        model_id="m",
        stop=["x"],
        tools=["t"],
        response_format={"type": "json_schema", "schema": {"a": 1}},
        additional_properties={"nested": {"k": [1]}},
    )
    clone = options.clone()
    assert clone == options and clone is not options
    clone.stop.append("y")  # type: ignore[union-attr]
    clone.tools.append("u")  # type: ignore[union-attr]
    clone.response_format["schema"]["a"] = 2
    clone.additional_properties["nested"]["k"].append(2)
    assert options.stop == ["x"]
    assert options.tools == ["t"]
    assert options.response_format["schema"]["a"] == 1
    assert options.additional_properties == {"nested": {"k": [1]}}


def test_options_clone_copies_every_field() -> None:
    # A field added to ChatOptions must be added to `clone` too: every field is set here to
    # a value other than its default, and the clone must carry each one.
    values: dict[str, Any] = {
        "model_id": "m",
        "temperature": 0.5,
        "top_p": 0.9,
        "max_output_tokens": 7,
        "stop": ["x"],
        "seed": 3,
        "tools": ["t"],
        "tool_mode": ToolChoice.REQUIRED,
        "response_format": {"type": "json_object"},
        "reasoning_effort": "low",
        "session_id": "s",
        "additional_properties": {"k": 1},
        "reasoning": ReasoningOptions(effort="high"),
        "cache": CacheMode.REFRESH,
    }
    assert set(values) == {f.name for f in dataclasses.fields(ChatOptions)}
    options = ChatOptions(**values)
    clone = options.clone()
    assert type(clone) is ChatOptions
    assert {name: getattr(clone, name) for name in values} == values


@pytest.mark.parametrize("session_id", [None, "s-1"])
def test_session_options_are_the_defaults_with_a_session(session_id: str | None) -> None:
    # Made on a bare instance: a field added to ChatOptions must be set there too (the
    # comparison reads every field; one left unset raises).
    options = session_options(session_id)
    assert type(options) is ChatOptions
    assert options == ChatOptions(session_id=session_id)
    assert options.additional_properties is not session_options(session_id).additional_properties


def test_a_checked_message_is_the_message_init_makes() -> None:
    contents: list[Any] = [checked_text("hi")]
    message = checked_message(ChatRole.USER, contents)
    assert type(message) is ChatMessage and message.contents is contents
    assert message == ChatMessage(ChatRole.USER, "hi")  # every field read: none left unset
    assert [getattr(message, f.name) for f in dataclasses.fields(ChatMessage)] == [
        ChatRole.USER,
        [TextContent("hi")],
        None,
        None,
    ]


def test_options_clone_normalises_a_tool_mode_string_set_after_construction() -> None:
    options = ChatOptions()
    options.tool_mode = "required"  # type: ignore[assignment]
    with pytest.warns(DeprecationWarning, match="tool_mode as a string"):
        clone = options.clone()
    assert clone.tool_mode is ToolChoice.REQUIRED


def nested(depth: int) -> dict[str, Any]:
    """``{"a": [{"a": [... {} ...]}]}``: `depth` dicts, each holding the next in a list."""
    root: dict[str, Any] = {}
    current = root
    for _ in range(depth - 1):
        inner: dict[str, Any] = {}
        current["a"] = [inner]
        current = inner
    return root


def depth_of(value: dict[str, Any]) -> int:
    depth = 1
    while value:
        value = value["a"][0]
        depth += 1
    return depth


@pytest.mark.parametrize("depth", [800, 100_000])
def test_clone_copies_json_nested_at_any_depth(depth: int) -> None:
    # copy.deepcopy recursed once per level and failed from about 500 levels on.
    deep = nested(depth)
    options = ChatOptions(response_format=deep, additional_properties={"deep": deep})
    clone = options.clone()
    assert depth_of(clone.response_format) == depth
    assert depth_of(clone.additional_properties["deep"]) == depth
    inner = clone.response_format
    while inner:
        assert inner is not deep
        inner, deep = inner["a"][0], deep["a"][0]
    inner["changed"] = True
    assert deep == {}


def test_clone_keeps_shared_and_self_referring_structure_and_shares_other_values() -> None:
    schema: dict[str, Any] = {"type": "object"}
    schema["self"] = schema
    model = object()
    shared = [1]
    options = ChatOptions(
        response_format=schema, additional_properties={"x": shared, "y": shared, "m": model}
    )
    clone = options.clone()
    assert (
        clone.response_format is not schema
        and clone.response_format["self"] is clone.response_format
    )
    copied = clone.additional_properties
    assert copied["x"] is copied["y"] and copied["x"] is not shared and copied["x"] == [1]
    assert copied["m"] is model


def test_tool_definitions_are_the_core_tool_type() -> None:
    from collections.abc import Mapping

    from middleware.tools import tool
    from pipeline import ChatTool, ToolDefinition

    @tool
    def lookup(query: str) -> str:
        """Look it up."""
        return query

    class Described:
        def __init__(self) -> None:
            self.name = "described"
            self.description = None
            self.parameters = {"type": "object", "properties": {}}

    openai_format = {"type": "function", "function": {"name": "f", "parameters": {}}}
    messages_format = {"name": "g", "input_schema": {"type": "object"}}
    tools: list[ChatTool] = [lookup, Described(), openai_format, messages_format]
    assert ChatOptions(tools=tools).clone().tools == tools
    assert [isinstance(t, ToolDefinition) for t in tools] == [True, True, False, False]
    assert [isinstance(t, Mapping) for t in tools] == [False, False, True, True]


def test_options_with_replaces_fields_on_a_clone() -> None:
    options = ChatOptions(temperature=0.1)
    changed = options.with_(reasoning_effort="low", temperature=0.5)
    assert (changed.reasoning_effort, changed.temperature) == ("low", 0.5)
    assert (options.reasoning_effort, options.temperature) == (None, 0.1)
    with pytest.raises(TypeError, match="no field 'colour'"):
        options.with_(colour="red")


def test_options_repr_hides_values() -> None:
    options = ChatOptions(additional_properties={"secret": "CANARY"}, model_id="m")
    assert "CANARY" not in repr(options)
    assert "model_id" in repr(options)


def test_usage_adds_treating_none_as_unknown() -> None:
    total = UsageDetails(1, None, 1) + UsageDetails(2, 3, None)
    assert total == UsageDetails(3, 3, 1)


def test_from_updates_joins_text_and_keeps_last_metadata() -> None:
    call = FunctionCallContent("c1", "f", {})
    updates = [
        ChatResponseUpdate(contents=[TextContent("Hel")], response_id="r1", model_id="m"),
        ChatResponseUpdate(contents=[TextContent("lo")]),
        ChatResponseUpdate(contents=[call]),
        ChatResponseUpdate(contents=[], finish_reason="tool_calls", usage=UsageDetails(1, 2, 3)),
    ]
    response = ChatResponse.from_updates(updates)
    assert len(response.messages) == 1
    assert response.messages[0].contents == [TextContent("Hello"), call]
    assert response.text == "Hello"
    assert (response.response_id, response.model_id) == ("r1", "m")
    assert response.finish_reason == "tool_calls"
    assert response.usage == UsageDetails(1, 2, 3)


def test_from_updates_starts_a_message_on_role_change() -> None:
    response = ChatResponse.from_updates(
        [
            ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent("a")]),
            ChatResponseUpdate(role=ChatRole.TOOL, contents=[FunctionResultContent("c", 1)]),
            ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent("b")]),
        ]
    )
    assert [m.role for m in response.messages] == ["assistant", "tool", "assistant"]
    assert response.text == "b"


def test_response_round_trips_through_updates() -> None:
    response = ChatResponse([ChatMessage.assistant("x")], "r", "m", "stop", UsageDetails(1, 1, 2))
    again = ChatResponse.from_updates(response.to_updates())
    assert again == response
    assert ChatResponse.from_updates([]).text == ""


def test_from_updates_joins_text_runs_around_other_contents() -> None:
    call = FunctionCallContent("c1", "f", {})
    response = ChatResponse.from_updates(
        [
            ChatResponseUpdate(contents=[TextContent("a"), TextContent("b")]),
            ChatResponseUpdate(contents=[TextContent(""), call, TextContent("c")]),
            ChatResponseUpdate(contents=[TextContent("d")]),
            ChatResponseUpdate(role=ChatRole.TOOL, contents=[TextContent("t")]),
        ]
    )
    assert [m.contents for m in response.messages] == [
        [TextContent("ab"), call, TextContent("cd")],
        [TextContent("t")],
    ]


def test_the_validated_value_survives_updates_both_ways() -> None:
    response = ChatResponse([ChatMessage.assistant("{}")], value={"checked": True})
    updates = response.to_updates()
    assert updates[-1].value == {"checked": True}
    assert ChatResponse.from_updates(updates) == response
    trailing = ChatResponseUpdate(contents=[], value=42)
    assembled = ChatResponse.from_updates(
        [ChatResponseUpdate(contents=[TextContent("x")]), trailing]
    )
    assert assembled.value == 42 and assembled.text == "x"
    assert (
        ChatResponse.from_updates([ChatResponseUpdate(contents=[TextContent("x")])]).value is None
    )
    assert "checked" not in repr(response)


def test_reasoning_content_repr_hides_text_and_protected_part() -> None:
    from pipeline import ReasoningContent

    content = ReasoningContent("CANARY-thinking", protected="CANARY-signature")
    assert "CANARY" not in repr(content)
    assert "CANARY" not in repr(ChatMessage.assistant([content]))
    with pytest.raises(TypeError, match="protected"):
        ReasoningContent("x", protected=b"bytes")  # type: ignore[arg-type]


def test_from_updates_joins_a_streamed_reasoning_block_until_its_protected_part() -> None:
    from pipeline import ReasoningContent

    updates = [
        ChatResponseUpdate(contents=[ReasoningContent("think ")]),
        ChatResponseUpdate(contents=[ReasoningContent("more")]),
        ChatResponseUpdate(contents=[ReasoningContent("", protected="sig-1")]),
        ChatResponseUpdate(contents=[ReasoningContent("second")]),
        ChatResponseUpdate(contents=[ReasoningContent("", protected="sig-2")]),
        ChatResponseUpdate(contents=[ReasoningContent(protected="enc", redacted=True)]),
        ChatResponseUpdate(contents=[TextContent("answer")]),
    ]
    response = ChatResponse.from_updates(updates)
    (message,) = response.messages
    assert message.contents == [
        ReasoningContent("think more", protected="sig-1"),
        ReasoningContent("second", protected="sig-2"),
        ReasoningContent(protected="enc", redacted=True),
        TextContent("answer"),
    ]
    assert response.text == "answer"


def test_usage_adds_reasoning_and_cache_counts() -> None:
    a = UsageDetails(10, 5, 15, reasoning_tokens=3, cache_read_tokens=8)
    b = UsageDetails(1, 1, 2, cache_write_tokens=4)
    assert a + b == UsageDetails(
        11, 6, 17, reasoning_tokens=3, cache_read_tokens=8, cache_write_tokens=4
    )


def test_options_clone_keeps_reasoning_options() -> None:
    from pipeline import ReasoningOptions

    options = ChatOptions(reasoning=ReasoningOptions(effort="high", budget_tokens=2048))
    assert options.clone().reasoning == ReasoningOptions(effort="high", budget_tokens=2048)
    with pytest.raises(ValueError, match="budget_tokens"):
        ReasoningOptions(budget_tokens=-1)
