"""The ``[cache]`` table: where the layer goes, what it builds, and its errors."""

from __future__ import annotations

from typing import Any

import pytest

from middleware.cache import (
    DEFAULT_IGNORE_FIELDS,
    CachingChatClient,
    MemoryCacheStore,
    RedisCacheStore,
)
from middleware.tools import tool
from pipeline import ChatPipeline
from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.testing import collect

ROUTES = {
    "a": {"provider": "scripted", "reply": "from a"},
    "b": {"provider": "scripted", "reply": "from b"},
}
ROUTER = {"kind": "ordered", "order": ["a", "b"]}


def layer_of(chat: ChatPipeline) -> CachingChatClient:
    current: Any = chat.client
    for _ in range(10):
        if isinstance(current, CachingChatClient):
            return current
        current = current.inner
    raise AssertionError("no cache layer")


@tool
def noop() -> str:
    """Do nothing."""
    return "done"


async def test_the_cache_sits_between_the_tool_loop_and_the_router(streaming: bool) -> None:
    config = parse_config(
        {
            "routes": ROUTES,
            "router": ROUTER,
            "layers": {"telemetry": True, "function_invocation": True},
            "cache": {"ttl": 60, "max_bytes": 100_000},
        }
    )
    chat = config.build(tools=[noop])
    layers = chat.describe()
    assert layers[:3] == [
        "TelemetryChatClient",
        "FunctionInvokingChatClient(noop)",
        "CachingChatClient(MemoryCacheStore)",
    ]
    layer = layer_of(chat)
    assert isinstance(layer.store, MemoryCacheStore) and layer.store.max_bytes == 100_000
    assert layer.settings.ttl == 60
    assert (await collect(chat, "hi", streaming=streaming)).text == "from a"
    assert (await collect(chat, "hi", streaming=streaming)).text == "from a"
    await chat.aclose()


def test_an_environment_turns_it_off() -> None:
    config = parse_config(
        {
            "routes": {"a": ROUTES["a"]},
            "cache": {},
            "environments": {"dev": {"cache": {"enabled": False}}},
        },
        environment="dev",
    )
    assert not any("Caching" in layer for layer in config.build().describe())


def test_redis_and_semantic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_REDIS", "redis://127.0.0.1:1/0")
    config = parse_config(
        {
            "routes": {"a": ROUTES["a"]},
            "cache": {
                "store": "redis",
                "redis_url_env": "CACHE_REDIS",
                "timeout": 0.05,
                "semantic": {"embeddings": {"provider": "hashing"}, "threshold": 0.97},
            },
        }
    )
    layer = layer_of(config.build())
    assert isinstance(layer.store, RedisCacheStore) and layer.store.timeout == 0.05
    assert layer.semantic is not None and layer.semantic.threshold == 0.97
    assert layer.describe_layer() == "CachingChatClient(RedisCacheStore, semantic)"


@pytest.mark.parametrize(
    ("cache", "message"),
    [
        ({"ttl": 0}, "cache.ttl: expected positive"),
        ({"store": "redis"}, "cache: store = 'redis' needs redis_url_env"),
        ({"store": "redis", "redis_url_env": "CACHE_UNSET_VAR"}, "CACHE_UNSET_VAR is not set"),
        ({"store": "redis", "redis_url": "redis://:secret@host:6379/0"}, "holds a password"),
        ({"scope": "x"}, "scope: takes code"),
        ({"tll": 5}, "cache.tll: unknown setting; did you mean 'ttl'?"),
        ({"semantic": {"embeddings": {"provider": "hashing"}, "threshold": 2}}, "threshold"),
        ({"partition_by": ["tenant"]}, "cache.partition_by[0]: expected one of"),
        ({"ignore_fields": "metadata"}, "cache.ignore_fields"),
    ],
)
def test_errors_name_the_key_path(cache: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"routes": {"a": ROUTES["a"]}, "cache": cache})
    assert message in str(raised.value)
    assert "secret" not in str(raised.value)


def test_fields_left_out_of_the_key_extend_the_defaults_and_partitions_are_settings() -> None:
    config = parse_config(
        {
            "routes": {"a": ROUTES["a"]},
            "cache": {"ignore_fields": ["x_trace"], "partition_by": ["user", "session"]},
        }
    )
    layer = layer_of(config.build())
    assert layer.settings.ignore_fields == DEFAULT_IGNORE_FIELDS | {"x_trace"}
    assert layer.settings.partition_by == {"user", "session"}
    plain = layer_of(parse_config({"routes": {"a": ROUTES["a"]}, "cache": {}}).build())
    assert plain.settings.ignore_fields == DEFAULT_IGNORE_FIELDS
    assert plain.settings.partition_by == frozenset()
