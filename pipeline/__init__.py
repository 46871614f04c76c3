"""chat-pipeline: a tested, observable routing layer between an application and its LLMs.

The public surface: core types, the client protocol and `ChatPipeline`. Providers live in
`pipeline.providers`, errors in `pipeline.errors`, test fakes in `pipeline.testing`, and
layers and routers in `middleware`.
"""

from pipeline._version import __version__ as __version__
from pipeline.builder import ChatPipeline, ChatPipelineBuilder
from pipeline.client import (
    ChatClient,
    ChatClientMetadata,
    DelegatingChatClient,
    EmbeddingGenerator,
)
from pipeline.types import (
    CacheMode,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    ChatTool,
    Content,
    CustomTool,
    DataContent,
    FinishReason,
    FunctionCallContent,
    FunctionResultContent,
    FunctionTool,
    Messages,
    RawTool,
    ReasoningContent,
    ReasoningOptions,
    TextContent,
    ToolChoice,
    ToolDefinition,
    UsageDetails,
)

__all__ = [
    "CacheMode",
    "ChatClient",
    "ChatClientMetadata",
    "ChatMessage",
    "ChatOptions",
    "ChatPipeline",
    "ChatPipelineBuilder",
    "ChatResponse",
    "ChatResponseUpdate",
    "ChatRole",
    "ChatTool",
    "Content",
    "CustomTool",
    "DataContent",
    "DelegatingChatClient",
    "EmbeddingGenerator",
    "FinishReason",
    "FunctionCallContent",
    "FunctionResultContent",
    "FunctionTool",
    "Messages",
    "RawTool",
    "ReasoningContent",
    "ReasoningOptions",
    "TextContent",
    "ToolChoice",
    "ToolDefinition",
    "UsageDetails",
]
