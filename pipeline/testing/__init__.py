"""Fakes for testing pipelines, this library's and yours.

The details and the reasons: the design notes (docs/internals.md).
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
