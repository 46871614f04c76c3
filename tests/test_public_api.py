"""The public surface is deliberate: every name in __all__ exists, and nothing else is added
by accident."""

import importlib

import pytest

SURFACES = {
    "pipeline": {
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
        "CustomTool",
        "ReasoningOptions",
        "TextContent",
        "ToolChoice",
        "ToolDefinition",
        "UsageDetails",
    },
    "middleware.routing": {
        "AffinitySettings",
        "AttemptOutcome",
        "BalancedFailoverChatClient",
        "BalancedSettings",
        "HealthSettings",
        "HealthStore",
        "HedgingChatClient",
        "HedgingSettings",
        "RedisHealthStore",
        "RouteHealth",
        "RouteStats",
        "FailoverAttempt",
        "FailoverChatClient",
        "FailoverSettings",
        "MemoryAffinityStore",
        "OrderedFailoverChatClient",
        "Price",
        "RedisAffinityStore",
        "Route",
        "RoutingChatClient",
        "RoutingContext",
        "RoutingSelection",
        "FitReport",
        "RouteDecision",
        "RouteProfile",
        "RouteScore",
        "RoutingMetrics",
        "SemanticRoutingChatClient",
        "SemanticSettings",
        "SessionAffinity",
        "TieredRoutingChatClient",
    },
    "middleware": {
        "BreakerSettings",
        "CacheSettings",
        "CachingChatClient",
        "CircuitBreakerChatClient",
        "ConfigureOptionsChatClient",
        "FunctionInvocationSettings",
        "FunctionInvokingChatClient",
        "IdempotencyStore",
        "LoggingChatClient",
        "MemoryCacheStore",
        "MemoryIdempotencyStore",
        "RedisCacheStore",
        "RedisIdempotencyStore",
        "ResponseValidationChatClient",
        "ResponseValidationSettings",
        "RetryChatClient",
        "RetrySettings",
        "SemanticCacheSettings",
        "SpendChatClient",
        "TelemetryChatClient",
        "Tool",
        "operation_scope",
        "tool",
    },
    "middleware.spend": {"AttributionSource", "SpendChatClient"},
    "pipeline.pricing": {
        "CHARS_PER_TOKEN",
        "PROVIDERS",
        "Cost",
        "GenAIPricesBook",
        "Price",
        "PriceBook",
        "attempt_usage",
        "default_book",
        "estimate_input_tokens",
        "estimated_output_tokens",
        "priced",
        "priced_attempt",
        "reached_provider",
        "response_characters",
        "streamed_characters",
    },
    "pipeline.spend": {
        "GROUPS",
        "Attribution",
        "LedgerSettings",
        "PostgresSpendStore",
        "SQLiteSpendStore",
        "SpendLedger",
        "SpendRecord",
        "SpendStore",
        "SpendSummary",
        "SqlSpendStore",
    },
    "pipeline.providers": {
        "AnthropicChatClient",
        "AzureOpenAIChatClient",
        "BedrockChatClient",
        "DeepSeekChatClient",
        "FireworksChatClient",
        "GroqChatClient",
        "GeminiChatClient",
        "HashingEmbeddingGenerator",
        "LocalEmbeddingGenerator",
        "MistralChatClient",
        "OllamaChatClient",
        "OpenAIChatClient",
        "OpenAIEmbeddingGenerator",
        "OpenAIResponsesChatClient",
        "OpenRouterChatClient",
        "TogetherChatClient",
        "VLLMChatClient",
        "XAIChatClient",
        "VertexChatClient",
    },
    "pipeline.testing": {
        "CHAT_PATH",
        "CONVERSE_PATH",
        "Collected",
        "EMBEDDINGS_PATH",
        "FAKE_SERVERS",
        "FakeAnthropicServer",
        "FakeBedrockServer",
        "FakeDeployment",
        "FakeFleet",
        "FakeGeminiServer",
        "FakeGoogleTokenServer",
        "FakeOpenAIServer",
        "GENERATE_CONTENT",
        "RAW_PREDICT",
        "Fault",
        "FleetCall",
        "FleetCounts",
        "Latency",
        "MESSAGES_PATH",
        "MODELS_PATH",
        "FakeResponse",
        "RESPONSES_PATH",
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
    "pipeline.gateway": {
        "GatewaySettings",
        "MemoryResponseStore",
        "PIPELINE_MODEL",
        "RedisResponseStore",
        "ResponseStore",
        "create_app",
        "serve",
    },
    "pipeline.keys": {
        "SECRET_PREFIX",
        "Budget",
        "DatabaseKeyStore",
        "IssuedKey",
        "KeyNotFoundError",
        "KeyRecord",
        "KeyRing",
        "KeyStore",
        "Lookup",
        "MemoryKeyStore",
        "PostgresKeyStore",
        "SQLiteKeyStore",
        "VirtualKey",
        "hash_secret",
        "model_allowed",
        "period_bounds",
    },
    "pipeline.integrations": set(),
    "pipeline.integrations.pydantic_ai": {"PipelineModel", "PipelineStreamedResponse"},
    "pipeline.integrations.langchain": {"PipelineChatModel"},
    "pipeline.errors": {
        "AttemptTimeoutError",
        "AuthenticationError",
        "BudgetExceededError",
        "BudgetUnavailableError",
        "ChatPipelineError",
        "CircuitOpenError",
        "ConfigError",
        "ContentFilteredError",
        "ContextLengthExceededError",
        "FailureKind",
        "KeyNotFoundError",
        "ProviderError",
        "QuotaExhaustedError",
        "RateLimitExceededError",
        "RateLimitedError",
        "RequestBudgetExceededError",
        "RequestInvalidError",
        "RequestRefusedError",
        "RequestTimeoutError",
        "ResponseValidationError",
        "RoutingError",
        "SchemaVersionError",
        "SemanticIndexError",
        "ToolArgumentsError",
        "TransientProviderError",
        "UnknownProviderError",
        "UnsendableRequestError",
        "WireError",
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
        "middleware.routing.semantic",
        "middleware.routing.tiered",
        "middleware.routing.hedging",
        "middleware.retry",
        "middleware.breaker",
        "middleware.telemetry",
        "middleware.function_invocation",
        "middleware.tools",
        "middleware.idempotency",
        "middleware.response_validation",
        "middleware.cache",
        "middleware.budgets",
        "pipeline.keys",
        "pipeline.config",
        "pipeline.evals",
        "pipeline.errors",
        "pipeline.gateway.settings",
        "pipeline.gateway.wire",
        "pipeline.gateway.app",
        "pipeline.gateway.server",
        "pipeline.gateway.response_store",
    ],
)
def test_every_module_declares_all(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.{name}"


def fresh_interpreter(code: str) -> str:
    """What `code` prints in a new interpreter (so imports start from nothing)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_pipeline_does_not_import_middleware_or_cli_eagerly() -> None:
    printed = fresh_interpreter(
        "import sys, pipeline, pipeline.errors, pipeline.testing;"
        "print(sorted(m for m in sys.modules if m.startswith('middleware') or m == 'pipeline.cli'))"
    )
    assert printed == "[]"


def test_import_pipeline_loads_no_numpy_and_no_middleware() -> None:
    printed = fresh_interpreter(
        "import sys, pipeline;"
        "print([m for m in ('numpy', 'middleware', 'pydantic') if m in sys.modules])"
    )
    assert printed == "[]"


def test_routing_loads_numpy_only_for_semantic_routing() -> None:
    printed = fresh_interpreter(
        "import sys, middleware.routing as r; before = 'numpy' in sys.modules;"
        "r.SemanticRoutingChatClient; print(before, 'numpy' in sys.modules)"
    )
    assert printed == "False True"


def test_middleware_names_load_from_their_modules() -> None:
    import middleware
    from middleware.retry import RetryChatClient

    assert middleware.RetryChatClient is RetryChatClient
    with pytest.raises(AttributeError):
        middleware.Nope  # noqa: B018


def test_version_is_the_distributions() -> None:
    from importlib.metadata import version

    import pipeline

    assert pipeline.__version__ == version("chat-pipeline")


def test_private_modules_are_imported_only_by_their_package() -> None:
    """A package's `_private` modules are its own: others use its public names (or the
    core's private modules, which every layer may use). The telemetry layer and the CLI take
    routing's telemetry names from `pipeline._semconv`."""
    import ast
    from pathlib import Path

    import pipeline

    root = Path(pipeline.__file__).resolve().parents[1]
    found = []
    for path in sorted(
        [*root.joinpath("pipeline").rglob("*.py"), *root.joinpath("middleware").rglob("*.py")]
    ):
        package = ".".join(path.relative_to(root).parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                owner, _, last = name.rpartition(".")
                if last.startswith("_") and owner != package and owner.startswith("middleware"):
                    found.append(f"{path.relative_to(root)}: {name}")
    # The config loader validates a semantic router's settings without numpy: they live
    # apart from the router for that.
    assert found == ["pipeline/config.py: middleware.routing._semantic_settings"]
