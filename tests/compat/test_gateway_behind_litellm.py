"""LiteLLM's proxy in front of ``chat-pipeline serve``: how it reads the gateway's errors.

LiteLLM maps an OpenAI-compatible backend's errors by their words: a context overflow is
its ``ContextWindowExceededError`` (which callers and LiteLLM's own context-window
fallbacks act on) only when the message is OpenAI's ("This model's maximum context length
is ..."); the gateway's earlier wording became a plain ``BadRequestError``. And a provider
refusing the gateway's own credentials must not reach LiteLLM (and its clients) as a 401,
which says their key is wrong.

Client (official SDK) -> LiteLLM proxy -> gateway (a real process) -> fake upstream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pipeline.testing import FakeResponse
from tests.compat.conftest import _child_env, running_litellm_proxy
from tests.compat.servers import Proxy, ThreadedFakeServer, server_process
from tests.processes import require_module, serve_argv

pytestmark = pytest.mark.compat

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
MODEL = "through-the-gateway"


@pytest.fixture(scope="module")
def litellm_in_front(
    fake_upstream_session: ThreadedFakeServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    require_module("litellm", what="the LiteLLM proxy (litellm[proxy])", extra="compat")
    workdir = tmp_path_factory.mktemp("litellm-in-front")
    config = workdir / "gateway.toml"
    config.write_text(
        f'[routes.primary]\nprovider = "openai"\nmodel = "fake-model"\n'
        f'base_url = "{fake_upstream_session.base_url}"\n'
    )
    with server_process(
        "chat-pipeline serve", serve_argv(config), cwd=workdir, env=_child_env({}), timeout=60
    ) as gateway_url:
        models = [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": "openai/pipeline",
                    "api_key": "sk-unused",
                    "api_base": f"{gateway_url}/v1",
                },
            }
        ]
        with running_litellm_proxy(models, workdir, "sk-in-front") as proxy:
            yield proxy


@pytest.fixture
def client(litellm_in_front: Proxy) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=litellm_in_front.base_url, api_key=litellm_in_front.api_key, max_retries=0
    ) as client:
        yield client


def test_a_context_overflow_is_litellms_context_window_error(
    fake_upstream: ThreadedFakeServer, client: openai.OpenAI, streaming: bool
) -> None:
    fake_upstream.script(FakeResponse.error(400, code="context_length_exceeded"))
    with pytest.raises(openai.BadRequestError) as raised:
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=streaming)
        if streaming:
            list(response)  # type: ignore[arg-type]
    assert "ContextWindowExceededError" in raised.value.message
    assert fake_upstream.count() == 1


def test_the_upstream_refusing_the_gateways_key_is_no_401_for_the_client(
    fake_upstream: ThreadedFakeServer, client: openai.OpenAI
) -> None:
    fake_upstream.script(FakeResponse.error(401))
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert not isinstance(raised.value, openai.AuthenticationError)
    assert raised.value.status_code >= 500
    assert fake_upstream.count() == 1
