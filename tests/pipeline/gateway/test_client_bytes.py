"""What a client wrote never reaches a response header or a log line raw: a built-in tool's
type is validated before anything is called (a 400 in the format's own shape), and the
model name and request id the line shows are escaped, so a client can neither break a
response nor forge a log line. All three formats, both call shapes."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from pipeline.testing import FakeOpenAIServer
from tests.pipeline.gateway.conftest import config, running

pytestmark = pytest.mark.gateway

FORGED = "\r\nINFO:     POST /v1/messages 200 1.0 ms request_id=forged"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def body(path: str, model: str, streaming: bool) -> dict[str, Any]:
    if path == "/v1/messages":
        return {"model": model, "max_tokens": 16, "messages": MESSAGES, "stream": streaming}
    if path == "/v1/responses":
        return {"model": model, "input": "hi", "stream": streaming}
    return {"model": model, "messages": MESSAGES, "stream": streaming}


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The request lines (the worker's startup lines left out)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "chat_pipeline.gateway" and r.getMessage().startswith("POST ")
    ]


@pytest.mark.parametrize(
    "kind",
    ["web_search_é", "web_search_20250305\r\nx-evil: 1", "web_search_\x00", "web_fetch_\u2028"],
)
async def test_a_server_tool_type_that_is_no_token_is_400_before_any_call(
    primary: FakeOpenAIServer, caplog: pytest.LogCaptureFixture, streaming: bool, kind: str
) -> None:
    caplog.set_level(logging.INFO, logger="chat_pipeline.gateway")
    request = body("/v1/messages", "pipeline", streaming)
    request["tools"] = [{"type": kind, "name": "web_search"}]
    async with running(config({"primary": primary})) as gateway, httpx.AsyncClient() as http:
        response = await http.post(f"{gateway.url}/v1/messages", json=request)
        await gateway.gateway.wait_idle()
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "x-chat-pipeline-builtin-tools" not in response.headers
    assert primary.count() == 0  # nothing was called, nothing billed
    (line,) = lines(caplog)
    assert " 400 " in line and "\n" not in line and "\r" not in line


async def test_a_valid_server_tool_type_is_said_in_the_header(
    primary: FakeOpenAIServer, streaming: bool
) -> None:
    request = body("/v1/messages", "pipeline", streaming)
    request["tools"] = [{"type": "web_search_20250305", "name": "web_search"}]
    async with running(config({"primary": primary})) as gateway, httpx.AsyncClient() as http:
        response = await http.post(f"{gateway.url}/v1/messages", json=request)
    assert response.status_code == 200, response.text
    assert response.headers["x-chat-pipeline-builtin-tools"] == "dropped=web_search_20250305"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("table", ["pattern", "default"])
async def test_the_model_a_client_wrote_cannot_forge_a_log_line(
    primary: FakeOpenAIServer,
    caplog: pytest.LogCaptureFixture,
    streaming: bool,
    path: str,
    table: str,
) -> None:
    caplog.set_level(logging.INFO, logger="chat_pipeline.gateway")
    # A pattern takes any name (the request is served); the default table none of these.
    models = {"claude-*": "pipeline"} if table == "pattern" else None
    cfg = config({"primary": primary}, gateway={"models": models} if models else None)
    model = f"claude-x route=evil key=#9{FORGED}"
    async with running(cfg) as gateway, httpx.AsyncClient() as http:
        # Twice: the second line shows the model name as the gateway kept it from the first.
        for _ in range(2):
            response = await http.post(
                f"{gateway.url}{path}",
                json=body(path, model, streaming),
                headers={"x-request-id": "id route=evil"},
            )
            await gateway.gateway.wait_idle()
            assert response.status_code == (200 if table == "pattern" else 404), response.text
    logged = lines(caplog)
    assert len(logged) == 2
    for line in logged:
        assert "\n" not in line and "\r" not in line
        # Quoted whole, with the line break escaped: no field of the line is the client's.
        assert ' request_id="id route=evil" ' in line
        assert 'model="claude-x route=evil key=#9\\r\\nINFO:' in line
