"""Pytest fixtures for testing pipelines with the fakes, opt-in (no entry point loads it
into every pytest run): name it in your top-level ``conftest.py``::

    pytest_plugins = ["pipeline.testing.pytest_plugin"]

* `streaming`: runs a test twice, once per call shape (``get_response``, then
  ``get_streaming_response``), so a behaviour is asserted for both;
* ``fake_<format>_server`` for each fake of `pipeline.testing.FAKE_SERVERS` (such as
  `fake_openai_server`): the fake started on 127.0.0.1 (a free port) for the test, in the
  environment its clients read (its `fixture_environment()`), closed after it. The async
  fixtures need pytest-asyncio.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from pipeline.testing import FAKE_SERVERS
from pipeline.testing._fake_server import FakeServer


@pytest.fixture(params=[False, True], ids=["get_response", "get_streaming_response"])
def streaming(request: pytest.FixtureRequest) -> bool:
    """Runs a test once per call shape: every streaming behaviour is tested for both."""
    return bool(request.param)


def _fixture(fake: type[FakeServer]) -> Callable[..., Any]:
    async def started(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeServer]:
        async with fake() as server:
            for name, value in server.fixture_environment().items():
                if value is None:
                    monkeypatch.delenv(name, raising=False)
                else:
                    monkeypatch.setenv(name, value)
            yield server

    started.__doc__ = f"A started `{fake.__name__}`, closed after the test."
    return pytest_asyncio.fixture(started, name=f"fake_{fake.wire_format}_server")


globals().update({f"fake_{name}_server": _fixture(fake) for name, fake in FAKE_SERVERS.items()})

__all__ = ["streaming", *(f"fake_{name}_server" for name in FAKE_SERVERS)]
