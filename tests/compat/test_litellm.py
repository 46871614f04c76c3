"""Our OpenAI client and a full pipeline against a real LiteLLM proxy.

Mock models answer from LiteLLM itself (``mock_response``); the ``upstream`` model proxies
to our fake server, so a test can script what LiteLLM receives (statuses, cut streams,
in-band errors) and count LiteLLM's upstream calls. LiteLLM runs with ``num_retries: 0``:
by default it retries a 429 or 5xx twice itself (three upstream calls), which would hide
our retry layer.

What LiteLLM does to errors, as these tests pin down: every error body carries the HTTP
status as a string ``code`` ("429", "500", "400"); context-window and content-policy errors
are plain 400 ``invalid_request_error`` (the distinction is only in the message text, which
the client does not read), and a failure after a stream started (a cut upstream stream or
an upstream in-band error) is re-sent in-band as ``{"error": {"code": "500", ...}}``.
"""

from __future__ import annotations

import pytest

from pipeline.errors import (
    CircuitOpenError,
    FailureKind,
    ProviderError,
    RateLimitedError,
    RequestInvalidError,
    TransientProviderError,
)
from pipeline.providers import OpenAIChatClient
from pipeline.testing import FakeResponse, collect
from pipeline.types import ChatOptions, FunctionCallContent, UsageDetails
from tests import transports
from tests.compat.helpers import (
    CountingClient,
    Sleeps,
    failover,
    function_calls,
    outcomes,
    resilient,
)
from tests.compat.servers import MOCK_TEXT, UPSTREAM_MODEL, Proxy, ThreadedFakeServer
from tests.otel import Otel

transport = transports.transport  # the fixture
# Every test runs over both HTTP transports of the clients.
pytestmark = [pytest.mark.compat, pytest.mark.timeout(300), pytest.mark.usefixtures("transport")]

FAKE_TEXT = "Hello from the fake server."  # the fake upstream's default answer
CANARY = "CANARY-compat-prompt-4f1e"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def client(proxy: Proxy, model: str) -> CountingClient:
    return CountingClient(
        OpenAIChatClient(model, api_key=proxy.api_key, base_url=proxy.base_url, name=model)
    )


def assert_consistent_usage(usage: UsageDetails | None) -> None:
    assert usage is not None
    assert usage.input_tokens is not None and usage.input_tokens > 0
    assert usage.output_tokens is not None and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


# -- LiteLLM's own mock models -----------------------------------------------------------------


async def test_mock_text(litellm_proxy: Proxy, streaming: bool) -> None:
    chat = client(litellm_proxy, "mock-text")
    async with chat:
        result = await collect(chat, "Say hello.", streaming=streaming)
    assert result.error is None
    assert result.text == MOCK_TEXT
    assert result.response is not None and result.response.finish_reason == "stop"
    # LiteLLM's mock usage differs by call shape (fixed numbers vs counted tokens).
    assert_consistent_usage(result.response.usage)
    assert chat.calls == 1
    if streaming:  # LiteLLM streams a mock answer in pieces of a few characters
        assert len([u for u in result.updates if u.text]) > 1


async def test_mock_tool_call_non_streaming(litellm_proxy: Proxy) -> None:
    # LiteLLM ignores mock_tool_calls when streaming (it streams an empty answer), so only
    # get_response is tested here; streamed tool calls are tested through the upstream.
    chat = client(litellm_proxy, "mock-tools")
    async with chat:
        result = await collect(
            chat, "Weather in Paris?", ChatOptions(tools=[WEATHER_TOOL]), streaming=False
        )
    assert result.error is None
    assert function_calls(result) == [
        FunctionCallContent(call_id="call_mock_1", name="get_weather", arguments={"city": "Paris"})
    ]
    assert result.text == ""
    assert_consistent_usage(result.response.usage if result.response else None)
    assert chat.calls == 1


@pytest.mark.parametrize(
    ("model", "error_class", "kind", "status"),
    [
        ("mock-429", RateLimitedError, FailureKind.RATE_LIMITED, 429),
        ("mock-500", TransientProviderError, FailureKind.TRANSIENT, 500),
        ("mock-529", TransientProviderError, FailureKind.TRANSIENT, 529),
        # LiteLLM's proxy sends these as plain 400s (code "400", type invalid_request_error):
        # not retried and not failed over, like any request error.
        ("mock-context-window", RequestInvalidError, FailureKind.REQUEST_INVALID, 400),
        ("mock-content-filter", RequestInvalidError, FailureKind.REQUEST_INVALID, 400),
        ("no-such-model", RequestInvalidError, FailureKind.REQUEST_INVALID, 400),
    ],
)
async def test_mock_errors(
    litellm_proxy: Proxy,
    streaming: bool,
    model: str,
    error_class: type[ProviderError],
    kind: FailureKind,
    status: int,
) -> None:
    chat = client(litellm_proxy, model)
    async with chat:
        result = await collect(chat, CANARY, streaming=streaming)
    assert isinstance(result.error, error_class), repr(result.error)
    assert result.error.kind is kind
    assert result.error.status_code == status
    assert result.error.code == str(status)  # LiteLLM's code is the status, as a string
    assert result.updates == []
    assert chat.calls == 1
    # Our message, never LiteLLM's (which echoes model names and may echo the prompt).
    assert "LiteLLM" not in str(result.error) and CANARY not in str(result.error)


# -- through LiteLLM to our fake server ----------------------------------------------------


async def test_upstream_text_and_usage_pass_through(
    litellm_proxy: Proxy, fake_upstream: ThreadedFakeServer, streaming: bool
) -> None:
    chat = client(litellm_proxy, UPSTREAM_MODEL)
    async with chat:
        result = await collect(
            chat, "Hi", ChatOptions(max_output_tokens=16, temperature=0.0), streaming=streaming
        )
    assert result.error is None
    assert result.text == FAKE_TEXT
    assert result.response is not None
    assert result.response.finish_reason == "stop"
    usage = result.response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 7, 12)
    # LiteLLM's proxy reports zero cached and reasoning tokens where the upstream said none.
    assert usage.reasoning_tokens in (None, 0) and usage.cache_read_tokens in (None, 0)
    assert (chat.calls, fake_upstream.count()) == (1, 1)
    (forwarded,) = fake_upstream.requests()
    assert forwarded.json["messages"] == [{"role": "user", "content": "Hi"}]
    assert forwarded.json.get("stream", False) is streaming
    # LiteLLM forwards the token limit under the name we sent.
    assert forwarded.json["max_completion_tokens"] == 16


async def test_upstream_tool_call(
    litellm_proxy: Proxy, fake_upstream: ThreadedFakeServer, streaming: bool
) -> None:
    fake_upstream.script(FakeResponse(text="", tool_calls=[("get_weather", '{"city": "Paris"}')]))
    chat = client(litellm_proxy, UPSTREAM_MODEL)
    async with chat:
        result = await collect(
            chat, "Weather in Paris?", ChatOptions(tools=[WEATHER_TOOL]), streaming=streaming
        )
    assert result.error is None
    (call,) = function_calls(result)
    # The fake gives every answer's calls ids of their own (``call_<answer>_0``).
    assert call.call_id.startswith("call_") and call.call_id.endswith("_0")
    assert (call.name, call.arguments) == ("get_weather", {"city": "Paris"})
    assert result.response is not None
    assert result.response.finish_reason == "tool_calls"
    usage = result.response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 7, 12)
    # LiteLLM's proxy reports zero cached and reasoning tokens where the upstream said none.
    assert usage.reasoning_tokens in (None, 0) and usage.cache_read_tokens in (None, 0)
    assert (chat.calls, fake_upstream.count()) == (1, 1)
    # The chat request (the proxy may also ask other paths of the upstream first).
    (forwarded,) = [r for r in fake_upstream.requests() if r.path.endswith("/chat/completions")]
    assert [t["function"]["name"] for t in forwarded.json["tools"]] == ["get_weather"]


@pytest.mark.parametrize(
    ("upstream", "error_class", "kind", "status"),
    [
        (FakeResponse.error(500, code="server_error"), TransientProviderError,
         FailureKind.TRANSIENT, 500),
        (FakeResponse.error(503), TransientProviderError, FailureKind.TRANSIENT, 503),
        (FakeResponse.error(429, code="rate_limit_exceeded", retry_after="7"),
         RateLimitedError, FailureKind.RATE_LIMITED, 429),
        # The upstream's code is dropped: only "400" reaches us.
        (FakeResponse.error(400, code="context_length_exceeded"), RequestInvalidError,
         FailureKind.REQUEST_INVALID, 400),
    ],
    ids=["500", "503", "429", "400-context-length"],
)  # fmt: skip
async def test_upstream_errors_are_not_retried_by_litellm(
    litellm_proxy: Proxy,
    fake_upstream: ThreadedFakeServer,
    streaming: bool,
    upstream: FakeResponse,
    error_class: type[ProviderError],
    kind: FailureKind,
    status: int,
) -> None:
    fake_upstream.script(upstream)
    chat = client(litellm_proxy, UPSTREAM_MODEL)
    async with chat:
        result = await collect(chat, "Hi", streaming=streaming)
    assert isinstance(result.error, error_class), repr(result.error)
    assert result.error.kind is kind
    assert result.error.status_code == status
    assert result.updates == []
    assert (chat.calls, fake_upstream.count()) == (1, 1)


@pytest.mark.parametrize(
    "fault",
    [
        FakeResponse(disconnect_after=3),
        FakeResponse(
            in_band_error={"message": "boom", "type": "server_error", "code": "server_error"},
            error_after=3,
        ),
    ],
    ids=["upstream-cut", "upstream-in-band-error"],
)
async def test_stream_failure_after_output_is_transient(
    litellm_proxy: Proxy, fake_upstream: ThreadedFakeServer, fault: FakeResponse
) -> None:
    """Streaming only: a failure in the middle of a stream. LiteLLM has sent the role and
    two words, then reports the failure in-band as ``{"error": {"code": "500"}}``: a
    numeric in-band code maps through the HTTP status table (TRANSIENT), not to UNKNOWN."""
    fake_upstream.script(fault)
    chat = client(litellm_proxy, UPSTREAM_MODEL)
    async with chat:
        result = await collect(chat, "Hi", streaming=True)
    # What reached the caller is a prefix of what the upstream sent before the cut, never
    # repeated. How much LiteLLM forwards before it notices the cut is its own timing: under
    # load it may notice before it forwarded a word, and the failure is the same.
    received = "".join(u.text for u in result.updates)
    assert "Hello from ".startswith(received), received
    assert isinstance(result.error, ProviderError), repr(result.error)
    assert result.error.kind is FailureKind.TRANSIENT
    assert (chat.calls, fake_upstream.count()) == (1, 1)


# -- a full pipeline: telemetry + ordered failover + per-route breaker and retry -----------


async def test_pipeline_retry_failover_and_breaker(
    litellm_proxy: Proxy, fake_upstream: ThreadedFakeServer, otel: Otel, streaming: bool
) -> None:
    """Route a (LiteLLM -> a failing upstream) is retried once per request, then the request
    fails over to route b (a LiteLLM mock); after two failed requests a's breaker is open and
    the third request goes to b without calling a's upstream."""
    fake_upstream.script(*[FakeResponse.error(500, code="server_error")] * 4)
    a, b = client(litellm_proxy, UPSTREAM_MODEL), client(litellm_proxy, "mock-text")
    sleeps = Sleeps()
    async with failover(otel, resilient(a, "a", sleeps), resilient(b, "b", sleeps)) as chat:
        results = [await collect(chat, CANARY, streaming=streaming) for _ in range(3)]
    for result in results:
        assert result.error is None, repr(result.error)
        assert result.text == MOCK_TEXT
    assert (fake_upstream.count(), a.calls, b.calls) == (4, 4, 3)
    assert sleeps.delays == [0.5, 0.5]  # one retry per request while the breaker was closed
    assert (
        outcomes(otel)
        == [
            ("a", "failed_before_output"),
            ("b", "completed"),
        ]
        * 3
    )
    errors_of_a = [
        (span.attributes or {}).get("error.type")
        for span in otel.attempt_spans()
        if (span.attributes or {}).get("chat_pipeline.route.name") == "a"
    ]
    assert errors_of_a == ["TransientProviderError", "TransientProviderError", "CircuitOpenError"]
    assert all(CANARY not in text for text in otel.everything_exported())


async def test_pipeline_open_breaker_error_when_every_route_fails(
    litellm_proxy: Proxy, fake_upstream: ThreadedFakeServer, otel: Otel, streaming: bool
) -> None:
    a, b = client(litellm_proxy, "mock-500"), client(litellm_proxy, "mock-429")
    sleeps = Sleeps()
    async with failover(
        otel, resilient(a, "a", sleeps, fail_max=1), resilient(b, "b", sleeps, fail_max=1)
    ) as chat:
        first = await collect(chat, "Hi", streaming=streaming)
        second = await collect(chat, "Hi", streaming=streaming)
    # The last route's failure is what the caller sees.
    assert isinstance(first.error, RateLimitedError), repr(first.error)
    assert isinstance(second.error, CircuitOpenError), repr(second.error)
    assert (a.calls, b.calls) == (2, 2)  # the first request's attempts, retried once each
    assert first.updates == [] and second.updates == []


async def test_pipeline_does_not_retry_or_fail_over_a_request_error(
    litellm_proxy: Proxy, otel: Otel, streaming: bool
) -> None:
    a, b = client(litellm_proxy, "mock-context-window"), client(litellm_proxy, "mock-text")
    sleeps = Sleeps()
    async with failover(otel, resilient(a, "a", sleeps), resilient(b, "b", sleeps)) as chat:
        result = await collect(chat, "Hi", streaming=streaming)
    assert isinstance(result.error, RequestInvalidError), repr(result.error)
    assert (a.calls, b.calls) == (1, 0)
    assert sleeps.delays == []
    assert outcomes(otel) == [("a", "failed_before_output")]


async def test_pipeline_retries_a_stream_cut_before_output(
    litellm_proxy: Proxy, fake_upstream: ThreadedFakeServer, otel: Otel
) -> None:
    """Streaming only: the upstream stream is cut after the role-only first event, so the
    caller has seen nothing when LiteLLM reports ``{"error": {"code": "500"}}`` in-band.
    That is a transient pre-output failure: route a's retry runs and serves the answer."""
    fake_upstream.script(FakeResponse(disconnect_after=1))
    a, b = client(litellm_proxy, UPSTREAM_MODEL), client(litellm_proxy, "mock-text")
    sleeps = Sleeps()
    async with failover(otel, resilient(a, "a", sleeps), resilient(b, "b", sleeps)) as chat:
        result = await collect(chat, "Hi", streaming=True)
    assert result.error is None, repr(result.error)
    assert result.text == FAKE_TEXT
    assert (fake_upstream.count(), a.calls, b.calls) == (2, 2, 0)
    assert sleeps.delays == [0.5]
    assert outcomes(otel) == [("a", "completed")]


async def test_pipeline_never_fails_over_after_output(
    litellm_proxy: Proxy, fake_upstream: ThreadedFakeServer, otel: Otel
) -> None:
    """Streaming only: once words reached the caller, a cut stream is the caller's error;
    neither the retry nor the backup runs (no output is duplicated)."""
    # Paced, so the words leave LiteLLM before the cut reaches it: on a loaded machine it
    # read the words and the cut together and forwarded none of them (then the failure is
    # pre-output, which is another test).
    fake_upstream.script(FakeResponse(disconnect_after=3, chunk_delay=0.05))
    a, b = client(litellm_proxy, UPSTREAM_MODEL), client(litellm_proxy, "mock-text")
    sleeps = Sleeps()
    async with failover(otel, resilient(a, "a", sleeps), resilient(b, "b", sleeps)) as chat:
        result = await collect(chat, "Hi", streaming=True)
    # What reached the caller is a prefix of what the upstream sent before the cut, never
    # repeated. How much LiteLLM forwards before it notices the cut is its own timing: under
    # load it may notice before it forwarded a word, and the failure is the same.
    received = "".join(u.text for u in result.updates)
    assert "Hello from ".startswith(received), received
    assert isinstance(result.error, ProviderError), repr(result.error)
    assert (fake_upstream.count(), a.calls, b.calls) == (1, 1, 0)
    assert sleeps.delays == []
    assert outcomes(otel) == [("a", "failed_after_output")]
