"""The ``[gateway]`` table: validated by the config loader like every section."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.gateway.settings import GatewaySettings, api_keys

ROUTES = {
    "small": {"provider": "scripted", "reply": "s"},
    "large": {"provider": "scripted", "reply": "l"},
}
ROUTER = {"kind": "ordered", "order": ["small", "large"]}


def load(gateway: Any, **extra: Any) -> Any:
    return parse_config({"routes": ROUTES, "router": ROUTER, "gateway": gateway, **extra})


def problems(gateway: Any, **extra: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as raised:
        load(gateway, **extra)
    return list(raised.value.problems)


def test_absent_means_none_and_defaults_apply() -> None:
    assert parse_config({"routes": ROUTES, "router": ROUTER}).gateway is None
    settings = load({}).gateway
    assert settings == GatewaySettings()
    assert settings.max_body_bytes == 4 * 1024 * 1024
    assert settings.exposed_models(["small", "large"]) == {
        "pipeline": "pipeline",
        "small": "small",
        "large": "large",
    }


def test_a_full_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYS", "a, b ,,c")
    monkeypatch.setenv("REDIS", "redis://127.0.0.1:1/0")
    settings = load(
        {
            "api_keys_env": "KEYS",
            "max_body_bytes": 65536,
            "max_concurrent_per_key": 4,
            "retry_after": 2.5,
            "drain_timeout": 10,
            "models": {"gpt-4o-mini": "small", "smart": "pipeline"},
            "redis_url_env": "REDIS",
        }
    ).gateway
    assert settings.max_concurrent_per_key == 4 and settings.drain_timeout == 10
    assert settings.exposed_models(["small", "large"]) == {
        "gpt-4o-mini": "small",
        "smart": "pipeline",
    }
    assert api_keys("a, b ,,c") == ["a", "b", "c"]


def test_every_problem_is_reported_with_its_key_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_KEYS", raising=False)
    monkeypatch.delenv("NO_SUCH_REDIS", raising=False)
    found = dict(
        problems(
            {
                "api_keys_env": "NO_SUCH_KEYS",
                "redis_url_env": "NO_SUCH_REDIS",
                "models": {"a": "smal", "b": "pipeline"},
                "max_body_byte": 10,
                "retry_after": 0,
            }
        )
    )
    assert found == {
        "gateway.max_body_byte": "unknown setting; did you mean 'max_body_bytes'?",
        "gateway.retry_after": "expected positive, got 0",
    }
    # The environment is checked once the table itself is valid.
    found = dict(
        problems(
            {
                "api_keys_env": "NO_SUCH_KEYS",
                "redis_url_env": "NO_SUCH_REDIS",
                "models": {"a": "smal", "b": "pipeline"},
            }
        )
    )
    assert found == {
        "gateway.api_keys_env": "the environment variable NO_SUCH_KEYS is not set",
        "gateway.redis_url_env": "the environment variable NO_SUCH_REDIS is not set",
        "gateway.models.a": (
            "names no route: 'smal' (a route name or 'pipeline'); did you mean 'small'?"
        ),
    }


def test_keys_variable_holding_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMPTY_KEYS", " , ")
    assert problems({"api_keys_env": "EMPTY_KEYS"}) == [
        (
            "gateway.api_keys_env",
            "the environment variable EMPTY_KEYS holds no key (expected comma-separated keys)",
        )
    ]


@pytest.mark.parametrize(
    ("table", "path"),
    [
        ({"api_keys": "sk-secret"}, "gateway.api_keys"),
        ({"api_keys_env": "not a name"}, "gateway.api_keys_env"),
        ({"models": {"bad name!": "small"}}, "gateway.models"),
        ({"max_body_bytes": 10}, "gateway.max_body_bytes"),
        ({"max_concurrent_per_key": 0}, "gateway.max_concurrent_per_key"),
        ({"drain_timeout": -1}, "gateway.drain_timeout"),
    ],
)
def test_bad_values(table: dict[str, Any], path: str) -> None:
    found = problems(table)
    assert [where for where, _ in found] == [path]
    assert "sk-secret" not in str(found)


@pytest.mark.parametrize(
    "table",
    [
        # `$` matches before a trailing newline: every pattern guarding input is full-matched.
        {"models": {"claude-opus\n": "small"}},
        {"models": {"*\n": "small"}},
        {"models": {"claude-*\n": "pipeline"}},
    ],
)
def test_model_names_and_patterns_ending_with_a_newline_are_refused(table: dict[str, Any]) -> None:
    ((where, what),) = problems(table)
    assert where == "gateway.models" and "model names are" in what


@pytest.mark.parametrize("key", ["api_keys_env", "redis_url_env"])
def test_variable_names_ending_with_a_newline_are_refused(key: str) -> None:
    ((where, what),) = problems({key: "NAME\n"})
    assert where == f"gateway.{key}" and "expected the name of an environment variable" in what


def test_a_route_key_variable_ending_with_a_newline_is_refused() -> None:
    routes = {"small": {"provider": "openai", "model": "m", "api_key_env": "OPENAI_KEY\n"}}
    with pytest.raises(ConfigError) as raised:
        parse_config({"routes": routes})
    ((where, what),) = raised.value.problems
    assert where == "routes.small.api_key_env"
    assert "expected the name of an environment variable" in what


def test_a_misspelt_section_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"routes": ROUTES, "router": ROUTER, "gatway": {}})
    assert raised.value.problems == (("gatway", "unknown setting; did you mean 'gateway'?"),)


def test_environments_overlay_the_table() -> None:
    config = parse_config(
        {
            "routes": ROUTES,
            "router": ROUTER,
            "gateway": {"drain_timeout": 5, "max_concurrent_per_key": 8},
            "environments": {"production": {"gateway": {"drain_timeout": 60}}},
        },
        "production",
    )
    assert (config.gateway.drain_timeout, config.gateway.max_concurrent_per_key) == (60, 8)


def test_the_settings_need_neither_starlette_nor_uvicorn() -> None:
    code = (
        "import sys, pipeline.config, pipeline.gateway, pipeline.gateway.settings, "
        "pipeline.gateway.wire; "
        "print(sorted(m for m in ('starlette', 'uvicorn') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_connection_settings_and_their_bounds() -> None:
    settings = load(
        {
            "header_timeout": 2.5,
            "body_timeout": 60,
            "keep_alive_timeout": 120,
            "max_connections": 4096,
            "prometheus_metrics": True,
        }
    ).gateway
    assert (settings.header_timeout, settings.body_timeout) == (2.5, 60)
    assert (settings.keep_alive_timeout, settings.max_connections) == (120, 4096)
    assert settings.prometheus_metrics is True
    found = dict(problems({"header_timeout": 0, "keep_alive_timeout": 0.5, "max_connections": 0}))
    assert set(found) == {
        "gateway.header_timeout",
        "gateway.keep_alive_timeout",
        "gateway.max_connections",
    }


def test_idle_connections_are_kept_longer_than_the_sdks_pool_keeps_them() -> None:
    # uvicorn's default keep-alive (5 s) equals the openai SDK's (httpx) pool expiry: a
    # request sent on a connection idle just under 5 s could meet the server closing it.
    import openai

    from pipeline.gateway.server import uvicorn_options

    client = openai.OpenAI(api_key="unused")
    expiry = client._client._transport._pool._keepalive_expiry  # type: ignore[attr-defined]
    client.close()
    options = uvicorn_options(GatewaySettings())
    assert options["timeout_keep_alive"] >= 2 * expiry
