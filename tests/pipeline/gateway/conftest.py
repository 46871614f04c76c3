"""The gateway on a real uvicorn server on 127.0.0.1, in the test's event loop, with fake
upstreams; clients are the official `openai` SDK (no retries, so every call is counted)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import uvicorn

from pipeline.config import PipelineConfig, parse_config
from pipeline.gateway.app import Gateway, create_app
from pipeline.gateway.server import listening_socket, uvicorn_options
from pipeline.testing import FakeOpenAIServer


class _Server(uvicorn.Server):
    """uvicorn's server, telling when it listens (its startup ran the app's lifespan)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()


@dataclass
class Running:
    url: str
    server: _Server
    task: asyncio.Task[None]
    app: Any

    @property
    def gateway(self) -> Gateway:
        gateway: Gateway = self.app.state.gateway
        return gateway

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, api_key: str = "unused", **options: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **options)

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


@contextlib.asynccontextmanager
async def running(
    config: PipelineConfig, *, http_protocol: Any = None, **app_options: Any
) -> AsyncIterator[Running]:
    """`create_app(config)` served by uvicorn on a free loopback port until the block ends
    (`http_protocol`: a factory of connections in place of the gateway's own, given its
    `ConnectionLimits`)."""
    app = create_app(config, **app_options)
    options = uvicorn_options(config.gateway)
    if http_protocol is not None:
        options["http"] = http_protocol(options["http"].keywords["limits"])
    server_config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", **options
    )
    sock = listening_socket(server_config)
    port = sock.getsockname()[1]
    server = _Server(server_config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait({task, listening}, return_when=asyncio.FIRST_COMPLETED)
    if not listening.done():
        listening.cancel()
        await task  # raises what made the startup fail
        raise RuntimeError("the gateway stopped before it listened")
    run = Running(f"http://127.0.0.1:{port}", server, task, app)
    try:
        yield run
    finally:
        if not task.done():
            await run.stop()
        sock.close()


def config(
    routes: Mapping[str, FakeOpenAIServer],
    *,
    gateway: Mapping[str, Any] | None = None,
    router: Mapping[str, Any] | None = None,
    layers: Mapping[str, Any] | None = None,
    route_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> PipelineConfig:
    """Routes named after their fake upstreams, in order behind an ordered router."""
    data: dict[str, Any] = {
        "routes": {
            name: {
                "provider": "openai",
                "model": f"model-{name}",
                "base_url": server.base_url,
                **(route_options or {}).get(name, {}),
            }
            for name, server in routes.items()
        },
        "gateway": dict(gateway or {}),
    }
    if len(routes) > 1 or router:
        data["router"] = {"kind": "ordered", "order": list(routes), **(router or {})}
    if layers:
        data["layers"] = dict(layers)
    return parse_config(data)


def keyed(monkeypatch: pytest.MonkeyPatch, keys: str) -> dict[str, Any]:
    """``[gateway]`` settings that require one of `keys` (comma-separated), which are put
    in the environment variable they name."""
    monkeypatch.setenv("GATEWAY_TEST_KEYS", keys)
    return {"api_keys_env": "GATEWAY_TEST_KEYS"}


@pytest.fixture
async def primary() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
async def backup() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server
