"""Tool choice in every wire API, a tool named ``none`` above all: a choice naming it tells
the model to call that tool, never to call none, from the providers (each API) and through
the gateway (each inbound format to a route of each API), in both call shapes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pipeline.config import parse_config
from pipeline.testing import FakeResponse, collect
from pipeline.testing._fake_server import FakeServer
from pipeline.types import ChatOptions, FunctionTool, ToolChoice
from tests.pipeline.gateway.conftest import running
from tests.wire.apis import INBOUND, SCHEMA, WireApi, sent

NONE_TOOL = FunctionTool("none", "A tool whose name is a tool-choice word.", SCHEMA)
OTHER_TOOL = FunctionTool("auto", "Another such tool.", SCHEMA)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (ToolChoice.named("none"), lambda api: api.named("none")),
        (ToolChoice.named("auto"), lambda api: api.named("auto")),
        (ToolChoice.NONE, lambda api: api.none),
    ],
    ids=["named-none", "named-auto", "NONE"],
)
async def test_a_provider_sends_the_choice_its_api_means(
    api: WireApi, upstream: FakeServer, streaming: bool, choice: ToolChoice, expected: Any
) -> None:
    options = ChatOptions(tools=[NONE_TOOL, OTHER_TOOL], tool_mode=choice)
    async with api.client(upstream, "route") as chat:
        result = await collect(chat, "hi", options, streaming=streaming)
    assert result.error is None
    assert api.choice(sent(upstream)) == expected(api)


async def test_a_string_tool_mode_still_works_and_says_it_is_deprecated(
    api: WireApi, upstream: FakeServer
) -> None:
    with pytest.warns(DeprecationWarning, match="ToolChoice"):
        options = ChatOptions(tools=[FunctionTool("get_weather")], tool_mode="get_weather")
    with pytest.warns(DeprecationWarning, match="ToolChoice"):
        none = ChatOptions(tools=[FunctionTool("get_weather")], tool_mode="none")
    async with api.client(upstream, "route") as chat:
        await chat.get_response("hi", options)
        assert api.choice(sent(upstream)) == api.named("get_weather")
        await chat.get_response("hi", none)
        assert api.choice(sent(upstream)) == api.none


def test_a_mode_word_as_a_string_is_refused_when_a_tool_has_that_name() -> None:
    with (
        pytest.warns(DeprecationWarning, match="ToolChoice"),
        pytest.raises(ValueError, match="ambiguous"),
    ):
        ChatOptions(tools=[NONE_TOOL], tool_mode="none")
    options = ChatOptions(tools=[NONE_TOOL])
    with (
        pytest.warns(DeprecationWarning, match="ToolChoice"),
        pytest.raises(ValueError, match=r"named\('none'\)"),
    ):
        options.with_(tool_mode="none")
    assert ChatOptions(tools=[NONE_TOOL], tool_mode=ToolChoice.named("none")).tool_mode == (
        ToolChoice.named("none")
    )
    assert ToolChoice.named("none") != ToolChoice.NONE


@pytest.mark.gateway
@pytest.mark.parametrize("inbound", INBOUND, ids=[api.name for api in INBOUND])
async def test_the_gateway_passes_a_choice_of_a_tool_named_none_to_every_api(
    api: WireApi, upstream: FakeServer, streaming: bool, inbound: WireApi
) -> None:
    assert inbound.inbound is not None
    form = inbound.inbound
    upstream.script(
        FakeResponse(text="", tool_calls=[("none", '{"city": "Paris"}')]), path=api.path
    )
    body = form.request(
        messages=[{"role": "user", "content": "hi"}],
        tools=[form.tool("none", "A tool whose name is a tool-choice word.", SCHEMA)],
        tool_choice=inbound.named("none"),
        stream=streaming or None,
    )
    async with (
        running(parse_config({"routes": {"route": api.route(upstream)}})) as gateway,
        httpx.AsyncClient(base_url=gateway.url) as http,
    ):
        answer = await http.post(
            form.path, json=body, headers={"x-api-key": "unused", **form.headers}
        )
    assert answer.status_code == 200, answer.text
    assert api.choice(sent(upstream)) == api.named("none")
    # The model's call of that tool reaches the client (its arguments say Paris).
    assert "Paris" in (answer.text if streaming else json.dumps(answer.json()))
