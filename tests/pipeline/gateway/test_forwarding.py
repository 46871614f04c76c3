"""The forwarded path of Chat Completions (the client's body sent as it came, the provider's
own answer written back with the gateway's ids) against the parsed path: the same bytes for
the same request, failover before output and never after, and the layers that need the
parsed answer (the response cache) keep their routes on the parsed path. Both call shapes."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipeline.gateway._handler as handler
import pipeline.providers.openai as openai_provider
from pipeline.config import parse_config
from pipeline.errors import ProviderError
from pipeline.gateway._chat_completions import CHAT_COMPLETIONS
from pipeline.gateway._forwarding import CHAT_FORWARDER, _sent_unchanged
from pipeline.providers._forwarding import EventShapes, ForwardedReads
from pipeline.testing import FakeOpenAIServer, FakeResponse
from pipeline.wire import WireError
from pipeline.wire.chat_completions.inbound import _message, parse_request
from pipeline.wire.chat_completions.outbound import StreamAssembler
from pipeline.wire.sse import SSEPayloads
from tests.pipeline.gateway.conftest import Running, config, running
from tests.pipeline.providers.test_forwarded_reads import (
    HEAD,
    NEXT,
    SHAPED,
    USAGE,
    USAGE_READS,
    chunk,
    shaped,
    sse,
    with_usage,
)

pytestmark = pytest.mark.gateway

RESPONSE_ID = "chatcmpl-" + "0" * 24
CREATED = 1_700_000_000
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello. ünïcödé ✓"},
]


class Forwarded:
    """Counts the requests a provider sent as their clients wrote them."""

    def __init__(self) -> None:
        self.calls = 0


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The payloads of every read `ForwardedReads` reads in the test, a list a read."""
    read = ForwardedReads.read
    found: list[list[Any]] = []

    def spied(reads: ForwardedReads, payloads: list[Any]) -> Any:
        found.append(payloads)
        return read(reads, payloads)

    monkeypatch.setattr(ForwardedReads, "read", spied)
    return found


@pytest.fixture
def forwarded(monkeypatch: pytest.MonkeyPatch) -> Forwarded:
    """The gateway's ids fixed (an answer's bytes compare across requests), and a count of
    the forwarded bodies the OpenAI client built."""
    monkeypatch.setattr(handler, "now", lambda: CREATED)
    monkeypatch.setattr(CHAT_COMPLETIONS, "new_response_id", lambda: RESPONSE_ID)
    spy = Forwarded()
    build = openai_provider.chat_completions_body

    def counted(*args: Any, **kwargs: Any) -> bytes:
        spy.calls += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(openai_provider, "chat_completions_body", counted)
    return spy


async def post(run: Running, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{run.base_url}/chat/completions", json=body)
    await run.gateway.wait_idle()
    return response


async def parsed(run: Running, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The same request's answer on the parsed path (no request may be forwarded)."""
    with monkeypatch.context() as patch:
        patch.setattr(CHAT_FORWARDER, "forward", lambda request: None)
        response = await post(run, body)
    assert response.status_code == 200, response.text
    return response.content


def events(content: bytes) -> list[Any]:
    """A stream's data payloads, decoded (``[DONE]`` as the string)."""
    out: list[Any] = []
    for event in content.decode().split("\n\n"):
        if event:
            assert event.startswith("data: "), event
            data = event.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# Each answer, and whether a stream of it asks for usage (``stream_options``).
ANSWERS = {
    "text": (FakeResponse(chunks=["Hello", ", ", "world."], usage=(12, 3)), True),
    "text-no-usage": (FakeResponse(chunks=["Hello", ", ", "world."]), False),
    "reasoning": (FakeResponse(chunks=["Hi."], reasoning="Brief greeting wanted."), False),
    "tool-calls": (  # compact arguments: the parsed path writes them so
        FakeResponse(
            text="",
            tool_calls=[("get_weather", '{"city":"Paris"}'), ("get_time", '{"tz":"CET"}')],
        ),
        True,
    ),
    "length": (FakeResponse(chunks=["Hel"], stop_reason="length"), False),
    "long-text": (  # many deltas of one shape: written around their strings
        FakeResponse(chunks=["Héllo", ' "quoted"', " \\ back", "\n", "✓ " * 3, "", "end."] * 4),
        True,
    ),
    "reasoning-then-text": (
        FakeResponse(chunks=["One ", "two ", "three."], reasoning="Think of a few words."),
        True,
    ),
    "every-option": (FakeResponse(chunks=['{"a":', "1}"], text='{"a":1}'), True),
    "bare-body": (FakeResponse(chunks=["Hello", "."]), False),  # model, messages, stream
}
# What the "every-option" request sets besides (each one the gateway reads or passes on).
OPTIONS: dict[str, Any] = {
    "top_p": 0.9,
    "seed": 7,
    "stop": ["\n\n"],
    "presence_penalty": 0.1,
    "frequency_penalty": 0.2,
    "logit_bias": {"50256": -100},
    "reasoning_effort": "low",
    "verbosity": "low",
    "max_completion_tokens": 32,
    "metadata": {"who": "a test"},
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name}",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]


@pytest.mark.parametrize("answer", list(ANSWERS))
async def test_the_forwarded_answer_is_the_parsed_answer_byte_for_byte(
    primary: FakeOpenAIServer,
    forwarded: Forwarded,
    monkeypatch: pytest.MonkeyPatch,
    streaming: bool,
    answer: str,
) -> None:
    monkeypatch.setattr(primary, "answer_tag", lambda: "fixed")  # the tool calls' ids
    primary.default, usage = ANSWERS[answer]
    usage = usage and streaming
    body: dict[str, Any] = {
        "model": "pipeline",
        "messages": MESSAGES,
        "temperature": 0.5,
        "max_tokens": 64,
        "stream": streaming,
        "user": "someone",  # dropped by the gateway on both paths
    }
    if answer == "tool-calls":
        body["tools"] = TOOLS
        body["tool_choice"] = "auto"
        body["parallel_tool_calls"] = True
    if answer == "every-option":
        del body["max_tokens"]
        body.update(OPTIONS)
    if answer == "bare-body":
        body = {"model": "pipeline", "messages": MESSAGES, "stream": streaming}
    if usage:
        body["stream_options"] = {"include_usage": True}
    async with running(config({"primary": primary})) as run:
        first = await post(run, body)
        assert first.status_code == 200, first.text
        assert forwarded.calls == 1  # it went as the client wrote it
        second = await parsed(run, body, monkeypatch)
        assert forwarded.calls == 1
    assert first.content.decode() == second.decode()
    sent_forwarded, sent_parsed = (request.json for request in primary.requests)
    assert sent_forwarded == sent_parsed  # the upstream was asked the same either way
    assert "user" not in sent_forwarded and "metadata" not in sent_forwarded
    if streaming:
        chunks = events(first.content)
        assert chunks[-1] == "[DONE]"
        assert {chunk["id"] for chunk in chunks[:-1]} == {RESPONSE_ID}
        assert any("usage" in chunk for chunk in chunks[:-1]) is usage
    else:
        whole = json.loads(first.content)
        assert (whole["id"], whole["created"]) == (RESPONSE_ID, CREATED)


# Messages of every shape the forwarded path tells apart, and fields that change what it sends.
_SHAPES = st.sampled_from(
    [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "hello"},
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": ""},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "user", "content": "hi", "name": ""},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": None, "tool_calls": []},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}},
        {"role": ["user"], "content": "hi"},
        {"content": "hi", "name": "ann"},
        {"role": "user"},
    ]
)
_FIELDS = st.dictionaries(
    st.sampled_from(["stream", "temperature", "user", "tools", "tool_choice", "stop"]),
    st.sampled_from([None, True, False, 0.5, "x", [], ["y"]]),
    max_size=3,
)


@given(messages=st.lists(_SHAPES, min_size=1, max_size=4), fields=_FIELDS)
def test_the_parse_tells_the_forwarded_path_only_what_its_own_checks_would(
    messages: list[dict[str, Any]], fields: dict[str, Any]
) -> None:
    body = json.dumps({"model": "pipeline", "messages": messages, **fields}).encode()
    try:
        request = parse_request(body)
    except WireError:
        return  # a field of the wrong type: refused before any forwarding
    # Each message as the general reader makes it, however the parse made it.
    assert request.messages == [_message(raw, index) for index, raw in enumerate(messages)]
    if request.plain_messages:
        assert all(_sent_unchanged(raw) for raw in messages)
    forward = CHAT_FORWARDER.forward(request)
    checked = CHAT_FORWARDER.forward(dataclasses.replace(request, plain_messages=False))
    assert (forward is None) is (checked is None)
    if forward is not None and checked is not None:
        assert forward.body == checked.body
        assert forward.messages is request.messages and forward.options is request.options


async def test_a_failure_before_output_fails_over_on_the_forwarded_path(
    primary: FakeOpenAIServer,
    backup: FakeOpenAIServer,
    forwarded: Forwarded,
    monkeypatch: pytest.MonkeyPatch,
    streaming: bool,
) -> None:
    body = {"model": "pipeline", "messages": MESSAGES, "stream": streaming}
    # A refusal, and a stream cut after its role chunk (nothing the client would see yet);
    # the last refusal sends the parsed path's request to the backup too.
    cut = [FakeResponse(chunks=["x"], disconnect_after=1)] if streaming else []
    primary.script(FakeResponse.error(503), *cut, FakeResponse.error(503))
    backup.default = FakeResponse(text="The backup answered.", chunks=["The backup ", "answered."])
    async with running(config({"primary": primary, "backup": backup})) as run:
        refused = await post(run, body)
        assert forwarded.calls == 2  # both attempts forwarded
        after_cut = await post(run, body) if streaming else None
        reference = await parsed(run, body, monkeypatch)
    assert refused.status_code == 200, refused.text
    assert refused.content == reference  # as the parsed path answers, from the backup
    if after_cut is not None:
        assert after_cut.content == reference
        assert forwarded.calls == 4
    assert (primary.count(), backup.count()) == (3 if streaming else 2, 3 if streaming else 2)
    if streaming:
        chunks = [c for c in events(reference)[:-1] if c["choices"]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == "The backup answered."
        roles = [c["choices"][0]["delta"].get("role") for c in events(refused.content)[:-1]]
        assert roles.count("assistant") == 1  # one stream, started once
    else:
        assert json.loads(reference)["choices"][0]["message"]["content"] == "The backup answered."
        assert json.loads(reference)["model"] == "model-backup"


@pytest.mark.parametrize(
    "failure",
    [
        FakeResponse(
            chunks=["Hello ", "wor", "ld"],
            in_band_error={"type": "server_error", "code": "server_error"},
            error_after=3,
        ),
        FakeResponse(chunks=["Hello ", "wor", "ld"], disconnect_after=3),
    ],
    ids=["in-band-error", "cut-connection"],
)
async def test_a_failure_after_output_never_fails_over_on_the_forwarded_path(
    primary: FakeOpenAIServer,
    backup: FakeOpenAIServer,
    forwarded: Forwarded,
    failure: FakeResponse,
) -> None:
    # Only a stream has output before its end: a whole answer fails before any.
    primary.script(failure)
    body = {"model": "pipeline", "messages": MESSAGES, "stream": True}
    async with running(config({"primary": primary, "backup": backup})) as run:
        response = await post(run, body)
    assert forwarded.calls == 1
    assert response.status_code == 200
    chunks = events(response.content)
    assert "[DONE]" not in chunks
    text = "".join(
        (c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices")
    )
    assert text == "Hello wor"  # what was streamed stays streamed, nothing repeated
    assert chunks[-1]["error"]["code"] == "upstream_unavailable"
    assert (primary.count(), backup.count()) == (1, 0)


async def test_a_route_under_the_response_cache_keeps_the_parsed_path(
    primary: FakeOpenAIServer,
    forwarded: Forwarded,
    monkeypatch: pytest.MonkeyPatch,
    streaming: bool,
) -> None:
    primary.default = FakeResponse(chunks=["Cached ", "answer."])
    routes = {"primary": {"provider": "openai", "model": "m", "base_url": primary.base_url}}
    cached = parse_config({"routes": routes, "cache": {}})
    body = {"model": "primary", "messages": MESSAGES, "stream": streaming}
    async with running(cached) as run:
        miss = await post(run, body)
        hit = await post(run, body)
        assert forwarded.calls == 0  # the cache needs the parsed answer: nothing forwarded
        target = run.gateway.target("primary")
        assert target is not None and not target.forwards
    async with running(parse_config({"routes": routes})) as run:
        target = run.gateway.target("primary")
        assert target is not None and target.forwards
        plain = await parsed(run, body, monkeypatch)
    assert (miss.headers["x-cache"], hit.headers["x-cache"]) == ("miss", "hit")
    assert miss.content == hit.content == plain
    assert primary.count() == 2


async def test_routes_under_a_hedging_router_keep_the_parsed_path(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, forwarded: Forwarded, streaming: bool
) -> None:
    routes = {
        name: {"provider": "openai", "model": f"model-{name}", "base_url": server.base_url}
        for name, server in (("primary", primary), ("backup", backup))
    }
    hedged = parse_config({"routes": routes, "router": {"kind": "hedged"}})
    body = {"model": "pipeline", "messages": MESSAGES, "stream": streaming}
    async with running(hedged) as run:
        target = run.gateway.target("pipeline")
        assert target is not None and not target.forwards
        response = await post(run, body)
    assert response.status_code == 200, response.text
    assert forwarded.calls == 0


def chunk_line(delta: dict[str, Any], finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    head = {"id": "up", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return "data: " + json.dumps({**head, "choices": [choice]}) + "\n"


@pytest.mark.parametrize("at", ["before-output", "after-output"])
async def test_a_malformed_event_is_a_typed_failure_on_the_forwarded_path(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, forwarded: Forwarded, at: str
) -> None:
    # A stream's own behaviour: a whole answer has no events.
    role = [chunk_line({"role": "assistant", "content": ""}), ""]
    text = [chunk_line({"content": "Hel"}), "", chunk_line({"content": "lo"}), ""]
    bad = ['data: {"choices": [{"index": 0, "delta": {"content": "x"}', ""]
    lines = role + bad if at == "before-output" else role + text + bad
    primary.script(FakeResponse(raw_lines=lines))
    backup.default = FakeResponse(chunks=["The backup ", "answered."])
    body = {"model": "pipeline", "messages": MESSAGES, "stream": True}
    async with running(config({"primary": primary, "backup": backup})) as run:
        response = await post(run, body)
    assert forwarded.calls == (2 if at == "before-output" else 1)
    assert response.status_code == 200, response.text
    chunks = events(response.content)
    text_sent = "".join(
        (c["choices"][0]["delta"].get("content") or "")
        for c in chunks
        if c != "[DONE]"
        if c.get("choices")
    )
    if at == "before-output":  # nothing reached the client: the backup answered
        assert text_sent == "The backup answered."
        assert chunks[-1] == "[DONE]"
        assert (primary.count(), backup.count()) == (1, 1)
    else:  # what was streamed stays, the failure is told in-band, nothing fails over
        assert text_sent == "Hello"
        assert "[DONE]" not in chunks
        assert chunks[-1]["error"]["code"] == "upstream_error"  # malformed: a typed error
        assert (primary.count(), backup.count()) == (1, 0)


@pytest.mark.parametrize(
    "garbage",
    [
        {"id": "up", "model": "m", "choices": [{"message": {"content": 5}}]},
        {"id": "up", "model": "m", "choices": []},
        [{"id": "up"}],
    ],
    ids=["content-a-number", "no-choices", "not-an-object"],
)
async def test_a_malformed_whole_answer_is_a_typed_failure_that_fails_over(
    primary: FakeOpenAIServer,
    backup: FakeOpenAIServer,
    forwarded: Forwarded,
    monkeypatch: pytest.MonkeyPatch,
    garbage: Any,
) -> None:
    # A whole answer's own behaviour: refused before any output, so the backup answers.
    primary.script(FakeResponse(body=garbage), FakeResponse(body=garbage))
    backup.default = FakeResponse(text="The backup answered.")
    body = {"model": "pipeline", "messages": MESSAGES, "stream": False}
    async with running(config({"primary": primary, "backup": backup})) as run:
        response = await post(run, body)
        assert forwarded.calls == 2  # both attempts forwarded
        reference = await parsed(run, body, monkeypatch)
    assert response.status_code == 200, response.text
    assert response.content == reference  # the backup's answer, as the parsed path writes it
    assert json.loads(response.content)["choices"][0]["message"]["content"] == (
        "The backup answered."
    )
    assert (primary.count(), backup.count()) == (2, 2)


@pytest.mark.parametrize("answer", ["text", "text-no-usage", "length", "tool-calls"])
async def test_streams_after_the_first_write_the_parsed_answer_byte_for_byte(
    primary: FakeOpenAIServer,
    forwarded: Forwarded,
    monkeypatch: pytest.MonkeyPatch,
    batches: list[list[Any]],
    answer: str,
) -> None:
    # A stream's own behaviour: the role's event and the finish of the streams after the
    # first are read as the shapes the first taught the route (a whole answer has none).
    monkeypatch.setattr(primary, "answer_tag", lambda: "fixed")
    primary.default, usage = ANSWERS[answer]
    body: dict[str, Any] = {"model": "pipeline", "messages": MESSAGES, "stream": True}
    if answer == "tool-calls":
        body["tools"] = TOOLS
    if usage:
        body["stream_options"] = {"include_usage": True}
    async with running(config({"primary": primary})) as run:
        answers = []
        for _ in range(3):  # each upstream stream has an id and a created of its own
            response = await post(run, body)
            assert response.status_code == 200, response.text
            answers.append(response.content)
        assert forwarded.calls == 3
        reference = await parsed(run, body, monkeypatch)
    assert answers == [reference] * 3
    # A run of deltas (read at once where a read has several) is a tuple of its texts.
    kinds = [
        (len(p) if type(p[1]) is not list else "run") if type(p) is tuple else 0
        for batch in batches
        for p in batch
    ]
    assert kinds.count(4) == 4  # the role's event and the finish of the last two streams
    assert kinds.count(6) == 2  # the usage of the last two streams, by its shape's counts
    if answer != "tool-calls":  # the later streams' first deltas too, by the frame it taught
        assert kinds.count(0) == 4  # decoded: the first's role, delta, finish, usage


@pytest.mark.parametrize("include_usage", [True, False])
async def test_the_ledger_records_the_usage_the_parsed_path_reads(
    primary: FakeOpenAIServer,
    forwarded: Forwarded,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    include_usage: bool,
) -> None:
    # The later streams' usage is read by the shape the first taught (its counts' digits):
    # each stream's counts differ, details included, and the ledger records them as parsed.
    answers = [
        FakeResponse(
            chunks=["Hi."], usage=(10 + n, 3 + n), cache_usage=(0, n), reasoning_tokens=2 * n
        )
        for n in range(3)
    ]
    body: dict[str, Any] = {"model": "pipeline", "messages": MESSAGES, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    kinds: list[int] = []
    read = ForwardedReads.read

    def spied(reads: ForwardedReads, payloads: list[Any]) -> Any:
        kinds.extend(len(p) if type(p) is tuple else 0 for p in payloads)
        return read(reads, payloads)

    monkeypatch.setattr(ForwardedReads, "read", spied)
    routes = {"primary": {"provider": "openai", "model": "m", "base_url": primary.base_url}}
    spend = {"path": str(tmp_path / "spend.db"), "flush_interval": 0.05}
    async with running(parse_config({"routes": routes, "spend": spend})) as run:
        answered = []
        for answer in answers:
            primary.default = answer
            answered.append((await post(run, body)).content)
        assert forwarded.calls == 3 and kinds.count(6) == 2
        for answer, content in zip(answers, answered, strict=True):
            primary.default = answer
            assert await parsed(run, body, monkeypatch) == content
        assert run.gateway.spend is not None
        records = await run.gateway.spend.records()
    counts = [
        (r.input_tokens, r.output_tokens, r.cache_read_tokens, r.reasoning_tokens) for r in records
    ]
    want = [(10 + n, 3 + n, n, 2 * n) for n in range(3)]
    assert counts == want + want  # forwarded, then parsed


@pytest.mark.parametrize("name", list(SHAPED))
@pytest.mark.parametrize("include_usage", [True, False])
def test_events_of_a_known_shape_are_written_as_when_decoded(
    name: str, include_usage: bool
) -> None:
    body = SHAPED[name][0]
    shapes = EventShapes()
    assert write(sse(shaped()), shapes, include_usage) == write(sse(shaped()), None, include_usage)
    assert write(body, shapes, include_usage) == write(body, None, include_usage)
    taught = EventShapes()  # by the stream itself, then read again with what it taught
    assert write(body, taught, include_usage) == write(body, None, include_usage)
    assert write(body, taught, include_usage) == write(body, None, include_usage)


@pytest.mark.parametrize("field", ["content", "reasoning_content"])
def test_a_frame_the_streams_share_is_written_once_as_each_stream_would_write_it(
    field: str,
) -> None:
    # The text deltas' frame the first stream taught is written once a client, around each
    # stream's own id and created, with and without the usage the client asked for.
    def stream(head: dict[str, Any]) -> bytes:
        role, text, finish, usage = shaped(head)
        texts = ["Hi.", 'q"\\', "ünï ✓", ""]
        deltas = [{**text, "choices": [{"index": 0, "delta": {field: t}}]} for t in texts]
        return sse([role, *deltas, finish, usage])

    shapes = EventShapes()
    first = stream(dict(NEXT, id="chatcmpl-first"))
    assert write(first, shapes, True) == write(first, None, True)
    assert shapes.delta is not None and shapes.delta[5] == {}  # learned, not yet written
    for n, include_usage in enumerate([True, False, True, False]):
        body = stream(dict(NEXT, id=f"chatcmpl-{n}", created=NEXT["created"] + n))
        assert write(body, shapes, include_usage) == write(body, None, include_usage)
    written = shapes.delta[5]
    assert set(written) == {True, False} and all(written.values())


def deltas(texts: list[str], *, compact: bool = False, field: str = "content") -> bytes:
    """A stream (of every field the parsed path writes) whose first delta says "First."
    and the next say `texts` (in `field`)."""
    role = chunk({"role": "assistant", "content": ""})
    events = [chunk({field: text}) for text in ["First.", *texts]]
    usage = {**HEAD, "choices": [], "usage": {**USAGE["usage"], "total_tokens": 8}}
    return sse([role, *events, chunk({}, "stop"), usage], compact=compact)


@given(
    texts=st.lists(
        st.one_of(st.text(max_size=6), st.sampled_from(["Hi ", "", 'q"', "\\", "\n", "é", "✓"])),
        min_size=2,
        max_size=6,
    ),
    compact=st.booleans(),
    include_usage=st.booleans(),
)
def test_a_run_of_deltas_read_at_once_is_written_as_each_read_by_itself(
    texts: list[str], compact: bool, include_usage: bool
) -> None:
    # Deltas in one read come as a run (plain strings written as they came, others
    # encoded); read one at a time, each is a delta of its own: the same bytes either way.
    body = deltas(texts, compact=compact)
    events = body.split(b"\n\n")
    each = list(itertools.accumulate(len(event) + 2 for event in events[:-2]))
    written = write(body, None, include_usage)
    assert written == write(body, None, include_usage, each)
    assert written == parsed_write(body, include_usage)


@pytest.mark.parametrize(
    ("texts", "strings"),
    [
        (["Hello ", "from ", "the ", "fake."], True),  # as orjson writes them: as they came
        (["Hello ", "wörld", "✓", "!"], False),  # escaped by the upstream (json's \u00f6): encoded
        (['say "hi"', "\\n", "a", "b"], False),  # escapes of any upstream: encoded
    ],
)
@pytest.mark.parametrize("field", ["content", "reasoning_content"])
def test_a_run_is_read_at_once_and_written_as_the_parsed_path_writes_it(
    texts: list[str], strings: bool, field: str, batches: list[list[Any]]
) -> None:
    body = deltas(texts, field=field)
    written = write(body, None, True)
    ((run,),) = [[p for p in batch if type(p) is tuple and type(p[1]) is list] for batch in batches]
    assert run[1] == texts
    assert (run[3] is not None) is strings
    assert written == parsed_write(body, True)


def parsed_write(body: bytes, include_usage: bool) -> bytes:
    """What the gateway's parsed path writes of the stream `body`."""
    asked: dict[str, Any] = {"model": "m", "messages": MESSAGES, "stream": True}
    if include_usage:
        asked["stream_options"] = {"include_usage": True}
    request = parse_request(json.dumps(asked).encode())
    encoder = CHAT_COMPLETIONS.encoder(request, model="m", response_id=RESPONSE_ID, created=CREATED)
    decoder, reader = SSEPayloads("p"), StreamAssembler("p")
    out = []
    for payload in decoder.feed(body):
        update = reader.feed(payload)
        if update is not None:
            out.append(encoder.update(update))
    tail = reader.finish()
    if tail is not None:
        out.append(encoder.update(tail))
    out.append(encoder.end())
    return b"".join(part.encode() if isinstance(part, str) else part for part in out)


@pytest.mark.parametrize("name", list(USAGE_READS))
@pytest.mark.parametrize("include_usage", [True, False])
def test_a_usage_of_a_known_shape_is_written_as_when_decoded(
    name: str, include_usage: bool
) -> None:
    taught, usage, _ = USAGE_READS[name]
    shapes = EventShapes()
    first = with_usage(taught)
    assert write(first, shapes, include_usage) == write(first, None, include_usage)
    assert shapes.usage is not None
    body = with_usage(usage, NEXT)
    for at in range(len(body) + 1):  # whole, and cut at every byte
        cuts = [at] if 0 < at < len(body) else []
        assert write(body, shapes, include_usage, cuts) == write(body, None, include_usage, cuts)


def write(
    body: bytes, shapes: EventShapes | None, include_usage: bool, cuts: list[int] | None = None
) -> bytes:
    """What the gateway writes of a forwarded stream's `body` (one read, or one a piece of it
    cut at `cuts`, then its end), or of its failure, read with the client's `shapes` or
    without any."""
    reads = ForwardedReads(StreamAssembler("p"), lambda: SSEPayloads("p"), sse=True, shapes=shapes)
    asked: dict[str, Any] = {"model": "m", "messages": MESSAGES, "stream": True}
    if include_usage:
        asked["stream_options"] = {"include_usage": True}
    request = parse_request(json.dumps(asked).encode())
    ids: dict[str, Any] = {"model": "m", "response_id": RESPONSE_ID, "created": CREATED}
    chunks = CHAT_FORWARDER.encoder(
        functools.partial(CHAT_COMPLETIONS.encoder, request, **ids), request, **ids
    )
    out: list[str | bytes] = []
    bounds = [0, *(cuts or []), len(body)]
    try:
        for start, end in itertools.pairwise(bounds):  # bounded: the cuts plus one
            update, failure = reads.read(reads.events.feed(body[start:end]))
            if update is not None:
                out.append(chunks.update(update))
            if failure is not None:
                raise failure
            if reads.events.failure is not None:
                raise reads.events.failure
            if reads.events.done:
                break
        tail = reads.finish()
        if tail is not None:
            out.append(chunks.update(tail))
        out.append(chunks.end())
    except ProviderError as exc:
        out.append(type(exc).__name__)
    return b"".join(part.encode() if isinstance(part, str) else part for part in out)
