"""Fakes for testing pipelines, this library's and yours.

`ScriptedChatClient` is an in-process chat client that plays a script, one step per call,
and records every call, stream close and client close, so a test can assert exactly which
route was called, with what, and what was released::

    from pipeline.testing import ScriptedChatClient, fail, reply

    primary = ScriptedChatClient([fail(TransientProviderError())], name="primary")
    backup = ScriptedChatClient(reply("hi", chunks=["h", "i"]), name="backup")
    ...
    assert primary.call_count == 1 and backup.call_count == 1

Steps: `reply` (text, optionally streamed in chunks with a delay), `fail` (raise before any
output), `fail_after` (stream some chunks, then raise), `hang` (wait until cancelled,
optionally after some chunks) and `call_tools` (ask for tool calls). Any step can also fail
when its stream is closed (``reply("x").failing_on_close(exc)``). A step may be a callable
of (messages, options) returning a step, for replies that depend on the request.

`FakeOpenAIServer` is a real OpenAI-compatible HTTP server on 127.0.0.1, scriptable per
request with `FakeResponse` (latency, statuses, Retry-After, disconnects, malformed SSE,
in-band errors, hangs), for testing real provider clients end to end.

`FakeBedrockServer` is Amazon Bedrock's Converse and ConverseStream on 127.0.0.1, scripted
with the same `FakeResponse`: it verifies every request's SigV4 signature and streams AWS's
binary event-stream frames (`environment()` points botocore's credentials at it).
`FakeGeminiServer` is the same for Google's Gemini API, with Vertex AI's paths (Gemini and
Anthropic's models) on it; `FakeGoogleTokenServer` is the token endpoint Google service
accounts (made by it, with fresh keys) get their access tokens from.

`FakeFleet` is several such deployments of one model, with latency drawn from seeded
distributions (`Latency`) and faults on a schedule (`Fault`: a fraction of 429s, brownout,
hang then recovery, cuts after output, down), for rehearsing a routing configuration
against partial degradation; it counts what each deployment did (`FleetCounts`,
`FleetCall`).

`FAKE_SERVERS` maps each wire format to its fake server: ``chat-pipeline fake-server
--format`` serves them, and `pipeline.testing.pytest_plugin` (loaded only by a conftest that
names it) has a fixture for each, ``fake_<format>_server``, and `streaming`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.client import ChatClient as ChatClientLike
from pipeline.testing._fake_anthropic import MESSAGES_PATH, FakeAnthropicServer
from pipeline.testing._fake_bedrock import CONVERSE_PATH, FakeBedrockServer
from pipeline.testing._fake_fleet import (
    FakeDeployment,
    FakeFleet,
    Fault,
    FleetCall,
    FleetCounts,
    Latency,
)
from pipeline.testing._fake_gemini import (
    GENERATE_CONTENT,
    RAW_PREDICT,
    FakeGeminiServer,
    FakeGoogleTokenServer,
)
from pipeline.testing._fake_server import (
    CHAT_PATH,
    EMBEDDINGS_PATH,
    MODELS_PATH,
    RESPONSES_PATH,
    FakeOpenAIServer,
    FakeResponse,
    FakeServer,
    RecordedRequest,
)
from pipeline.testing._scripted import (
    RecordedCall,
    ScriptedChatClient,
    ScriptStep,
    call_tools,
    fail,
    fail_after,
    hang,
    reply,
)
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

__all__ = [
    "CHAT_PATH",
    "CONVERSE_PATH",
    "EMBEDDINGS_PATH",
    "FAKE_SERVERS",
    "GENERATE_CONTENT",
    "MESSAGES_PATH",
    "MODELS_PATH",
    "RAW_PREDICT",
    "RESPONSES_PATH",
    "Collected",
    "FakeAnthropicServer",
    "FakeBedrockServer",
    "FakeDeployment",
    "FakeFleet",
    "FakeGeminiServer",
    "FakeGoogleTokenServer",
    "FakeOpenAIServer",
    "FakeResponse",
    "Fault",
    "FleetCall",
    "FleetCounts",
    "Latency",
    "RecordedRequest",
    "RecordedCall",
    "ScriptStep",
    "ScriptedChatClient",
    "call_tools",
    "collect",
    "fail",
    "fail_after",
    "hang",
    "reply",
]

FAKE_SERVERS: Mapping[str, type[FakeServer]] = {
    fake.wire_format: fake
    for fake in (FakeOpenAIServer, FakeAnthropicServer, FakeGeminiServer, FakeBedrockServer)
}
"""Each wire format's fake server, by the name ``chat-pipeline fake-server --format`` takes
(``openai`` first: the command's default)."""


@dataclass(slots=True)
class Collected:
    """What one request produced: the response (streamed ones assembled), every update the
    caller received, and the exception it ended with, if any."""

    response: ChatResponse | None
    updates: list[ChatResponseUpdate]
    error: BaseException | None

    @property
    def text(self) -> str:
        return (
            "".join(u.text for u in self.updates) if self.response is None else self.response.text
        )


async def collect(
    client: ChatClientLike,
    messages: Messages,
    options: ChatOptions | None = None,
    *,
    streaming: bool,
) -> Collected:
    """Run one request through `get_response` or `get_streaming_response` and record it.

    Exceptions are captured in `Collected.error` (cancellation is not: it propagates), so
    one test body can assert the same outcome for both modes.
    """
    if not streaming:
        try:
            response = await client.get_response(messages, options)
        except Exception as exc:
            return Collected(None, [], exc)
        return Collected(response, response.to_updates(), None)
    updates: list[ChatResponseUpdate] = []
    try:
        async with contextlib.aclosing(client.get_streaming_response(messages, options)) as stream:
            async for update in stream:
                updates.append(update)
    except Exception as exc:
        return Collected(None, updates, exc)
    return Collected(ChatResponse.from_updates(updates), updates, None)
