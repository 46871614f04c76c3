from collections.abc import Iterator

import pytest

from tests.otel import Otel, Receiver


@pytest.fixture(params=[False, True], ids=["get_response", "get_streaming_response"])
def streaming(request: pytest.FixtureRequest) -> bool:
    """Runs a test once per call shape: every streaming behaviour is tested for both."""
    return bool(request.param)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free loopback port, started for this test session."""
    import shutil

    from tests.redis_server import running_redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it with apt-get)")
    with running_redis() as url:
        yield url


@pytest.fixture
def otel() -> Otel:
    """In-memory tracer and meter providers, passed explicitly (no global state)."""
    from tests.otel import make_otel

    return make_otel()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver on 127.0.0.1 that decodes the protobuf it is sent."""
    from tests.otel import Receiver

    with Receiver() as receiver:
        yield receiver
