import pytest


@pytest.fixture(params=[False, True], ids=["get_response", "get_streaming_response"])
def streaming(request: pytest.FixtureRequest) -> bool:
    """Runs a test once per call shape: every streaming behaviour is tested for both."""
    return bool(request.param)
