from collections.abc import Iterator

import pytest


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
