"""The gateway's own telemetry: the server span tells the routing story, the HTTP duration
histogram has buckets fit for LLM requests, and every request logs one line."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from pipeline._metrics import DURATION_BUCKETS
from pipeline.gateway._auth import key_identity
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.otel import Otel
from tests.pipeline.gateway.conftest import config, keyed, running
from tests.processes import run_python

pytestmark = pytest.mark.gateway

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def server_span(otel: Otel) -> ReadableSpan:
    (span,) = [s for s in otel.finished() if s.kind is SpanKind.SERVER]
    return span


async def ask(client: openai.AsyncOpenAI, streaming: bool, model: str = "pipeline") -> str:
    if streaming:
        stream = await client.chat.completions.create(model=model, messages=MESSAGES, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    response = await client.chat.completions.create(model=model, messages=MESSAGES)
    return response.choices[0].message.content or ""


@pytest.mark.parametrize("layer", [True, False], ids=["telemetry-layer", "no-telemetry-layer"])
async def test_the_server_span_shows_the_served_model_and_the_fallback(
    primary: FakeOpenAIServer,
    backup: FakeOpenAIServer,
    otel: Otel,
    streaming: bool,
    layer: bool,
) -> None:
    cfg = config({"primary": primary, "backup": backup}, layers={"telemetry": layer})
    primary.script(FakeResponse.error(503))
    async with running(cfg, **otel.providers) as gateway:
        client = gateway.client()
        raw = await client.chat.completions.with_raw_response.create(
            model="pipeline", messages=MESSAGES, stream=streaming
        )
        parsed = raw.parse()
        response_id = (
            next(iter({c.id async for c in parsed})) if streaming else parsed.id  # type: ignore[union-attr]
        )
        await gateway.gateway.wait_idle()
        await client.close()
    span = server_span(otel)
    assert span.parent is None  # no traceparent came: the gateway's span is the root
    attributes = span.attributes or {}
    assert attributes["chat_pipeline.route.name"] == "backup"
    assert attributes["chat_pipeline.route.attempts"] == 2
    assert attributes["chat_pipeline.route.fallback"] is True
    assert attributes["gen_ai.response.model"] == "model-backup"
    assert attributes["gen_ai.response.id"] == response_id
    assert attributes["openinference.span.kind"] == "CHAIN"
    assert attributes["chat_pipeline.gateway.model"] == "pipeline"
    assert attributes["http.response.header.x-request-id"] == (raw.headers["x-request-id"],)
    assert span.status.status_code is StatusCode.UNSET


async def test_a_route_asked_for_by_name_is_its_own_story(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, otel: Otel, streaming: bool
) -> None:
    cfg = config({"primary": primary, "backup": backup})
    async with running(cfg, **otel.providers) as gateway:
        client = gateway.client()
        assert await ask(client, streaming, model="backup") == "Hello from the fake server."
        await gateway.gateway.wait_idle()
        await client.close()
    attributes = server_span(otel).attributes or {}
    assert (attributes["chat_pipeline.route.name"], attributes["chat_pipeline.route.attempts"]) == (
        "backup",
        1,
    )
    assert attributes["chat_pipeline.route.fallback"] is False
    assert attributes["gen_ai.response.model"] == "model-backup"


async def test_a_request_every_route_failed_names_the_last_route_tried(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, otel: Otel, streaming: bool
) -> None:
    cfg = config({"primary": primary, "backup": backup}, layers={"telemetry": True})
    primary.script(FakeResponse.error(503))
    backup.script(FakeResponse.error(503))
    async with running(cfg, **otel.providers) as gateway:
        client = gateway.client()
        with pytest.raises(openai.InternalServerError):
            await ask(client, streaming)
        await gateway.gateway.wait_idle()
        await client.close()
    span = server_span(otel)
    attributes = span.attributes or {}
    assert (attributes["chat_pipeline.route.name"], attributes["chat_pipeline.route.attempts"]) == (
        "backup",
        2,
    )
    assert attributes["http.response.status_code"] == 503
    assert attributes["error.type"] == "TransientProviderError"
    assert "gen_ai.response.model" not in attributes
    assert span.status.status_code is StatusCode.ERROR


async def test_http_duration_uses_buckets_fit_for_llm_requests(
    primary: FakeOpenAIServer, otel: Otel
) -> None:
    async with running(config({"primary": primary}), **otel.providers) as gateway:
        client = gateway.client()
        await ask(client, False)
        await gateway.gateway.wait_idle()
        await client.close()
    data = otel.reader.get_metrics_data()
    assert data is not None
    (point,) = [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "http.server.request.duration"
        for point in metric.data.data_points
    ]
    bounds = list(point.explicit_bounds)  # type: ignore[union-attr]
    # The SDK's default (0, 5, 10 ... 10000 s) put every request in one bucket.
    assert bounds == list(DURATION_BUCKETS)
    assert min(b for b in bounds if b > 0) <= 0.1 and max(bounds) >= 60


async def test_every_request_logs_one_line_refusals_included(
    primary: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="chat_pipeline.gateway")
    cfg = config(
        {"primary": primary},
        gateway={**keyed(monkeypatch, "key-1"), "max_concurrent_per_key": 1},
    )
    key = {"authorization": "Bearer key-1"}
    body = {"model": "pipeline", "messages": MESSAGES}
    async with running(cfg) as gateway, httpx.AsyncClient(base_url=gateway.url) as http:
        caplog.clear()  # the startup lines
        chat = "/v1/chat/completions"
        answered = await http.post(chat, json=body, headers=key)
        statuses = [
            answered.status_code,
            (await http.post(chat, json=body)).status_code,
            (await http.post(chat, json={"model": "pipeline"}, headers=key)).status_code,
        ]
        primary.script(FakeResponse(hang=True))
        busy = asyncio.create_task(http.post(chat, json=body, headers=key))
        await primary.wait_for_requests(2)
        refused = await http.post(chat, json=body, headers=key)
        statuses.append(refused.status_code)
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy
        await gateway.gateway.wait_idle()
    assert statuses == [200, 401, 400, 429]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    by_status = {
        status: [text for level, text in lines if f" {status} " in text and level == logging.INFO]
        for status in (200, 401, 400, 429)
    }
    assert all(len(found) == 1 for found in by_status.values()), lines
    # The key's identity, shortened (never the key, never its position in the list).
    identity = key_identity(b"key-1")[:10]
    assert f"key={identity}:" in by_status[200][0] and "route=primary" in by_status[200][0]
    assert "key-1" not in "".join(text for _, text in lines)
    # The response's id beside the request's: either finds the line.
    assert f"response_id={answered.json()['id']} " in by_status[200][0]
    assert "WireError invalid_api_key" in by_status[401][0]
    assert "WireError missing_required" in by_status[400][0]
    assert f"request_id={refused.headers['x-request-id']}" in by_status[429][0]
    assert all(" ms request_id=req_" in text for found in by_status.values() for text in found)
    # The client that went away (the busy request) is a line too.
    assert any("client disconnected" in text for _, text in lines)


async def test_startup_says_what_is_served_and_warns_without_keys(
    primary: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="chat_pipeline.gateway")
    async with running(config({"primary": primary}), source="gateway.toml"):
        pass
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    (started,) = [m for level, m in messages if level == logging.INFO and "serving" in m]
    assert "gateway.toml" in started and "models pipeline, primary" in started
    assert "no API keys" in started
    assert any(level == logging.WARNING and "no API keys" in m for level, m in messages)


async def test_without_a_tracer_provider_a_callers_trace_still_goes_upstream(
    primary: FakeOpenAIServer, streaming: bool
) -> None:
    # No provider given and none set globally: the gateway makes no span of its own, but a
    # caller's trace context is still passed on to the route (and none is made up).
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    body = {"model": "pipeline", "messages": MESSAGES, "stream": streaming}
    async with running(config({"primary": primary})) as gateway, httpx.AsyncClient() as http:
        traced = await http.post(
            f"{gateway.base_url}/chat/completions",
            json=body,
            headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        )
        untraced = await http.post(f"{gateway.base_url}/chat/completions", json=body)
        await gateway.gateway.wait_idle()
    assert (traced.status_code, untraced.status_code) == (200, 200)
    first, second = primary.requests
    assert first.headers["traceparent"].split("-")[1] == trace_id
    assert "traceparent" not in second.headers


class _Listing(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize(
    "beside", ["nothing", "a second handler", "a filter of the users", "a buffered stream"]
)
async def test_the_request_line_reads_the_same_with_or_without_its_record(
    primary: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    streaming: bool,
    beside: str,
) -> None:
    # `log_config`'s handler writes the request line without a record while nothing else
    # would see the record; anything else beside it (another handler, a filter of the
    # user's, a stream the handler must flush) gets the record, and the line is the same.
    from pipeline.gateway import _telemetry
    from pipeline.gateway.server import _LineFormatter, _RequestIdFilter, log_config

    records: list[int] = []
    make_record = _telemetry._line_record

    def counted(level: int, args: tuple[Any, ...]) -> logging.LogRecord:
        records.append(level)
        return make_record(level, args)

    monkeypatch.setattr(_telemetry, "_line_record", counted)
    path = tmp_path / "log"
    text = open(path, "w", buffering=-1 if beside == "a buffered stream" else 1)  # noqa: ASYNC230, SIM115
    handler = log_config("info")["handlers"]["chat_pipeline"]["()"](stream=text)
    handler.setFormatter(_LineFormatter(use_colors=False))
    handler.addFilter(_RequestIdFilter())
    listing = _Listing()
    seen: list[str] = []
    if beside == "a filter of the users":
        handler.addFilter(lambda record: seen.append(record.getMessage()) or True)
    logger = logging.getLogger("chat_pipeline")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    logger.handlers[:] = [handler]
    if beside == "a second handler":
        logging.getLogger("chat_pipeline.gateway").addHandler(listing)
    logger.propagate, logger.level = False, logging.INFO
    body = {"model": "pipeline", "messages": MESSAGES, "stream": streaming}
    try:
        async with running(config({"primary": primary})) as gateway:
            async with httpx.AsyncClient(base_url=gateway.url) as http:
                answered = await http.post("/v1/chat/completions", json=body)
                refused = await http.post("/v1/chat/completions", json={"model": "pipeline"})
            await gateway.gateway.wait_idle()
    finally:
        logger.handlers[:], logger.propagate, logger.level = saved
        logging.getLogger("chat_pipeline.gateway").removeHandler(listing)
        text.close()
    assert (answered.status_code, refused.status_code) == (200, 400)
    lines = [line for line in path.read_text().splitlines() if " /v1/chat/completions " in line]
    ids = [answered.headers["x-request-id"], refused.headers["x-request-id"]]
    assert [line.split("request_id=")[1].split()[0] for line in lines] == ids
    ok, bad = lines
    assert ok.startswith("INFO:     POST /v1/chat/completions 200 ")
    assert ok.endswith(
        " route=primary attempts=1 fallback=false served_model=model-primary key=-: ok"
    )
    assert bad.startswith("INFO:     POST /v1/chat/completions 400 ")
    assert bad.endswith(": WireError missing_required")
    assert "request_id=" not in ok.split(" ms ")[1].split("request_id=", 1)[1]  # once
    made = 0 if beside == "nothing" else 2
    assert records == [logging.INFO] * made
    if beside == "a second handler":
        requested = [line for line in listing.lines if " /v1/chat/completions " in line]
        assert requested == [line.split(" ", 1)[1].lstrip() for line in lines]
    if beside == "a filter of the users":
        assert [line for line in seen if " /v1/chat/completions " in line] == [
            line.split(" ", 1)[1].lstrip() for line in lines
        ]


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING])
def test_the_request_lines_record_is_what_make_record_makes(level: int) -> None:
    # The line's record is copied from a template (`_line_record`): every field a formatter
    # may read is the one `Logger.makeRecord` gives, the clock's apart (read a moment later).
    from pipeline.gateway import _telemetry

    args = ("POST", "/v1/x", 200, 1.5, "req_1", "-", "m", "r", 1, "false", "-", "-", "", "ok")
    logger = _telemetry._logger
    expected = logger.makeRecord(
        logger.name, level, _telemetry.__file__, 0, _telemetry._LINE, args, None
    ).__dict__
    for _ in range(2):  # the first call makes the template, the second copies it
        record = _telemetry._line_record(level, args)
        assert type(record) is logging.LogRecord
        made = record.__dict__
        clock = {"created", "msecs", "relativeCreated"}
        assert {k: v for k, v in made.items() if k not in clock} == {
            k: v for k, v in expected.items() if k not in clock
        }
        assert 0 <= made["created"] - expected["created"] < 60
        assert 0 <= made["msecs"] < 1000
        assert made["relativeCreated"] >= expected["relativeCreated"]
        assert record.getMessage() == _telemetry._LINE % args


def test_a_record_factory_of_the_users_makes_the_request_lines_record() -> None:
    from pipeline.gateway import _telemetry

    class Mine(logging.LogRecord):
        pass

    saved = logging.getLogRecordFactory()
    logging.setLogRecordFactory(Mine)
    try:
        record = _telemetry._line_record(logging.INFO, ("POST",) * 14)
    finally:
        logging.setLogRecordFactory(saved)
    assert type(record) is Mine


_GLOBAL_PROVIDERS_SET_LATER = """
import asyncio, json, sys
from opentelemetry import metrics, trace
from pipeline.config import load_config
from pipeline.gateway.app import create_app
from tests.otel import make_otel

BODY = json.dumps({"model": "pipeline", "messages": [{"role": "user", "content": "hi"}]})

async def call(app) -> int:
    sent, given = [], asyncio.Event()
    async def receive():
        if given.is_set():
            await asyncio.Event().wait()  # no disconnect: the request runs out
        given.set()
        return {"type": "http.request", "body": BODY.encode(), "more_body": False}
    async def send(message):
        sent.append(message)
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8080),
        "scheme": "http", "root_path": "", "state": {},
        "headers": [(b"host", b"gateway"), (b"content-type", b"application/json")],
    }
    await app(scope, receive, send)
    return sent[0]["status"]

async def main() -> None:
    app = create_app(load_config(sys.argv[1]))
    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    life = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, outbox.put)
    )
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    assert await call(app) == 200  # no providers yet: nothing to record
    otel = make_otel()
    trace.set_tracer_provider(otel.tracer_provider)
    metrics.set_meter_provider(otel.meter_provider)
    assert await call(app) == 200
    names = [span.name for span in otel.finished()]
    assert names.count("POST /v1/chat/completions") == 1, names
    assert otel.total("http.server.request.duration") == 1
    await inbox.put({"type": "lifespan.shutdown"})
    await outbox.get()
    await life
    print("traced and measured")

asyncio.run(main())
"""


def test_global_providers_set_later_trace_and_measure_the_requests_after_them(
    tmp_path: Path,
) -> None:
    # A global provider can be set once per process: its own process.
    config = tmp_path / "gateway.toml"
    config.write_text('[routes.primary]\nprovider = "scripted"\nreply = "Hello."\n')
    assert run_python(_GLOBAL_PROVIDERS_SET_LATER, str(config)) == "traced and measured"
