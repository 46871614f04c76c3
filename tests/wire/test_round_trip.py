"""Each API through the gateway to a route of the same API and back: the conversation, its
tools and tool choice reach the upstream byte for byte as the client wrote them, and the
upstream's answer reaches the client saying what it said (text, tool calls and their
arguments, why it stopped, usage), in both call shapes. Only what the gateway owns differs
(the answer's own id and timestamps, the JSON spacing of arguments it decoded), and the call
ids, which the fake makes anew for every answer."""

from __future__ import annotations

import json

import httpx
import pytest

from pipeline.config import parse_config
from pipeline.testing import FakeResponse
from pipeline.testing._fake_server import FakeServer
from tests.pipeline.gateway.conftest import running
from tests.wire.apis import INBOUND, SCHEMA, WireApi, sent

pytestmark = pytest.mark.gateway

ANSWER = FakeResponse(
    text="Rain later.",
    tool_calls=[("get_weather", '{"city": "Paris"}')],
    usage=(10, 5),
    cache_usage=(2, 3),
    reasoning_tokens=1,
)


@pytest.mark.parametrize("api", INBOUND, ids=[api.name for api in INBOUND], indirect=True)
async def test_a_conversation_crosses_the_gateway_unchanged(
    api: WireApi, upstream: FakeServer, streaming: bool
) -> None:
    assert api.inbound is not None
    form = api.inbound
    body = form.request(
        tools=[form.tool("get_weather", "The weather in a city.", SCHEMA)],
        tool_choice=api.named("get_weather"),
        stream=streaming or None,
        **form.sample,
        **(form.stream_fields if streaming else {}),
    )
    upstream.script(ANSWER, ANSWER, path=api.path)
    headers = {"x-api-key": "unused", **form.headers}
    async with (
        running(parse_config({"routes": {"route": api.route(upstream)}})) as gateway,
        httpx.AsyncClient() as http,
    ):
        through = await http.post(gateway.url + form.path, json=body, headers=headers)
        # The same request straight to the upstream: what it answers without the gateway.
        forwarded = sent(upstream)
        straight = await http.post(upstream.origin + api.path, json=forwarded, headers=headers)
    assert (through.status_code, straight.status_code) == (200, 200), through.text
    for name in form.conversation:
        assert json.dumps(forwarded.get(name)) == json.dumps(body.get(name)), name
    # The fake gives each answer call ids of its own: they are compared by position.
    answered, expected = form.read(through.text, streaming), form.read(straight.text, streaming)
    assert answered.calls and all(call_id for call_id, _, _ in answered.calls)
    assert answered.without_ids() == expected.without_ids()
