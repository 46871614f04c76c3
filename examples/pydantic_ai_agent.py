"""A Pydantic AI agent whose model is a pipeline: the agent keeps its tools and its loop, and
gets the pipeline's failover, breakers and attempt spans by wrapping its model.

Runs offline on scripted routes (``pip install 'chat-pipeline[pydantic-ai]'``): the primary
route is down (it fails before any output, so the pipeline fails over and the agent never
sees it), the backup asks for the agent's tool, then answers; once whole, once streamed::

    python examples/pydantic_ai_agent.py "What is the weather in Paris?"

For real providers, give `OrderedFailoverChatClient`/``use_ordered_failover`` real clients
(`pipeline.providers`) or build the pipeline from TOML (`ChatPipeline.from_config`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse

from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatPipeline,
    FunctionCallContent,
    FunctionResultContent,
    UsageDetails,
)
from pipeline.errors import TransientProviderError
from pipeline.integrations.pydantic_ai import PipelineModel
from pipeline.testing import ScriptedChatClient, ScriptStep, call_tools, fail, reply


def backup_model(messages: list[ChatMessage], options: ChatOptions | None) -> ScriptStep:
    """A stand-in model: asks for the weather tool, then answers with what it returned."""
    results = [c for m in messages for c in m.contents if isinstance(c, FunctionResultContent)]
    if not results:
        ask = call_tools(FunctionCallContent("call-1", "get_weather", {"city": "Paris"}))
        return dataclasses.replace(ask, usage=UsageDetails(30, 6, 36))
    answer = f"It is {results[-1].result} in Paris."
    words = answer.split(" ")
    chunks = [f"{word} " for word in words[:-1]] + words[-1:]
    return reply(answer, chunks=chunks, usage=UsageDetails(42, 9, 51))


def build_pipeline() -> ChatPipeline:
    primary = ScriptedChatClient(
        fail(TransientProviderError("primary is down")), name="primary", model_id="big-model"
    )
    backup = ScriptedChatClient(backup_model, name="backup", model_id="small-model")
    return (
        ChatPipeline.builder()
        .use_telemetry()  # spans nest under the agent's own when it is instrumented
        .use_ordered_failover([primary, backup])
        .build(name="agent-model")
    )


def build_agent(chat: ChatPipeline) -> Agent[None, str]:
    agent = Agent(PipelineModel(chat), instructions="Answer in one sentence.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Today's weather in a city."""
        return "sunny" if city == "Paris" else "unknown"

    return agent


async def main(question: str) -> str:
    async with build_pipeline() as chat:
        agent = build_agent(chat)
        result = await agent.run(question)
        served = result.all_messages()[-1]
        assert isinstance(served, ModelResponse)
        print(result.output)
        print(f"served by {served.model_name} ({served.provider_details}); usage {result.usage}")

        async with agent.run_stream(question) as run:
            async for piece in run.stream_text(delta=True, debounce_by=None):
                print(piece, end="", flush=True)
            print()
            return await run.get_output()


if __name__ == "__main__":
    asyncio.run(main(" ".join(sys.argv[1:]) or "What is the weather in Paris?"))
