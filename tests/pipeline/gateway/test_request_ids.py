"""Request ids: kept or made, echoed on every response (errors too), on the server span and
in the log line, with the official `openai` SDK reading them (its ``request_id``)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import httpx
import openai
import pytest

from pipeline._semconv import GATEWAY_REQUEST_ID
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.otel import Otel
from tests.pipeline.gateway.conftest import config, keyed, running

pytestmark = pytest.mark.gateway

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
FRESH = re.compile(r"^req_[0-9a-f]+$")


async def test_the_sdk_gets_a_request_id_for_answers_streams_and_errors(
    primary: FakeOpenAIServer, otel: Otel, streaming: bool
) -> None:
    async with running(config({"primary": primary}), **otel.providers) as gateway:
        client = gateway.client()
        if streaming:
            stream = await client.chat.completions.create(
                model="pipeline", messages=MESSAGES, stream=True
            )
            ids = {chunk.id async for chunk in stream}
            request_id = stream.response.headers["x-request-id"]
            (response_id,) = ids
        else:
            completion = await client.chat.completions.create(model="pipeline", messages=MESSAGES)
            request_id, response_id = completion._request_id, completion.id
        assert request_id is not None and FRESH.match(request_id)
        primary.script(FakeResponse.error(503))
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(
                model="pipeline", messages=MESSAGES, stream=streaming
            )
        error_id = raised.value.request_id
        assert error_id is not None and FRESH.match(error_id) and error_id != request_id
        await gateway.gateway.wait_idle()
        await client.close()
    # The server span carries both ids: the one the client holds finds its trace.
    answered, failed = [s for s in otel.finished() if s.name == "POST /v1/chat/completions"]
    assert answered.attributes[GATEWAY_REQUEST_ID] == (request_id,)
    assert answered.attributes["gen_ai.response.id"] == response_id
    assert failed.attributes[GATEWAY_REQUEST_ID] == (error_id,)


async def test_a_valid_incoming_id_is_kept_and_an_invalid_one_replaced(
    primary: FakeOpenAIServer, streaming: bool
) -> None:
    async with running(config({"primary": primary})) as gateway:
        client = gateway.client()
        mine = "trace-7f3a:" + "x" * 240  # 251 printable characters
        for sent, kept in [
            (mine, True),
            ("x" * 257, False),  # too long
            ("bad\tid", False),  # a tab is not printable
            ("", False),
        ]:
            raw = await client.chat.completions.with_raw_response.create(
                model="pipeline",
                messages=MESSAGES,
                stream=streaming,
                extra_headers={"x-request-id": sent},
            )
            got = raw.headers["x-request-id"]
            assert (got == sent) is kept
            if not kept:
                assert FRESH.match(got)
            parsed = raw.parse()
            if streaming:
                assert [chunk async for chunk in parsed]
        await client.close()


async def test_every_response_carries_the_id_errors_included(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(
        {"primary": primary},
        gateway={
            **keyed(monkeypatch, "key-1"),
            "max_body_bytes": 2048,
            "max_concurrent_per_key": 1,
        },
    )
    key = {"authorization": "Bearer key-1"}
    body = {"model": "pipeline", "messages": MESSAGES}
    async with running(cfg) as gateway, httpx.AsyncClient(base_url=gateway.url) as http:
        chat = "/v1/chat/completions"
        not_found = await http.post(chat, json={**body, "model": "nope"}, headers=key)
        primary.script(FakeResponse(hang=True))
        busy = asyncio.create_task(http.post(chat, json=body, headers=key))
        await primary.wait_for_requests(1)
        answers = {
            "429": await http.post(chat, json=body, headers=key),
            "401": await http.post(chat, json=body),
            "404": not_found,
            "405": await http.get(chat, headers=key),
            "413": await http.post(
                chat,
                json={**body, "messages": [{"role": "user", "content": "x" * 4000}]},
                headers=key,
            ),
            "415": await http.post(
                chat, content=json.dumps(body), headers={**key, "content-type": "text/plain"}
            ),
            "400": await http.post(chat, content=b"{nope", headers=key),
            "models": await http.get("/v1/models", headers=key),
            "model": await http.get("/v1/models/primary", headers=key),
            "models-401": await http.get("/v1/models"),
            "healthz": await http.get("/healthz"),
            "unknown": await http.get("/v2/nothing", headers={"x-request-id": "mine-1"}),
        }
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy
    ids = {name: response.headers.get("x-request-id") for name, response in answers.items()}
    assert ids.pop("unknown") == "mine-1"
    assert all(value is not None and FRESH.match(value) for value in ids.values()), ids
    assert len(set(ids.values())) == len(ids)  # one id per request
    statuses = {name: response.status_code for name, response in answers.items()}
    assert statuses == {
        "429": 429,
        "401": 401,
        "404": 404,
        "405": 405,
        "413": 413,
        "415": 415,
        "400": 400,
        "models": 200,
        "model": 200,
        "models-401": 401,
        "healthz": 200,
        "unknown": 404,
    }


async def test_the_requests_log_line_carries_its_id(
    primary: FakeOpenAIServer, caplog: pytest.LogCaptureFixture, streaming: bool
) -> None:
    caplog.set_level(logging.INFO, logger="chat_pipeline")
    cfg = config({"primary": primary}, layers={"logging": True})
    primary.script(FakeResponse.error(503))
    async with running(cfg) as gateway:
        client = gateway.client()
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(
                model="pipeline", messages=MESSAGES, stream=streaming
            )
        await gateway.gateway.wait_idle()
        await client.close()
    request_id = raised.value.request_id
    lines = [r.getMessage() for r in caplog.records if r.name == "chat_pipeline.gateway"]
    (line,) = [line for line in lines if "POST /v1/chat/completions" in line]
    assert f"request_id={request_id}" in line
