"""The public surface is deliberate: every name in __all__ exists, and nothing else is added
by accident."""

import importlib

import pytest

SURFACES = {
    "pipeline": {
        "ChatClient",
        "ChatClientMetadata",
        "ChatMessage",
        "ChatOptions",
        "ChatPipeline",
        "ChatPipelineBuilder",
        "ChatResponse",
        "ChatResponseUpdate",
        "ChatRole",
        "Content",
        "DataContent",
        "DelegatingChatClient",
        "EmbeddingGenerator",
        "FunctionCallContent",
        "FunctionResultContent",
        "Messages",
        "TextContent",
        "UsageDetails",
    },
    "middleware.routing": {
        "AttemptOutcome",
        "FailoverAttempt",
        "FailoverChatClient",
        "OrderedFailoverChatClient",
        "Price",
        "RequestBudget",
        "Route",
        "RoutingChatClient",
        "RoutingContext",
        "RoutingSelection",
        "RouteScore",
        "SemanticRoutingChatClient",
        "TieredRoutingChatClient",
        "current_budget",
    },
    "pipeline.providers": {
        "AnthropicChatClient",
        "AzureOpenAIChatClient",
        "HashingEmbeddingGenerator",
        "OllamaChatClient",
        "OpenAIChatClient",
        "OpenAIEmbeddingGenerator",
    },
    "pipeline.testing": {
        "CHAT_PATH",
        "Collected",
        "EMBEDDINGS_PATH",
        "FakeAnthropicServer",
        "FakeOpenAIServer",
        "MESSAGES_PATH",
        "MODELS_PATH",
        "FakeResponse",
        "RecordedCall",
        "RecordedRequest",
        "ScriptStep",
        "ScriptedChatClient",
        "call_tools",
        "collect",
        "fail",
        "fail_after",
        "hang",
        "reply",
    },
    "pipeline.errors": {
        "AuthenticationError",
        "ChatPipelineError",
        "CircuitOpenError",
        "ConfigError",
        "ContentFilteredError",
        "ContextLengthExceededError",
        "FailureKind",
        "ProviderError",
        "RateLimitedError",
        "RequestBudgetExceededError",
        "RequestInvalidError",
        "RoutingError",
        "TransientProviderError",
        "UnknownProviderError",
        "classify",
        "is_failover_eligible",
        "is_retryable",
        "kind_for_status",
        "parse_retry_after",
        "provider_error",
        "retry_after_of",
    },
}


@pytest.mark.parametrize("module_name", sorted(SURFACES))
def test_all_is_exactly_the_public_surface(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert set(module.__all__) == SURFACES[module_name]
    for name in module.__all__:
        assert hasattr(module, name), name


@pytest.mark.parametrize(
    "module_name",
    [
        "pipeline.types",
        "pipeline.client",
        "pipeline.builder",
        "pipeline.testing",
        "pipeline.sync",
        "middleware",
        "middleware.configure_options",
        "middleware.logging",
        "middleware.routing.context",
        "middleware.routing.router",
        "middleware.routing.failover",
    ],
)
def test_every_module_declares_all(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.{name}"


def test_pipeline_does_not_import_middleware_or_cli_eagerly() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pipeline, pipeline.errors, pipeline.testing;"
        "print(sorted(m for m in sys.modules if m.startswith('middleware') or m == 'pipeline.cli'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
