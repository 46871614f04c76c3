"""The response-validation layer: shapes, failover, streaming boundaries, no content leaks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pydantic
import pytest

from middleware.response_validation import (
    ResponseValidationChatClient,
    ResponseValidationSettings,
)
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import ChatPipeline, ChatResponse, ChatResponseUpdate, FunctionCallContent
from pipeline.errors import (
    CircuitOpenError,
    FailureKind,
    ResponseValidationError,
    TransientProviderError,
)
from pipeline.testing import ScriptedChatClient, call_tools, collect, fail, hang, reply
from tests.otel import Otel

CANARY = "CANARY-7f3a-response-text"
GOOD = '{"number": "A-1", "total": 12.5, "paid": true}'
GOOD_CHUNKS = ['{"number": "A-1", ', '"total": 12.5, ', '"paid": true}']
BAD = '{"number": "' + CANARY + '", "total": "' + CANARY + '"}'  # total is not a number
BAD_CHUNKS = ['{"number": "' + CANARY + '", ', '"total": "' + CANARY + '"}']


class Invoice(pydantic.BaseModel):
    number: str
    total: float
    paid: bool = False


class Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    number: str


def validated(
    script: Any, validator: Any = Invoice, **options: Any
) -> tuple[ChatPipeline, ScriptedChatClient]:
    inner = ScriptedChatClient(script, name="model")
    chat = ChatPipeline.builder().use_response_validation(validator, **options).build(inner)
    return chat, inner


# -- shapes -------------------------------------------------------------------------------


async def test_a_valid_answer_carries_its_model(streaming: bool) -> None:
    chat, _ = validated(reply(GOOD, chunks=GOOD_CHUNKS))
    result = await collect(chat, "hi", streaming=streaming)
    assert result.error is None and result.text == GOOD
    assert result.response is not None
    assert result.response.value == Invoice(number="A-1", total=12.5, paid=True)


async def test_a_streamed_value_arrives_on_one_extra_update_without_contents() -> None:
    chat, _ = validated(reply(GOOD, chunks=GOOD_CHUNKS))
    result = await collect(chat, "hi", streaming=True)
    assert [u.text for u in result.updates] == [*GOOD_CHUNKS, ""]
    assert [u.value is not None for u in result.updates] == [False, False, False, True]
    assert result.updates[-1].contents == []
    assert ChatResponse.from_updates(result.updates).value == Invoice(
        number="A-1", total=12.5, paid=True
    )


async def test_the_inner_response_is_not_changed() -> None:
    response = ChatResponse.from_updates([ChatResponseUpdate(contents=[])])
    response.messages = (await ScriptedChatClient(GOOD).get_response("x")).messages

    class Fixed(ScriptedChatClient):
        async def get_response(self, messages: Any, options: Any = None) -> ChatResponse:
            return response

    layer = ResponseValidationChatClient(Fixed(), Invoice)
    checked = await layer.get_response("hi")
    assert checked is not response and response.value is None
    assert checked.value == Invoice(number="A-1", total=12.5, paid=True)


async def test_an_invalid_answer_raises_with_locations_and_types_only(streaming: bool) -> None:
    chat, _ = validated(reply(BAD, chunks=BAD_CHUNKS))
    result = await collect(chat, "hi", streaming=streaming)
    error = result.error
    assert isinstance(error, ResponseValidationError)
    assert error.kind is FailureKind.INVALID_RESPONSE
    assert error.problems == (("total", "float_parsing"),)
    assert str(error) == "model: response is not a valid Invoice: 1 problem (total: float_parsing)"
    assert error.__cause__ is None and error.__suppress_context__


async def test_text_that_is_not_json_is_json_invalid(streaming: bool) -> None:
    chat, _ = validated(reply(f"Sure! {CANARY}"))
    error = (await collect(chat, "hi", streaming=streaming)).error
    assert isinstance(error, ResponseValidationError)
    assert error.problems == (("$", "json_invalid"),)
    assert CANARY not in str(error)


async def test_keys_the_model_invented_are_masked() -> None:
    chat, _ = validated(reply('{"number": "1", "' + CANARY + '": 2}'), Strict)
    error = (await collect(chat, "hi", streaming=False)).error
    assert isinstance(error, ResponseValidationError)
    assert error.problems == (("*", "extra_forbidden"),)
    assert CANARY not in str(error)


async def test_nested_locations_keep_field_names_and_indexes() -> None:
    class Line(pydantic.BaseModel):
        price: float

    class Order(pydantic.BaseModel):
        lines: list[Line]
        notes: dict[str, int]

    text = '{"lines": [{"price": 1}, {"price": "x"}], "notes": {"' + CANARY + '": "y"}}'
    chat, _ = validated(reply(text), Order)
    error = (await collect(chat, "hi", streaming=False)).error
    assert isinstance(error, ResponseValidationError)
    assert error.problems == (("lines[1].price", "float_parsing"), ("notes.*", "int_parsing"))


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("```json\n" + GOOD + "\n```", True),
        ("```\n" + GOOD + "\n```\n", True),
        ("  ```JSON\r\n" + GOOD + "\r\n```  ", True),
        ("Here it is:\n```json\n" + GOOD + "\n```", False),
        ("```json\n" + GOOD + "\n```\nand more", False),
        ("```json\n" + GOOD, False),
    ],
)
async def test_fenced_json_only_with_strip_fences(text: str, valid: bool) -> None:
    plain, _ = validated(reply(text))
    assert isinstance((await collect(plain, "hi", streaming=False)).error, ResponseValidationError)
    stripping, _ = validated(reply(text), strip_fences=True)
    result = await collect(stripping, "hi", streaming=False)
    assert (result.error is None) is valid
    if valid:
        assert result.response is not None and result.response.value.number == "A-1"


SCHEMA = {
    "type": "object",
    "required": ["number", "total"],
    "properties": {"number": {"type": "string"}, "total": {"type": "number", "minimum": 0}},
    "additionalProperties": False,
}


async def test_a_json_schema_gives_the_decoded_json(streaming: bool) -> None:
    chat, _ = validated(reply('{"number": "A-1", "total": 3}'), SCHEMA)
    result = await collect(chat, "hi", streaming=streaming)
    assert result.error is None and result.response is not None
    assert result.response.value == {"number": "A-1", "total": 3}


@pytest.mark.parametrize(
    ("text", "problems"),
    [
        ('{"total": -1}', (("number", "required"), ("total", "minimum"))),
        ('{"number": "a", "total": 1, "' + CANARY + '": 1}', (("$", "additionalProperties"),)),
        ('{"number": 5, "total": "' + CANARY + '"}', (("number", "type"), ("total", "type"))),
        ("[" + CANARY, (("$", "json_invalid"),)),
        ('{"number": "a", "total": NaN}', (("$", "json_invalid"),)),
    ],
)
async def test_a_json_schema_reports_keywords_not_values(
    text: str, problems: tuple[tuple[str, str], ...]
) -> None:
    chat, _ = validated(reply(text), SCHEMA)
    error = (await collect(chat, "hi", streaming=False)).error
    assert isinstance(error, ResponseValidationError)
    assert sorted(error.problems) == sorted(problems)
    assert CANARY not in str(error)


async def test_a_sync_check_may_return_the_value(streaming: bool) -> None:
    seen: list[str] = []

    def check(response: ChatResponse) -> int:
        seen.append(response.text)
        if "ok" not in response.text:
            raise ValueError(f"no ok in {response.text}")
        return len(response.text)

    chat, _ = validated(reply("it is ok"), check)
    result = await collect(chat, "hi", streaming=streaming)
    assert result.response is not None and result.response.value == 8
    assert seen == ["it is ok"]
    bad, _ = validated(reply(CANARY), check)
    error = (await collect(bad, "hi", streaming=streaming)).error
    assert isinstance(error, ResponseValidationError)
    assert error.problems == (("$", "ValueError"),)
    assert "check" in str(error) and CANARY not in str(error)
    assert error.__cause__ is None and error.__suppress_context__


async def test_an_async_check_is_awaited(streaming: bool) -> None:
    async def check(response: ChatResponse) -> str:
        await asyncio.sleep(0)
        if response.text != "yes":
            raise ResponseValidationError("not yes", problems=[("$", "not_yes")])
        return "checked"

    chat, _ = validated(reply("yes"), check)
    result = await collect(chat, "hi", streaming=streaming)
    assert result.response is not None and result.response.value == "checked"
    bad, _ = validated(reply("no"), check)
    error = (await collect(bad, "hi", streaming=streaming)).error
    assert isinstance(error, ResponseValidationError)
    assert error.problems == (("$", "not_yes"),) and str(error) == "model: not yes"


async def test_a_check_returning_none_adds_no_update() -> None:
    chat, _ = validated(reply("x", chunks=["x"]), lambda response: None)
    result = await collect(chat, "hi", streaming=True)
    assert [u.text for u in result.updates] == ["x"]
    assert result.response is not None and result.response.value is None


async def test_a_turn_asking_for_tools_is_not_validated(streaming: bool) -> None:
    call = FunctionCallContent("c1", "lookup", {"q": 1})
    chat, _ = validated(call_tools(call))
    result = await collect(chat, "hi", streaming=streaming)
    assert result.error is None and result.response is not None
    assert result.response.value is None
    assert result.updates[-1].contents == [call]


async def test_the_inner_failure_passes_through_unchanged(streaming: bool) -> None:
    failure = TransientProviderError(status_code=503)
    chat, _ = validated(fail(failure), buffer_streams=True)
    assert (await collect(chat, "hi", streaming=streaming)).error is failure


# -- streaming boundaries -----------------------------------------------------------------


async def test_unbuffered_updates_flow_before_the_stream_ends() -> None:
    chat, inner = validated(reply(GOOD, chunks=GOOD_CHUNKS))
    async with contextlib.aclosing(chat.get_streaming_response("hi")) as stream:
        first = await anext(stream)
        assert first.text == GOOD_CHUNKS[0]
        assert inner.streams_closed == 0
        rest = [u async for u in stream]
    assert "".join(u.text for u in [first, *rest]) == GOOD


async def test_buffered_updates_wait_for_the_whole_response() -> None:
    chat, inner = validated(reply(GOOD, chunks=GOOD_CHUNKS), buffer_streams=True)
    async with contextlib.aclosing(chat.get_streaming_response("hi")) as stream:
        first = await anext(stream)
        assert first.text == GOOD_CHUNKS[0]
        assert inner.streams_closed == 1  # read to the end and validated before release
        rest = [u async for u in stream]
    assert [u.text for u in rest] == [*GOOD_CHUNKS[1:], ""]
    assert rest[-1].value == Invoice(number="A-1", total=12.5, paid=True)


async def test_unbuffered_invalid_stream_fails_after_its_output() -> None:
    chat, inner = validated(reply(BAD, chunks=BAD_CHUNKS))
    result = await collect(chat, "hi", streaming=True)
    assert [u.text for u in result.updates] == BAD_CHUNKS
    assert isinstance(result.error, ResponseValidationError)
    assert inner.streams_closed == 1


async def test_buffered_invalid_stream_fails_before_any_output() -> None:
    chat, inner = validated(reply(BAD, chunks=BAD_CHUNKS), buffer_streams=True)
    result = await collect(chat, "hi", streaming=True)
    assert result.updates == [] and isinstance(result.error, ResponseValidationError)
    assert inner.streams_closed == 1


@pytest.mark.parametrize("buffer_streams", [False, True])
async def test_an_empty_invalid_stream_fails_before_output(buffer_streams: bool) -> None:
    chat, _ = validated(reply(""), buffer_streams=buffer_streams)
    result = await collect(chat, "hi", streaming=True)
    assert result.updates == [] and isinstance(result.error, ResponseValidationError)


async def test_abandoning_an_unbuffered_stream_closes_it_and_validates_nothing() -> None:
    calls: list[str] = []

    def check(response: ChatResponse) -> None:
        calls.append(response.text)

    chat, inner = validated(reply(GOOD, chunks=GOOD_CHUNKS), check)
    stream = chat.get_streaming_response("hi")
    assert (await anext(stream)).text == GOOD_CHUNKS[0]
    await stream.aclose()
    assert (inner.streams_abandoned, inner.streams_closed) == (1, 1)
    assert calls == []


async def test_closing_a_buffered_stream_before_reading_opens_nothing() -> None:
    chat, inner = validated(reply(GOOD), buffer_streams=True)
    await chat.get_streaming_response("hi").aclose()
    assert inner.call_count == 0


@pytest.mark.parametrize("buffer_streams", [False, True])
async def test_cancellation_passes_through_and_closes_the_inner_stream(
    streaming: bool, buffer_streams: bool
) -> None:
    chat, inner = validated(hang(after=["{"]), buffer_streams=buffer_streams)
    task = asyncio.create_task(collect(chat, "hi", streaming=streaming))
    await inner.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if streaming:
        assert inner.streams_closed == 1


# -- on a route, beneath a router ---------------------------------------------------------


def route(
    name: str, script: Any, otel: Otel | None = None, **options: Any
) -> tuple[Route, ScriptedChatClient]:
    client = ScriptedChatClient(script, name=name)
    builder = ChatPipeline.builder(**(otel.providers if otel else {}))
    chat = builder.use_response_validation(Invoice, **options).build(client, name=name)
    return Route(name, chat), client


def attempts(otel: Otel) -> list[tuple[str, Any, Any]]:
    return [
        (
            s.name,
            (s.attributes or {}).get("chat_pipeline.route.outcome"),
            (s.attributes or {}).get("error.type"),
        )
        for s in otel.attempt_spans()
    ]


async def test_a_malformed_answer_fails_over_to_a_valid_route(
    otel: Otel, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # buffer_streams: a streamed malformed answer is still a failure before output.
    small, small_client = route("small", reply(BAD, chunks=BAD_CHUNKS), buffer_streams=True)
    large, large_client = route("large", reply(GOOD, chunks=GOOD_CHUNKS), buffer_streams=True)
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_logging()
        .use_ordered_failover([small, large])
        .build()
    )
    with caplog.at_level(logging.DEBUG):
        result = await collect(chat, "hi", streaming=streaming)
    assert result.error is None and result.text == GOOD
    assert result.response is not None
    assert result.response.value == Invoice(number="A-1", total=12.5, paid=True)
    assert (small_client.call_count, large_client.call_count) == (1, 1)
    assert "".join(u.text for u in result.updates) == GOOD  # nothing of the bad answer
    assert attempts(otel) == [
        ("route_attempt small", "failed_before_output", "ResponseValidationError"),
        ("route_attempt large", "completed", None),
    ]
    exported = "\n".join(otel.everything_exported())
    assert CANARY not in exported and CANARY not in caplog.text


async def test_unbuffered_streamed_malformed_answer_is_terminal_after_output(
    otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    small, small_client = route("small", reply(BAD, chunks=BAD_CHUNKS))
    large, large_client = route("large", reply(GOOD))
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_logging()
        .use_ordered_failover([small, large])
        .build()
    )
    with caplog.at_level(logging.DEBUG):
        result = await collect(chat, "hi", streaming=True)
    assert [u.text for u in result.updates] == BAD_CHUNKS
    error = result.error
    assert isinstance(error, ResponseValidationError)
    assert (small_client.call_count, large_client.call_count) == (1, 0)
    assert attempts(otel) == [
        ("route_attempt small", "failed_after_output", "ResponseValidationError")
    ]
    assert (
        otel.total(
            "chat_pipeline.route.output_committed_failures", **{"chat_pipeline.route.name": "small"}
        )
        == 1
    )
    exported = "\n".join(otel.everything_exported())
    assert CANARY not in str(error) and CANARY not in repr(error)
    assert CANARY not in exported and CANARY not in caplog.text


async def test_unbuffered_non_streaming_still_fails_over(otel: Otel) -> None:
    small, _ = route("small", reply(BAD))
    large, _ = route("large", reply(GOOD))
    chat = OrderedFailoverChatClient([small, large], **otel.providers)  # type: ignore[arg-type]
    result = await collect(chat, "hi", streaming=False)
    assert result.response is not None and result.response.value.number == "A-1"
    assert [a[1] for a in attempts(otel)] == ["failed_before_output", "completed"]


async def test_every_route_malformed_raises_the_last_validation_error(streaming: bool) -> None:
    small, _ = route("small", reply(BAD), buffer_streams=True)
    large, _ = route("large", reply("not json"), buffer_streams=True)
    chat = OrderedFailoverChatClient([small, large])
    error = (await collect(chat, "hi", streaming=streaming)).error
    assert isinstance(error, ResponseValidationError)
    assert error.provider == "large" and error.problems == (("$", "json_invalid"),)


# -- with the route's own resilience layers -----------------------------------------------


async def test_the_breaker_above_counts_malformed_answers(streaming: bool) -> None:
    inner = ScriptedChatClient(reply(BAD), name="model")
    chat = (
        ChatPipeline.builder()
        .use_circuit_breaker(fail_max=2, reset_timeout=60)
        .use_response_validation(Invoice, buffer_streams=True)
        .build(inner)
    )
    for _ in range(2):
        error = (await collect(chat, "hi", streaming=streaming)).error
        assert isinstance(error, ResponseValidationError)
    assert isinstance((await collect(chat, "hi", streaming=streaming)).error, CircuitOpenError)
    assert inner.call_count == 2


async def test_the_retry_layer_does_not_retry_by_default(streaming: bool) -> None:
    inner = ScriptedChatClient([reply(BAD), reply(GOOD)], name="model")
    chat = (
        ChatPipeline.builder()
        .use_retry(max_attempts=3, initial_delay=0)
        .use_response_validation(Invoice, buffer_streams=True)
        .build(inner)
    )
    assert isinstance(
        (await collect(chat, "hi", streaming=streaming)).error, ResponseValidationError
    )
    assert inner.call_count == 1


async def test_the_retry_layer_retries_when_told(streaming: bool) -> None:
    inner = ScriptedChatClient([reply(BAD), reply(GOOD)], name="model")
    chat = (
        ChatPipeline.builder()
        .use_retry(
            max_attempts=3,
            initial_delay=0,
            retry_on=lambda exc: isinstance(exc, ResponseValidationError),
        )
        .use_response_validation(Invoice, buffer_streams=True)
        .build(inner)
    )
    result = await collect(chat, "hi", streaming=streaming)
    assert result.response is not None and result.response.value.number == "A-1"
    assert inner.call_count == 2


# -- construction -------------------------------------------------------------------------


def test_describe_and_enabled() -> None:
    inner = ScriptedChatClient(name="model")
    chat = ChatPipeline.builder().use_response_validation(Invoice, buffer_streams=True).build(inner)
    assert chat.describe() == [
        "ResponseValidationChatClient(Invoice, buffered)",
        "ScriptedChatClient(model)",
    ]
    off = ChatPipeline.builder().use_response_validation(Invoice, enabled=False).build(inner)
    assert off.describe() == ["ScriptedChatClient(model)"]
    assert ResponseValidationChatClient(inner, SCHEMA).describe_layer() == (
        "ResponseValidationChatClient(JSON schema)"
    )


@pytest.mark.parametrize(
    ("validator", "error", "match"),
    [
        (42, TypeError, "pydantic model class, a JSON schema"),
        (dict, TypeError, "not a pydantic model"),
        ({"type": "no-such-type"}, ValueError, "invalid JSON schema"),
        ({"type": "object", "required": "number"}, ValueError, "at required, the 'type' rule"),
        ({"$ref": "https://example.invalid/s.json"}, ValueError, "points outside the schema"),
        ({"enum": [{1, 2}]}, ValueError, "only JSON values"),
    ],
)
def test_a_bad_validator_fails_where_it_is_written(
    validator: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ChatPipeline.builder().use_response_validation(validator)


def test_settings_are_checked() -> None:
    with pytest.raises(TypeError, match="buffer_streams must be true or false"):
        ResponseValidationSettings(buffer_streams="yes")
    with pytest.raises(ValueError, match="unknown setting"):
        ResponseValidationChatClient(ScriptedChatClient(), Invoice, buffer=True)
    settings = ResponseValidationSettings(buffer_streams=True)
    layer = ResponseValidationChatClient(ScriptedChatClient(), Invoice, settings, strip_fences=True)
    assert layer.settings == ResponseValidationSettings(buffer_streams=True, strip_fences=True)


async def test_beneath_the_tool_loop_only_the_answer_is_validated(streaming: bool) -> None:
    from middleware.tools import tool

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        return "found"

    inner = ScriptedChatClient(
        [call_tools(FunctionCallContent("c1", "lookup", {"q": "x"})), reply(GOOD)], name="m"
    )
    chat = (
        ChatPipeline.builder()
        .use_function_invocation([lookup])
        .use_response_validation(Invoice)
        .build(inner)
    )
    result = await collect(chat, "hi", streaming=streaming)
    assert result.error is None and inner.call_count == 2
    assert result.response is not None
    assert result.response.value == Invoice(number="A-1", total=12.5, paid=True)


async def test_buffered_mid_stream_failure_is_still_before_output(otel: Otel) -> None:
    from pipeline.testing import fail_after

    small, _ = route("small", fail_after(["{"], TransientProviderError()), buffer_streams=True)
    large, _ = route("large", reply(GOOD, chunks=GOOD_CHUNKS), buffer_streams=True)
    chat = OrderedFailoverChatClient([small, large], **otel.providers)  # type: ignore[arg-type]
    result = await collect(chat, "hi", streaming=True)
    assert result.error is None and "".join(u.text for u in result.updates) == GOOD
    assert attempts(otel) == [
        ("route_attempt small", "failed_before_output", "TransientProviderError"),
        ("route_attempt large", "completed", None),
    ]
