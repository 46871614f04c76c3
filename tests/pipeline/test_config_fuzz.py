"""Arbitrary TOML-shaped data given to the loader: only a ConfigError or a pipeline."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import ChatPipeline
from pipeline.config import build_pipeline
from pipeline.errors import ConfigError

KEYS = [
    "routes",
    "router",
    "layers",
    "environments",
    "provider",
    "model",
    "base_url",
    "endpoint",
    "deployment",
    "api_version",
    "api_key_env",
    "api_key",
    "timeout",
    "first_chunk_timeout",
    "stream_idle_timeout",
    "reply",
    "max_input_tokens",
    "capabilities",
    "price",
    "input_per_million",
    "output_per_million",
    "retry",
    "breaker",
    "max_attempts",
    "initial_delay",
    "max_delay",
    "jitter",
    "max_retry_after",
    "fail_max",
    "reset_timeout",
    "name",
    "redis_url_env",
    "redis",
    "kind",
    "order",
    "default",
    "fallback",
    "kinds",
    "profiles",
    "embeddings",
    "dimensions",
    "threshold",
    "top_k",
    "aggregation",
    "request_timeout",
    "min_attempt_budget",
    "max_attempts_per_request",
    "max_provider_calls_per_request",
    "attempt_timeout",
    "telemetry",
    "logging",
    "function_invocation",
    "instructions",
    "affinity",
    "store",
    "ttl",
    "max_sessions",
    "a",
    "b",
    "",
    " ",
]
SCALARS = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            "openai",
            "azure_openai",
            "ollama",
            "scripted",
            "ordered",
            "tiered",
            "semantic",
            "hashing",
            "memory",
            "redis",
            "a",
            "b",
            "",
            " ",
            "http://[::1",
            "ftp://x",
            "http://user:pw@h/v1",
            "http://127.0.0.1:9/v1",
            "gpt",
            "OPENAI_API_KEY",
            "x" * 300,
            "\x00",
            "mean",
            "sum",
            "max",
        ]
    ),
    st.text(max_size=8),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from(KEYS), children, max_size=5),
    ),
    max_leaves=25,
)
VALID: dict[str, Any] = {
    "routes": {
        "a": {
            "provider": "openai",
            "model": "m",
            "base_url": "http://127.0.0.1:9/v1",
            "retry": {"max_attempts": 2},
            "breaker": {"fail_max": 3},
            "price": {"input_per_million": 1.0, "output_per_million": 2.0},
        },
        "b": {"provider": "scripted", "reply": "ok", "capabilities": ["json"]},
    },
    "router": {"kind": "tiered", "default": "a", "fallback": {"a": ["b"]}},
    "layers": {"telemetry": True},
}


def outcome(data: Any) -> None:
    error: ConfigError | None = None
    try:
        chat = build_pipeline(data)
    except ConfigError as exc:
        error = exc
    if error is None:
        assert isinstance(chat, ChatPipeline)
        return
    assert str(error)
    for path, message in error.problems:
        assert isinstance(path, str) and isinstance(message, str) and message


@settings(suppress_health_check=[HealthCheck.too_slow])  # recursive values, up to 25 leaves
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
def test_any_document_is_a_pipeline_or_a_config_error(data: dict[str, Any]) -> None:
    outcome(data)


def _paths(value: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found.extend(_paths(child, (*prefix, key)))
    return found


PATHS = _paths(VALID)


@settings(suppress_health_check=[HealthCheck.too_slow])  # recursive values, up to 25 leaves
@given(st.lists(st.tuples(st.sampled_from(PATHS), VALUES), min_size=1, max_size=3))
def test_a_valid_document_with_any_value_replaced(
    changes: list[tuple[tuple[str, ...], Any]],
) -> None:
    data = copy.deepcopy(VALID)
    for path, value in changes:
        target: Any = data
        for key in path[:-1]:
            if not isinstance(target, dict) or not isinstance(target.get(key), dict):
                break
            target = target[key]
        else:
            target[path[-1]] = value
    outcome(data)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("router", "request_timeout"), math.inf),
        (("router", "request_timeout"), math.nan),
        (("routes", "a", "first_chunk_timeout"), 0),
        (("routes", "a", "stream_idle_timeout"), math.nan),
        (("routes", "a", "breaker", "reset_timeout"), 0),
        (("routes", "a", "retry", "initial_delay"), math.nan),
        (("routes", "a", "retry", "max_delay"), math.inf),
        (("routes", "a", "timeout"), 10**400),
        (("routes", "a", "base_url"), "http://[::1"),
        (("routes", "a", "price", "input_per_million"), math.nan),
    ],
)
def test_values_a_constructor_would_refuse_are_config_errors(
    path: tuple[str, ...], value: Any
) -> None:
    data = copy.deepcopy(VALID)
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ConfigError) as caught:
        build_pipeline(data)
    assert caught.value.key_path == ".".join(path)


def test_an_azure_endpoint_must_be_http(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "k")
    data = {"routes": {"a": {"provider": "azure_openai", "endpoint": "ftp://x", "deployment": "d"}}}
    with pytest.raises(ConfigError, match=r"routes\.a\.endpoint: expected an http\(s\) URL"):
        build_pipeline(data)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://[::1", "redis://h:notaport"])
def test_a_malformed_redis_url_is_a_config_error(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("BREAKER_REDIS", url)
    data = copy.deepcopy(VALID)
    data["routes"]["a"]["breaker"]["redis_url_env"] = "BREAKER_REDIS"
    with pytest.raises(ConfigError) as caught:
        build_pipeline(data)
    assert caught.value.key_path == "routes.a.breaker.redis_url_env"
    assert url not in str(caught.value)
