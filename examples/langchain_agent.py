"""A LangChain tool loop whose chat model is a pipeline: the loop keeps running its own tools,
and the model gets the pipeline's failover, breakers and attempt spans.

Runs offline on scripted routes (``pip install 'chat-pipeline[langchain]'``): the primary
route is down (it fails before any output, so the pipeline fails over and the loop never sees
it), the backup asks for the tool, then answers; once with ``invoke``, once with ``stream``::

    python examples/langchain_agent.py "What is the weather in Paris?"

The same model drops into a LangGraph graph (``ToolNode`` + ``tools_condition``) unchanged.
"""

from __future__ import annotations

import dataclasses
import sys

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatPipeline,
    FunctionCallContent,
    FunctionResultContent,
    UsageDetails,
)
from pipeline.errors import TransientProviderError
from pipeline.integrations.langchain import PipelineChatModel
from pipeline.testing import ScriptedChatClient, ScriptStep, call_tools, fail, reply


@tool
def get_weather(city: str) -> str:
    """Today's weather in a city."""
    return "sunny" if city == "Paris" else "unknown"


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
        .use_telemetry()
        .use_ordered_failover([primary, backup])
        .build(name="agent-model")
    )


def run_loop(model: PipelineChatModel, question: str, *, streaming: bool) -> AIMessage:
    """The classic tool loop: call the model, run the tools it asks for, send the results
    back (each `ToolMessage` names the call it answers), until it answers in text."""
    bound = model.bind_tools([get_weather])
    messages: list[BaseMessage] = [
        SystemMessage("Answer in one sentence."),
        HumanMessage(question),
    ]
    for _ in range(5):  # a bounded loop: a model that keeps asking for tools ends here
        if streaming:
            answer = None
            for chunk in bound.stream(messages):
                print(chunk.content, end="", flush=True)
                answer = chunk if answer is None else answer + chunk
        else:
            answer = bound.invoke(messages)
        assert isinstance(answer, AIMessage)
        messages.append(answer)
        if not answer.tool_calls:
            return answer
        for call in answer.tool_calls:
            messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    raise RuntimeError("the model kept asking for tools")


def main(question: str) -> str:
    model = PipelineChatModel(chat=build_pipeline())
    try:
        answer = run_loop(model, question, streaming=False)
        print(answer.content)
        route = {k: v for k, v in answer.response_metadata.items() if k.startswith("route")}
        print(f"served by {answer.response_metadata['model_name']} ({route}); ", end="")
        print(f"usage {answer.usage_metadata}")
        streamed = run_loop(model, question, streaming=True)
        print()
        return str(streamed.content)
    finally:
        model.close()  # closes the pipeline on the event loop it ran on


if __name__ == "__main__":
    main(" ".join(sys.argv[1:]) or "What is the weather in Paris?")
