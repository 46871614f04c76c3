"""Session fixtures of the compatibility suite: real third-party servers on 127.0.0.1.

* `litellm_proxy`: the LiteLLM proxy (``litellm[proxy]``) with ``mock_response`` models and
  one model, ``upstream``, that proxies to `fake_upstream` (our fake server, in a thread) for
  faults LiteLLM cannot mock: cut streams and in-band errors after output.
* `llama_server`: llama-cpp-python's OpenAI-compatible server with a tiny random-weight GGUF
  model written by the test session (see `tests.compat.tiny_gguf`).

A server that is not installed or does not start fails the session loudly; the suite is
deselected, not skipped, with ``-m "not compat"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compat.servers import (
    MOCK_MODELS,
    UPSTREAM_MODEL,
    LlamaServer,
    Proxy,
    ThreadedFakeServer,
    python_module_argv,
    server_process,
)
from tests.compat.tiny_gguf import write_tiny_llama
from tests.processes import require_module, uvicorn_log_config

# Startup budgets: LiteLLM imports for tens of seconds on a 2-core machine.
LITELLM_START_TIMEOUT = 240.0
LLAMA_START_TIMEOUT = 120.0

# Keep LiteLLM off the network: local copies of its cost map and other remote data, no
# .env loading (PRODUCTION mode), no database.
_LITELLM_ENV = {
    "LITELLM_MODE": "PRODUCTION",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_LOG": "ERROR",
}
_DROPPED_ENV = ("DATABASE_URL", "LITELLM_MASTER_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL")


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def fake_upstream_session() -> Iterator[ThreadedFakeServer]:
    server = ThreadedFakeServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake_upstream(fake_upstream_session: ThreadedFakeServer) -> ThreadedFakeServer:
    """The fake server behind LiteLLM's ``upstream`` model, with no requests and no script."""
    fake_upstream_session.reset()
    return fake_upstream_session


@pytest.fixture(scope="session")
def litellm_proxy(
    fake_upstream_session: ThreadedFakeServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    require_module("litellm", what="the LiteLLM proxy (litellm[proxy])", extra="compat")
    workdir = tmp_path_factory.mktemp("litellm")
    master_key = "sk-" + secrets.token_hex(16)
    models = [
        {
            "model_name": name,
            "litellm_params": {"model": f"openai/{name}", "api_key": "sk-unused", **params},
        }
        for name, params in MOCK_MODELS.items()
    ]
    models.append(
        {
            "model_name": UPSTREAM_MODEL,
            "litellm_params": {
                "model": "openai/fake-model",
                "api_key": "sk-upstream",
                "api_base": fake_upstream_session.base_url,
            },
        }
    )
    with running_litellm_proxy(models, workdir, master_key) as proxy:
        yield proxy


@contextlib.contextmanager
def running_litellm_proxy(
    models: list[dict[str, Any]], workdir: Path, master_key: str
) -> Iterator[Proxy]:
    """The LiteLLM proxy serving `models` (its ``model_list``) until the block ends."""
    config = {
        "model_list": models,
        # No retries or cooldowns inside LiteLLM (by default it retries a 429/5xx twice),
        # so each of our calls is one upstream call and failures stay ours to handle.
        "litellm_settings": {"num_retries": 0, "request_timeout": 30},
        "router_settings": {"num_retries": 0, "disable_cooldowns": True},
        "general_settings": {"master_key": master_key},
    }
    config_path = workdir / "config.yaml"
    config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    argv = python_module_argv(
        "litellm.proxy.proxy_cli",
        "--config",
        str(config_path),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--num_workers",
        "1",
        "--log_config",
        str(uvicorn_log_config(workdir / "uvicorn-log.json")),
    )
    with server_process(
        "LiteLLM proxy",
        argv,
        cwd=workdir,
        env=_child_env(_LITELLM_ENV),
        timeout=LITELLM_START_TIMEOUT,
    ) as url:
        yield Proxy(base_url=f"{url}/v1", api_key=master_key)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    require_module(
        "llama_cpp", what="llama-cpp-python's server (llama-cpp-python[server])", extra="compat"
    )
    require_module("gguf", what="gguf (gguf-py, to write the test model)", extra="compat")
    workdir = tmp_path_factory.mktemp("llama")
    model_path = write_tiny_llama(workdir / "tiny-random-llama.gguf")
    alias = "tiny-random-llama"
    argv = python_module_argv(
        "llama_cpp.server",
        "--model",
        str(model_path),
        "--model_alias",
        alias,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        # Tool calls come from a grammar-constrained completion in this chat format.
        "--chat_format",
        "chatml-function-calling",
        "--n_ctx",
        "256",
        # One thread: with two, on a busy 2-core machine, each token waits on the other
        # thread (100 tokens took 18 s instead of 0.1 s).
        "--n_threads",
        "1",
        "--n_threads_batch",
        "1",
        "--seed",
        "1",
    )
    with server_process(
        "llama-cpp-python server",
        argv,
        cwd=workdir,
        env=_child_env({}),
        timeout=LLAMA_START_TIMEOUT,
    ) as url:
        yield LlamaServer(base_url=f"{url}/v1", model=alias)
