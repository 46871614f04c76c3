"""Pipeline layers, one module per layer; routers live in `middleware.routing`.

Each layer is a `DelegatingChatClient` with one job and a settings class; the builder's
``use_*`` methods build them. Names are loaded on first use, so importing one layer does
not import the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from middleware.breaker import BreakerSettings, CircuitBreakerChatClient
    from middleware.cache import (
        CacheSettings,
        CachingChatClient,
        MemoryCacheStore,
        RedisCacheStore,
        SemanticCacheSettings,
    )
    from middleware.configure_options import ConfigureOptionsChatClient
    from middleware.function_invocation import (
        FunctionInvocationSettings,
        FunctionInvokingChatClient,
        operation_scope,
    )
    from middleware.idempotency import (
        IdempotencyStore,
        MemoryIdempotencyStore,
        RedisIdempotencyStore,
    )
    from middleware.logging import LoggingChatClient
    from middleware.response_validation import (
        ResponseValidationChatClient,
        ResponseValidationSettings,
    )
    from middleware.retry import RetryChatClient, RetrySettings
    from middleware.spend import SpendChatClient
    from middleware.telemetry import TelemetryChatClient
    from middleware.tools import Tool, tool

_EXPORTS = {
    "BreakerSettings": "middleware.breaker",
    "CacheSettings": "middleware.cache",
    "CachingChatClient": "middleware.cache",
    "MemoryCacheStore": "middleware.cache",
    "RedisCacheStore": "middleware.cache",
    "SemanticCacheSettings": "middleware.cache",
    "CircuitBreakerChatClient": "middleware.breaker",
    "ConfigureOptionsChatClient": "middleware.configure_options",
    "FunctionInvocationSettings": "middleware.function_invocation",
    "FunctionInvokingChatClient": "middleware.function_invocation",
    "IdempotencyStore": "middleware.idempotency",
    "LoggingChatClient": "middleware.logging",
    "MemoryIdempotencyStore": "middleware.idempotency",
    "RedisIdempotencyStore": "middleware.idempotency",
    "ResponseValidationChatClient": "middleware.response_validation",
    "ResponseValidationSettings": "middleware.response_validation",
    "RetryChatClient": "middleware.retry",
    "RetrySettings": "middleware.retry",
    "SpendChatClient": "middleware.spend",
    "TelemetryChatClient": "middleware.telemetry",
    "Tool": "middleware.tools",
    "operation_scope": "middleware.function_invocation",
    "tool": "middleware.tools",
}

__all__ = [
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
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'middleware' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
