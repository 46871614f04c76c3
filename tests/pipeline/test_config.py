import inspect
import os
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest

from middleware.function_invocation import tool
from middleware.retry import RetrySettings
from pipeline import ChatOptions, ChatPipeline
from pipeline._semconv import (
    BREAKER_NAME,
    BREAKER_TO,
    HEALTH_IN_FLIGHT_METRIC,
    ROUTE_NAME,
    STATE_CHANGE_METRIC,
)
from pipeline.config import (
    AffinityConfig,
    AnthropicRouteConfig,
    AzureOpenAIRouteConfig,
    BreakerConfig,
    LayersConfig,
    OllamaRouteConfig,
    OpenAIRouteConfig,
    RouteConfig,
    ScriptedRouteConfig,
    TieredRouterConfig,
    build_pipeline,
    load_config,
    merge,
    parse_config,
)
from pipeline.errors import ConfigError, ProviderError
from pipeline.testing import FakeOpenAIServer, FakeResponse, collect
from tests.otel import Otel

# The `provider` of each route class, in the union's order (as problems list them).
PROVIDERS = str(
    [
        name
        for table in typing.get_args(typing.get_args(RouteConfig)[0])
        for name in typing.get_args(table.model_fields["provider"].annotation)
    ]
)
"""Every route table's provider names, in the order of the route union (a vendor table
names several)."""

BASE = """
[routes.small]
provider = "scripted"
reply = "small answer"
max_input_tokens = 100
capabilities = ["json"]
retry = { max_attempts = 2 }
breaker = { fail_max = 3, reset_timeout = 10 }

[routes.offline]
provider = "scripted"
reply = "offline answer"

[router]
kind = "ordered"
order = ["small", "offline"]
max_attempts_per_request = 2

[layers]
telemetry = true
logging = true

[environments.development.layers]
telemetry = false
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.toml"
    path.write_text(textwrap.dedent(text))
    return path


async def test_ordered_pipeline_and_environment_overlay(
    tmp_path: Path, streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, BASE)
    monkeypatch.delenv("CHAT_PIPELINE_ENV", raising=False)
    production = ChatPipeline.from_config(path)
    assert production.describe() == [
        "TelemetryChatClient",
        "LoggingChatClient",
        "OrderedFailoverChatClient(small, offline)",
    ]
    assert (await collect(production, "hi", streaming=streaming)).text == "small answer"
    development = ChatPipeline.from_config(path, "development")
    assert development.describe()[0] == "LoggingChatClient"
    monkeypatch.setenv("CHAT_PIPELINE_ENV", "development")
    assert ChatPipeline.from_config(path).describe()[0] == "LoggingChatClient"
    small = production.client.inner.inner.routes[0]  # type: ignore[attr-defined]
    assert small.max_input_tokens == 100 and small.capabilities == frozenset({"json"})
    assert small.client.describe() == [
        "CircuitBreakerChatClient(small)",
        "RetryChatClient(max_attempts=2)",
        "ScriptedChatClient(small)",
    ]


async def test_tiered_router(tmp_path: Path, streaming: bool) -> None:
    path = write(
        tmp_path,
        """
        [routes.small]
        provider = "scripted"
        reply = "small"
        max_input_tokens = 50
        [routes.large]
        provider = "scripted"
        reply = "large"
        [router]
        kind = "tiered"
        default = "small"
        fallback = { small = ["large"] }
        kinds = { summarize = "large" }
        """,
    )
    chat = ChatPipeline.from_config(path)
    assert (await collect(chat, "short", streaming=streaming)).text == "small"
    assert (await collect(chat, "x" * 1000, streaming=streaming)).text == "large"


async def test_semantic_router(tmp_path: Path, streaming: bool) -> None:
    path = write(
        tmp_path,
        """
        [routes.billing]
        provider = "scripted"
        reply = "billing"
        [routes.general]
        provider = "scripted"
        reply = "general"
        [router]
        kind = "semantic"
        default = "general"
        threshold = 0.2
        profiles = { billing = ["refund my invoice", "charged twice on my invoice"] }
        embeddings = { provider = "hashing" }
        """,
    )
    chat = ChatPipeline.from_config(path)
    assert (
        await collect(chat, "my invoice was charged twice", streaming=streaming)
    ).text == "billing"
    assert (await collect(chat, "qqq zzz", streaming=streaming)).text == "general"


async def test_single_route_needs_no_router_and_real_http(
    tmp_path: Path, streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeOpenAIServer() as server:
        monkeypatch.setenv("TEST_KEY", "sk-from-env")
        path = write(
            tmp_path,
            f"""
            [routes.main]
            provider = "openai"
            model = "gpt-test"
            base_url = "{server.base_url}"
            api_key_env = "TEST_KEY"
            first_chunk_timeout = 5
            """,
        )
        chat = ChatPipeline.from_config(path)
        assert (
            await collect(chat, "hi", streaming=streaming)
        ).text == "Hello from the fake server."
        assert server.requests[0].headers["authorization"] == "Bearer sk-from-env"
        await chat.aclose()


async def test_the_breakers_of_config_built_routes_report_to_the_given_providers(
    tmp_path: Path, otel: Otel
) -> None:
    async with FakeOpenAIServer() as server:
        path = write(
            tmp_path,
            f"""
            [routes.main]
            provider = "openai"
            model = "gpt-test"
            base_url = "{server.base_url}"
            breaker = {{ fail_max = 1 }}
            """,
        )
        config = load_config(path)
        for chat in (
            config.build(**otel.providers),
            config.build_route("main", **otel.providers).client,
        ):
            server.script(FakeResponse.error(503))
            with pytest.raises(ProviderError):
                await chat.get_response("hi")
            await chat.aclose()
    # Each breaker opened once, on the providers given, not the global ones.
    assert otel.total(STATE_CHANGE_METRIC, **{BREAKER_NAME: "main", BREAKER_TO: "open"}) == 2


async def test_function_invocation_takes_tools_from_code(tmp_path: Path) -> None:
    @tool
    def noop() -> str:
        return "ok"

    text = BASE.replace("logging = true", "logging = true\nfunction_invocation = true")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"layers\.function_invocation: is on, but no tools"):
        ChatPipeline.from_config(path)
    chat = ChatPipeline.from_config(path, tools=[noop])
    assert chat.describe()[2] == "FunctionInvokingChatClient(noop)"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ('reply = "small answer"', 'reply = "small answer"\ncolour = "red"'),
            "routes.small.colour: unknown setting",
        ),
        (
            ("max_input_tokens = 100", 'max_input_tokens = "lots"'),
            "routes.small.max_input_tokens: expected an integer, got str",
        ),
        (
            ("max_input_tokens = 100", "max_input_tokens = 0"),
            "routes.small.max_input_tokens: expected at least 1, got 0",
        ),
        (
            ('provider = "scripted"\nreply = "small answer"', 'provider = "mistery"'),
            "routes.small.provider: expected one of",
        ),
        (
            ("retry = { max_attempts = 2 }", "retry = { max_attempts = 2, backoff = 1 }"),
            "routes.small.retry.backoff: unknown setting",
        ),
        (
            ("breaker = { fail_max = 3, reset_timeout = 10 }", "breaker = { fail_max = 0 }"),
            "routes.small.breaker.fail_max",
        ),
        (
            ("reset_timeout = 10 }", "failure_ratio = 1.5 }"),
            "routes.small.breaker.failure_ratio: expected at most 1.0, got 1.5",
        ),
        (
            ("reset_timeout = 10 }", "slow_call_ratio = 0.2 }"),
            "routes.small.breaker.slow_call_ratio: needs slow_call_duration",
        ),
        (
            ('order = ["small", "offline"]', 'order = ["small", "missing"]'),
            "router.order[1]: names no route: 'missing'",
        ),
        (('kind = "ordered"', 'kind = "random"'), "router.kind: expected one of"),
        (
            ("telemetry = true", 'telemetry = "yes"'),
            "layers.telemetry: expected true or false, got str",
        ),
        (
            ('capabilities = ["json"]', 'capabilities = ["json", ""]'),
            "routes.small.capabilities[1]: expected a non-empty string",
        ),
    ],
)
def test_errors_name_the_key_path(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    old, new = change
    assert old in BASE
    with pytest.raises(ConfigError) as caught:
        ChatPipeline.from_config(write(tmp_path, BASE.replace(old, new, 1)))
    assert message in str(caught.value)


def test_a_route_breaker_takes_the_ratio_policies(tmp_path: Path) -> None:
    text = BASE.replace(
        "reset_timeout = 10 }",
        "failure_ratio = 0.25, minimum_calls = 50, window = 60.0, slow_call_duration = 2.5, "
        "slow_call_ratio = 0.4 }",
    )
    table = load_config(write(tmp_path, text)).routes["small"].breaker
    assert table is not None
    settings = table.breaker_settings("small")
    assert (
        settings.failure_ratio,
        settings.minimum_calls,
        settings.window,
        settings.slow_call_duration,
        settings.slow_call_ratio,
    ) == (0.25, 50, 60.0, 2.5, 0.4)
    ChatPipeline.from_config(write(tmp_path, text))  # builds


def test_secrets_only_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    literal = {"routes": {"a": {"provider": "openai", "model": "m", "api_key": "sk-CANARY"}}}
    with pytest.raises(ConfigError) as caught:
        build_pipeline(literal)
    assert "routes.a.api_key: secrets come only from environment variables" in str(caught.value)
    assert "CANARY" not in str(caught.value)
    monkeypatch.delenv("MISSING_KEY", raising=False)
    missing = {"routes": {"a": {"provider": "openai", "model": "m", "api_key_env": "MISSING_KEY"}}}
    expected = r"routes\.a\.api_key_env: the environment variable MISSING_KEY is not set"
    with pytest.raises(ConfigError, match=expected):
        build_pipeline(missing)


def test_environment_and_file_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"environments.staging: is not defined \(defined: \['development'\]\)"
    ):
        ChatPipeline.from_config(write(tmp_path, BASE), "staging")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        ChatPipeline.from_config(write(tmp_path, "[routes\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        ChatPipeline.from_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="routes: is required"):
        build_pipeline({})
    two = {"routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}}}
    with pytest.raises(ConfigError, match="router: is required when there is more than one route"):
        build_pipeline(two)


def test_merge() -> None:
    assert merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "b": {"z": 1}}) == {
        "a": {"x": 1, "y": 3},
        "b": {"z": 1},
    }


def test_an_environment_that_changes_a_provider_replaces_the_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    data = {
        "routes": {"main": {"provider": "openai", "model": "m", "api_key_env": "OPENAI_API_KEY"}},
        "environments": {"test": {"routes": {"main": {"provider": "scripted", "reply": "sim"}}}},
    }
    chat = build_pipeline(data, "test")
    assert chat.describe() == ["ScriptedChatClient(main)"]


def test_a_single_route_name_is_reported_without_an_index() -> None:
    data = {
        "routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}},
        "router": {"kind": "tiered", "default": "c"},
    }
    with pytest.raises(ConfigError) as caught:
        build_pipeline(data)
    assert str(caught.value) == "router.default: names no route: 'c'"


def test_every_problem_is_reported_at_once_with_suggestions() -> None:
    data = {
        "routes": {
            "a": {"provider": "openai", "modle": "gpt-x", "timeout": float("nan")},
            "b": {"provider": "scripted", "retry": {"max_attempts": 0, "jitter": "yes"}},
            "c": {"provider": "gemnii"},
        },
        "router": {"kind": "ordered", "order": ["a", "bb"], "max_attempts_per_request": 0},
        "layer": {"telemetry": True},
    }
    with pytest.raises(ConfigError) as caught:
        build_pipeline(data)
    problems = dict(caught.value.problems)
    assert problems == {
        "layer": "unknown setting; did you mean 'layers'?",
        "routes.a.modle": "unknown setting; did you mean 'model'?",
        "routes.a.model": "is required",
        "routes.a.timeout": "expected a finite number, got nan",
        "routes.b.retry.max_attempts": "expected at least 1, got 0",
        "routes.b.retry.jitter": "expected true or false, got str",
        "routes.c.provider": (f"expected one of {PROVIDERS}, got 'gemnii'; did you mean 'gemini'?"),
        "router.max_attempts_per_request": "expected positive, got 0",
        "router.order[1]": "names no route: 'bb'; did you mean 'b'?",
    }
    # One line per problem, each starting with its key path.
    assert str(caught.value).count("\n") == len(problems) - 1
    assert caught.value.key_path == caught.value.problems[0][0]


def test_code_only_settings_and_url_credentials_are_refused() -> None:
    data = {
        "routes": {
            "a": {
                "provider": "openai",
                "model": "m",
                "base_url": "http://user:CANARY@127.0.0.1:9/v1",
                "retry": {"sleep": "fast"},
                "breaker": {"redis": "redis://:CANARY@127.0.0.1"},
            }
        }
    }
    with pytest.raises(ConfigError) as caught:
        build_pipeline(data)
    text = str(caught.value)
    assert "CANARY" not in text
    paths = sorted(path for path, _ in caught.value.problems)
    assert paths == ["routes.a.base_url", "routes.a.breaker", "routes.a.retry"]
    assert "sleep: takes code; set it in Python" in text
    assert "redis_url_env" in text and "credentials do not belong in a URL" in text


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.toml"
    path.write_bytes(b'[routes.a]\nprovider = "scripted"\nreply = "\xff"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        ChatPipeline.from_config(path)


def test_named_but_unset_key_variable_is_an_error_even_off_openai(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOCAL_KEY", raising=False)
    data = {
        "routes": {
            "a": {
                "provider": "openai",
                "model": "m",
                "base_url": "http://127.0.0.1:9/v1",
                "api_key_env": "LOCAL_KEY",
            }
        }
    }
    with pytest.raises(ConfigError, match=r"routes\.a\.api_key_env: the environment variable"):
        build_pipeline(data)
    del data["routes"]["a"]["api_key_env"]
    assert build_pipeline(data).describe() == ["OpenAIChatClient(a)"]


def test_loading_does_not_import_the_test_kit() -> None:
    import subprocess
    import sys

    # A scripted route is the kit's (`pipeline.testing`); any other loads none of it.
    code = (
        "import sys; from pipeline.config import build_pipeline;"
        "route = {'provider': 'openai', 'model': 'm', 'base_url': 'http://127.0.0.1:9/v1'};"
        "chat = build_pipeline({'routes': {'a': route}});"
        "print([m for m in sys.modules if m.startswith('pipeline.testing')])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


async def test_route_instructions_and_router_affinity(streaming: bool) -> None:
    data = {
        "routes": {
            "a": {"provider": "scripted", "reply": "from a", "instructions": "Reply in JSON."},
            "b": {"provider": "scripted", "reply": "from b"},
        },
        "router": {
            "kind": "ordered",
            "order": ["a", "b"],
            "affinity": {"store": "memory", "ttl": 600, "max_sessions": 10},
        },
    }
    chat = build_pipeline(data)
    router = chat.client
    assert router.affinity is not None  # type: ignore[attr-defined]
    assert router.routes[0].instructions == "Reply in JSON."  # type: ignore[attr-defined]
    options = ChatOptions(session_id="s")
    assert (await collect(chat, "hi", options, streaming=streaming)).text == "from a"
    assert await router.affinity.store.get("s") == "a"  # type: ignore[attr-defined]


def test_affinity_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AFFINITY_REDIS", raising=False)
    data = {
        "routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}},
        "router": {"kind": "ordered", "order": ["a", "b"], "affinity": {"store": "redis"}},
    }
    with pytest.raises(ConfigError, match="store = 'redis' needs redis_url_env"):
        build_pipeline(data)
    data["router"]["affinity"] = {"store": "redis", "redis_url_env": "AFFINITY_REDIS", "ttl": 0}
    with pytest.raises(ConfigError) as caught:
        build_pipeline(data)
    assert dict(caught.value.problems) == {"router.affinity.ttl": "expected positive, got 0"}
    data["router"]["affinity"]["ttl"] = 5
    with pytest.raises(ConfigError, match="AFFINITY_REDIS is not set"):
        build_pipeline(data)


async def test_an_anthropic_route_and_max_tokens_field(
    monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    from pipeline.testing import FakeAnthropicServer

    monkeypatch.setenv("ANTHROPIC_TEST_KEY", "sk-ant-test")
    async with FakeAnthropicServer() as claude, FakeOpenAIServer() as compatible:
        data = {
            "routes": {
                "claude": {
                    "provider": "anthropic",
                    "model": "claude-test",
                    "base_url": claude.base_url,
                    "api_key_env": "ANTHROPIC_TEST_KEY",
                    "max_tokens": 64,
                },
                "local": {
                    "provider": "openai",
                    "model": "llama",
                    "base_url": compatible.base_url,
                    "max_tokens_field": "max_tokens",
                },
            },
            "router": {"kind": "ordered", "order": ["local", "claude"]},
        }
        chat = build_pipeline(data)
        options = ChatOptions(max_output_tokens=4)
        assert (await collect(chat, "hi", options, streaming=streaming)).error is None
        body = compatible.requests[-1].json
        assert body["max_tokens"] == 4 and "max_completion_tokens" not in body
        await chat.aclose()
    bad = {"routes": {"a": {"provider": "anthropic", "model": "m", "max_tokens": 0}}}
    with pytest.raises(ConfigError, match=r"routes\.a\.max_tokens: expected at least 1"):
        build_pipeline(bad)


async def test_an_openai_responses_route(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, streaming: bool
) -> None:
    from pipeline.providers import OpenAIResponsesChatClient
    from pipeline.testing import RESPONSES_PATH

    monkeypatch.setenv("RESPONSES_TEST_KEY", "sk-responses-test")
    async with FakeOpenAIServer() as server:
        path = tmp_path / "pipeline.toml"
        path.write_text(
            "[routes.main]\n"
            'provider = "openai_responses"\n'
            'model = "gpt-test"\n'
            f'base_url = "{server.base_url}"\n'
            'api_key_env = "RESPONSES_TEST_KEY"\n'
            'transport = "httpx2"\n'
            "first_chunk_timeout = 5\n"
        )
        config = load_config(path)
        route = config.build_route("main")
        assert isinstance(route.client, OpenAIResponsesChatClient)
        assert route.client.transport == "httpx2" and route.client.first_chunk_timeout == 5
        chat = config.build()
        result = await collect(chat, "hi", streaming=streaming)
        assert result.error is None and result.text == "Hello from the fake server."
        assert server.count(RESPONSES_PATH) == 1
        request = server.requests[-1]
        assert request.json["model"] == "gpt-test"
        assert request.headers["authorization"] == "Bearer sk-responses-test"
        await chat.aclose()
        await route.client.aclose()
    bad = {
        "routes": {
            "a": {"provider": "openai_responses", "model": "", "max_tokens_field": "max_tokens"}
        }
    }
    with pytest.raises(ConfigError) as caught:
        build_pipeline(bad)
    problems = dict(caught.value.problems)
    assert set(problems) == {"routes.a.model", "routes.a.max_tokens_field"}
    assert problems["routes.a.max_tokens_field"].startswith("unknown setting")


# -- typed tables ----------------------------------------------------------------------------


def semantic(embeddings: dict[str, Any]) -> dict[str, Any]:
    """Two scripted routes under a semantic router with these `embeddings`."""
    return {
        "routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}},
        "router": {
            "kind": "semantic",
            "default": "a",
            "profiles": {"b": ["x"]},
            "embeddings": embeddings,
        },
    }


def test_routes_and_routers_are_typed_by_their_discriminator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BREAKER_REDIS", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "azure-key")
    config = parse_config(
        {
            "routes": {
                "a": {"provider": "openai", "model": "m", "base_url": "http://127.0.0.1:9/v1"},
                "b": {
                    "provider": "azure_openai",
                    "endpoint": "https://x.openai.azure.com",
                    "deployment": "d",
                    "breaker": {"fail_max": 2, "redis_url_env": "BREAKER_REDIS"},
                },
                "c": {"provider": "ollama", "model": "llama"},
                "d": {"provider": "anthropic", "model": "claude", "base_url": "http://127.0.0.1:9"},
                "e": {"provider": "scripted", "reply": "hi", "retry": {"max_attempts": 2}},
            },
            "router": {"kind": "tiered", "default": "e", "affinity": {"ttl": 60}},
        }
    )
    assert {name: type(table) for name, table in config.routes.items()} == {
        "a": OpenAIRouteConfig,
        "b": AzureOpenAIRouteConfig,
        "c": OllamaRouteConfig,
        "d": AnthropicRouteConfig,
        "e": ScriptedRouteConfig,
    }
    b = config.routes["b"]
    assert isinstance(b, AzureOpenAIRouteConfig) and isinstance(b.breaker, BreakerConfig)
    assert (b.api_version, b.breaker.fail_max, b.breaker.redis_url_env) == (
        "2024-10-21",
        2,
        "BREAKER_REDIS",
    )
    assert config.routes["e"].retry == RetrySettings(max_attempts=2)
    assert isinstance(config.router, TieredRouterConfig)
    assert isinstance(config.router.affinity, AffinityConfig) and config.router.affinity.ttl == 60
    assert config.router.sticky_sessions is True
    assert config.layers == LayersConfig()


@pytest.mark.parametrize(
    ("data", "problems"),
    [
        (
            {"routes": {"a": {"model": "m"}}},
            {"routes.a.provider": f"is required (one of {PROVIDERS})"},
        ),
        (
            {"routes": {"a": {"provider": "opnai", "model": "m"}}},
            {
                "routes.a.provider": f"expected one of {PROVIDERS}, got 'opnai'; "
                "did you mean 'openai'?"
            },
        ),
        (
            {"routes": {"a": {"provider": 7}}},
            {"routes.a.provider": f"expected one of {PROVIDERS}, got int"},
        ),
        (
            {"routes": {"a": {"provider": "scripted", "breaker": {"fail_mx": 2}}}},
            {"routes.a.breaker.fail_mx": "unknown setting; did you mean 'fail_max'?"},
        ),
        (
            {"routes": {"a": {"provider": "scripted", "retry": {"max_atempts": 2}}}},
            {"routes.a.retry.max_atempts": "unknown setting; did you mean 'max_attempts'?"},
        ),
        (
            {
                "routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}},
                "router": {"kind": "ordred", "order": ["a", "b"]},
            },
            {
                "router.kind": "expected one of ['ordered', 'balanced', 'hedged', 'tiered', "
                "'semantic'], got 'ordred'; did you mean 'ordered'?"
            },
        ),
        (
            semantic({"provider": "hashing", "dimensions": 1, "dimensionz": 3}),
            {
                "router.embeddings.dimensions": "expected at least 2, got 1",
                "router.embeddings.dimensionz": "unknown setting; did you mean 'dimensions'?",
            },
        ),
        (
            semantic({"provider": "hashin"}),
            {
                "router.embeddings.provider": "expected one of ['hashing', 'local', 'openai'], got "
                "'hashin'; did you mean 'hashing'?"
            },
        ),
        (
            semantic({}),
            {"router.embeddings.provider": "is required (one of ['hashing', 'local', 'openai'])"},
        ),
        (
            {
                "routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}},
                "router": {"kind": "semantic", "default": "a", "fallback": {"a": ["zz"]}},
            },
            {
                "router.fallback": "unknown setting",
                "router.profiles": "is required",
                "router.embeddings": "is required",
            },
        ),
    ],
)
def test_tags_are_checked_and_never_part_of_a_key_path(
    data: dict[str, Any], problems: dict[str, str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert dict(caught.value.problems) == problems


def _default(function: Any, parameter: str) -> Any:
    return inspect.signature(function).parameters[parameter].default


def test_provider_settings_defaults_are_the_constructors() -> None:
    from middleware.routing.tiered import TieredRoutingChatClient
    from pipeline.providers import (
        AnthropicChatClient,
        AzureOpenAIChatClient,
        BedrockChatClient,
        GeminiChatClient,
        HashingEmbeddingGenerator,
        OllamaChatClient,
        OpenAIChatClient,
        OpenAIEmbeddingGenerator,
        OpenAIResponsesChatClient,
    )
    from pipeline.providers._settings import (
        AnthropicSettings,
        AzureOpenAISettings,
        BedrockSettings,
        ChatCompletionsSettings,
        GeminiSettings,
        HashingEmbeddingsSettings,
        HTTPProviderSettings,
        OllamaSettings,
        OpenAIEmbeddingsSettings,
        OpenAIResponsesSettings,
        OpenAISettings,
        ScriptedSettings,
        VertexSettings,
    )
    from pipeline.testing import ScriptedChatClient
    from pipeline.wire.chat_completions.outbound import MAX_TOKENS_FIELDS

    def field(settings: type[Any], name: str) -> Any:
        return settings.model_fields[name].default

    pairs = [
        (OpenAISettings, "base_url", OpenAIChatClient, "base_url"),
        (OpenAIResponsesSettings, "base_url", OpenAIResponsesChatClient, "base_url"),
        (OllamaSettings, "base_url", OllamaChatClient, "base_url"),
        (AnthropicSettings, "base_url", AnthropicChatClient, "base_url"),
        (AnthropicSettings, "max_tokens", AnthropicChatClient, "max_tokens"),
        (AnthropicSettings, "anthropic_version", AnthropicChatClient, "anthropic_version"),
        (AzureOpenAISettings, "api_version", AzureOpenAIChatClient, "api_version"),
        (BedrockSettings, "region", BedrockChatClient, "region"),
        (BedrockSettings, "profile", BedrockChatClient, "profile"),
        (BedrockSettings, "base_url", BedrockChatClient, "base_url"),
        (BedrockSettings, "max_tokens", BedrockChatClient, "max_tokens"),
        (GeminiSettings, "base_url", GeminiChatClient, "base_url"),
        (VertexSettings, "max_tokens", AnthropicChatClient, "max_tokens"),
        (ScriptedSettings, "model", ScriptedChatClient, "model_id"),
        (HashingEmbeddingsSettings, "dimensions", HashingEmbeddingGenerator, "dimensions"),
        (OpenAIEmbeddingsSettings, "base_url", OpenAIEmbeddingGenerator, "base_url"),
        (TieredRouterConfig, "sticky_sessions", TieredRoutingChatClient, "sticky_sessions"),
    ]
    for client in (
        OpenAIChatClient,
        OpenAIResponsesChatClient,
        AnthropicChatClient,
        BedrockChatClient,
        GeminiChatClient,
    ):
        pairs.append((HTTPProviderSettings, "first_chunk_timeout", client, "first_chunk_timeout"))
        pairs.append((HTTPProviderSettings, "stream_idle_timeout", client, "stream_idle_timeout"))
        pairs.append((HTTPProviderSettings, "max_response_bytes", client, "max_response_bytes"))
    pairs.append(
        (ChatCompletionsSettings, "max_tokens_field", OpenAIChatClient, "max_tokens_field")
    )
    for settings, name, constructor, parameter in pairs:
        assert field(settings, name) == _default(constructor, parameter), (settings, name)
    keyed = {
        OpenAISettings: OpenAIChatClient,
        OpenAIResponsesSettings: OpenAIResponsesChatClient,
        AzureOpenAISettings: AzureOpenAIChatClient,
        AnthropicSettings: AnthropicChatClient,
        GeminiSettings: GeminiChatClient,
        OpenAIEmbeddingsSettings: OpenAIChatClient,
    }
    for settings, client in keyed.items():
        assert settings.default_key_variable == client.api_key_env
    assert OllamaChatClient.api_key_env is None
    assert OllamaSettings(model="m").key_variable() is None
    allowed = typing.get_args(ChatCompletionsSettings.model_fields["max_tokens_field"].annotation)
    assert typing.get_args(allowed[0]) == MAX_TOKENS_FIELDS


async def test_an_unset_timeout_keeps_the_constructors_default() -> None:
    from pipeline.providers import AnthropicChatClient, OpenAIChatClient

    local = "http://127.0.0.1:9"
    pairs = [
        (OpenAIRouteConfig(model="m", base_url=local), OpenAIChatClient("m", api_key="k")),
        (AnthropicRouteConfig(model="m", base_url=local), AnthropicChatClient("m", api_key="k")),
    ]
    slow = OpenAIRouteConfig(model="m", base_url=local, timeout=300).client("slow", None)
    try:
        for table, constructed in pairs:
            client = table.client("a", None)
            assert client._transport.timeout == constructed._transport.timeout  # type: ignore[attr-defined]
            await client.aclose()
        assert slow._transport.timeout.read == 300  # type: ignore[attr-defined]
    finally:
        for _, constructed in pairs:
            await constructed.aclose()
        await slow.aclose()


def test_loading_without_a_semantic_router_does_not_import_numpy() -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "pipeline.toml"
    code = (
        "import sys; from pipeline.config import load_config, parse_config;"
        f"config = load_config({str(example)!r}); loaded = 'numpy' in sys.modules;"
        "config.build(); built = 'numpy' in sys.modules;"
        f"semantic = parse_config({semantic({'provider': 'hashing'})!r});"
        "parsed = 'numpy' in sys.modules;"
        "semantic.build(); print(loaded, built, parsed, 'numpy' in sys.modules)"
    )
    environment = {**os.environ, "OPENAI_API_KEY": "sk-test"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environment
    )
    # Only building a semantic router loads numpy.
    assert done.stdout.split() == ["False", "False", "False", "True"]


# -- groups: routes that serve as one ---------------------------------------------------------

GROUPS = """
[routes.a]
provider = "scripted"
reply = "from a"
max_input_tokens = 8000
capabilities = ["tools", "json"]

[routes.b]
provider = "scripted"
reply = "from b"
max_input_tokens = 4000
capabilities = ["tools"]

[routes.large]
provider = "scripted"
reply = "from large"

[groups.standard]
routes = ["a", "b"]
strategy = "round_robin"

[router]
kind = "tiered"
default = "standard"
fallback = { standard = ["large"] }
"""


async def test_a_tier_may_be_a_balanced_group(tmp_path: Path, streaming: bool) -> None:
    config = load_config(write(tmp_path, GROUPS))
    assert list(config.groups) == ["standard"] and config.route_names == ["a", "b", "large"]
    chat = config.build()
    assert "standard" in chat.describe()[0] and "large" in chat.describe()[0]
    async with chat:
        texts = [(await collect(chat, "hi", streaming=streaming)).text for _ in range(4)]
    assert texts == ["from a", "from b", "from a", "from b"]


async def test_a_group_has_its_members_smallest_window_and_shared_capabilities(
    tmp_path: Path, streaming: bool
) -> None:
    chat = load_config(write(tmp_path, GROUPS)).build()
    async with chat:
        # ~5,000 input tokens: over b's 4,000, so over the group's window: the next tier.
        long = "word " * 20_000
        assert (await collect(chat, long, streaming=streaming)).text == "from large"


def test_group_problems_are_reported_with_their_key_paths(tmp_path: Path) -> None:
    text = (
        GROUPS.replace('routes = ["a", "b"]', 'routes = ["a", "b", "zz", "a"]')
        .replace('default = "standard"', 'default = "a"')
        .replace('strategy = "round_robin"', 'strategy = "fastest"')
    )
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    problems = dict(caught.value.problems)
    assert problems["groups.standard.routes[2]"].startswith("names no route: 'zz'")
    assert problems["groups.standard.routes[3]"] == "'a' is in group 'standard' already"
    assert problems["router.default"] == "'a' serves in group 'standard': name the group"
    assert "groups.standard.strategy" in problems
    with pytest.raises(ConfigError, match=r"groups\.a: a route is named 'a' too"):
        load_config(write(tmp_path, GROUPS.replace("[groups.standard]", "[groups.a]")))


@pytest.mark.parametrize("table", ["router", "groups.standard"])
async def test_a_health_table_keeps_the_pipelines_meter_provider(
    tmp_path: Path, otel: Otel, table: str, streaming: bool
) -> None:
    # A [router.health] or [groups.NAME.health] table builds its own RouteHealth: its
    # gauges must reach the meter provider the pipeline was built with, not the global one.
    text = GROUPS + f"\n[{table}.health]\nprobe_interval = 3.0\n"
    if table == "router":
        text = GROUPS.replace(
            '[router]\nkind = "tiered"\ndefault = "standard"\nfallback = { standard = ["large"] }',
            '[router]\nkind = "balanced"\nroutes = ["standard", "large"]\n'
            "[router.health]\nprobe_interval = 3.0",
        )
    chat = load_config(write(tmp_path, text)).build(**otel.providers)
    async with chat:
        assert (await collect(chat, "hi", streaming=streaming)).error is None
    routes = {attributes[ROUTE_NAME] for attributes, _ in otel.points(HEALTH_IN_FLIGHT_METRIC)}
    assert routes & {"a", "b", "standard", "large"}


@pytest.mark.parametrize(
    ("router", "problems"),
    [
        (
            {"dealy": "p90", "delay": True, "budget_burst": 0.5, "health": {"store": "redis"}},
            {
                "router.dealy": "unknown setting; did you mean 'delay'?",
                "router.delay": "expected seconds (a positive number) or a percentile such as "
                "'p90', got bool",
                "router.budget_burst": "expected at least 1.0, got 0.5",
                "router.health": "store = 'redis' needs redis_url_env (the URL's variable)",
            },
        ),
        (
            {"delay": "p0", "max_hedged_attempts": 1.5, "budget": -0.1},
            {
                "router.delay": "expected a percentile such as 'p90' or 'p99.9', or seconds",
                "router.max_hedged_attempts": "expected an integer, got 1.5",
                "router.budget": "expected at least 0.0, got -0.1",
            },
        ),
        (
            {"delay_window": 0, "min_delay_samples": 0, "fallback_delay": 0},
            {
                "router.delay_window": "expected at least 1, got 0",
                "router.min_delay_samples": "expected at least 1, got 0",
                "router.fallback_delay": "expected positive, got 0",
            },
        ),
        (
            {"health": {"store": "redis", "redis_url_env": "HEDGE_REDIS"}},
            {"router.health.redis_url_env": "the environment variable HEDGE_REDIS is not set"},
        ),
    ],
)
def test_hedged_router_problems_name_their_key_paths(
    monkeypatch: pytest.MonkeyPatch, router: dict[str, Any], problems: dict[str, str]
) -> None:
    monkeypatch.delenv("HEDGE_REDIS", raising=False)
    data = {
        "routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}},
        "router": {"kind": "hedged", **router},
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert dict(caught.value.problems) == problems


def test_a_route_weight_must_be_finite_and_the_error_names_its_key() -> None:
    for weight in (float("inf"), float("nan"), 0):
        with pytest.raises(ConfigError, match=r"^routes\.a\.weight: "):
            parse_config(
                {
                    "routes": {"a": {"provider": "scripted", "weight": weight}},
                    "router": {"kind": "balanced", "strategy": "weighted"},
                }
            )
    # As large as a float goes is a weight (drawn relative to the largest).
    config = parse_config(
        {
            "routes": {
                "a": {"provider": "scripted", "weight": 1e308},
                "b": {"provider": "scripted", "weight": 1e308},
            },
            "router": {"kind": "balanced", "strategy": "weighted"},
        }
    )
    assert config is not None


async def test_semantic_router_with_a_local_model_and_route_thresholds(
    tmp_path: Path, streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.providers import local
    from tests.pipeline.providers.test_local_embeddings import FakeSentenceTransformer

    loaded: list[tuple[str, str | None]] = []

    def load(self: local.LocalEmbeddingGenerator) -> FakeSentenceTransformer:
        loaded.append((str(self._source), self.device))
        return FakeSentenceTransformer(dimensions=256)

    # Loading is faked, so the check that sentence-transformers is installed is too: this
    # test runs where it is not (the `local` extra is not a test dependency).
    monkeypatch.setattr(local, "_sentence_transformers_installed", lambda: True)
    monkeypatch.setattr(local.LocalEmbeddingGenerator, "_load", load)
    model_dir = tmp_path / "minilm" / "model"
    model_dir.mkdir(parents=True)
    path = write(
        tmp_path,
        f"""
        [routes.billing]
        provider = "scripted"
        reply = "billing"
        [routes.code]
        provider = "scripted"
        reply = "code"
        [routes.general]
        provider = "scripted"
        reply = "general"
        [router]
        kind = "semantic"
        default = "general"
        threshold = 0.3
        embeddings = {{ provider = "local", model = "{model_dir}", batch_size = 8, device = "cpu" }}
        [router.profiles]
        billing = {{ utterances = ["refund my invoice", "charged twice"], threshold = 0.99 }}
        code = ["python exception trace", "fix python bug"]
        """,
    )
    chat = ChatPipeline.from_config(path)
    # billing's own threshold (0.99) turns away a near match the router's 0.3 would take.
    assert (await collect(chat, "my invoice was charged", streaming=streaming)).text == "general"
    assert (await collect(chat, "python exception", streaming=streaming)).text == "code"
    assert loaded == [(str(model_dir), "cpu")]


def _with_store(table: str, store: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {"routes": {"a": {"provider": "scripted"}}}
    if table == "cache":
        data["cache"] = store
    else:
        data["router"] = {"kind": "balanced", "routes": ["a"], table.split(".")[1]: store}
    return data


@pytest.mark.parametrize("table", ["router.affinity", "router.health", "cache"])
def test_every_store_table_names_its_redis_the_same_way(
    table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[router.affinity]``, ``[router.health]`` and ``[cache]``: one shape, one set of
    rules for the URL (a variable, or a URL without a password), errors naming the table."""
    monkeypatch.delenv("STORE_UNSET_VAR", raising=False)
    for store, message in [
        ({"store": "redis"}, f"{table}: store = 'redis' needs redis_url_env"),
        ({"store": "redis", "redis_url_env": "STORE_UNSET_VAR"}, "STORE_UNSET_VAR is not set"),
        ({"store": "redis", "redis_url": "redis://:secret@host:6379/0"}, "holds a password"),
        ({"store": "redis", "redis_url": "http://host"}, f"{table}"),
        ({"store": "disk"}, f"{table}.store"),
    ]:
        with pytest.raises(ConfigError) as raised:
            parse_config(_with_store(table, store))
        assert message in str(raised.value), (store, str(raised.value))
        assert "secret" not in str(raised.value)
    parse_config(_with_store(table, {"store": "redis", "redis_url": "redis://h:1/0"}))
