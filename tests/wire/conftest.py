"""The conformance suite's fixtures: `api`, every wire API in turn (`tests.wire.apis`), and
two fakes of it, `upstream` and `backup`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pipeline.testing._fake_server import FakeServer
from tests.wire.apis import APIS, KEY, KEY_VARIABLE, WireApi


@pytest.fixture(params=APIS, ids=[api.name for api in APIS])
def api(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> WireApi:
    monkeypatch.setenv(KEY_VARIABLE, KEY)  # for the routes of configurations
    wire: WireApi = request.param
    return wire


@pytest.fixture
async def upstream(api: WireApi, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeServer]:
    async with api.fake() as server:
        for name, value in api.environment(server).items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        yield server


@pytest.fixture
async def backup(api: WireApi) -> AsyncIterator[FakeServer]:
    async with api.fake() as server:
        yield server
