import httpx2
import numpy as np
import pytest

from pipeline.errors import ProviderError, RateLimitedError
from pipeline.providers import OpenAIEmbeddingGenerator
from pipeline.testing import EMBEDDINGS_PATH, FakeOpenAIServer, FakeResponse
from tests.otel import Otel

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")


async def test_batches_and_keeps_order() -> None:
    async with FakeOpenAIServer(default=FakeResponse(embedding_dimensions=16)) as server:
        generator = OpenAIEmbeddingGenerator(
            "emb", base_url=server.base_url, api_key="k", batch_size=2
        )
        texts = ["a", "b", "c", "d", "e"]
        matrix = await generator.generate(texts)
        assert matrix.shape == (5, 16) and matrix.dtype == np.float32
        assert server.count(EMBEDDINGS_PATH) == 3
        again = await generator.generate(["c"])
        np.testing.assert_allclose(again[0], matrix[2], rtol=1e-6)
        assert [r.json["input"] for r in server.requests[:3]] == [["a", "b"], ["c", "d"], ["e"]]
        assert (await generator.generate([])).shape[0] == 0
        await generator.aclose()


async def test_errors_are_provider_errors() -> None:
    async with FakeOpenAIServer() as server:
        server.script(FakeResponse.error(429, retry_after="2"), path=EMBEDDINGS_PATH)
        generator = OpenAIEmbeddingGenerator("emb", base_url=server.base_url, api_key="k")
        with pytest.raises(RateLimitedError) as caught:
            await generator.generate(["x"])
        assert caught.value.retry_after == 2.0
        await generator.aclose()


@pytest.mark.parametrize(
    "body",
    [
        {"data": [{"index": 0, "embedding": [1.0, 2.0]}]},  # one vector for two inputs
        {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [1.0, 2.0]}]},
        {"data": [{"index": 0, "embedding": ["x"]}, {"index": 1, "embedding": [1.0]}]},
        {"data": [{"embedding": [1.0]}, {"embedding": [1.0]}]},
        {"nope": 1},
    ],
)
async def test_malformed_embeddings(body: object) -> None:
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, json=body))
    async with httpx2.AsyncClient(transport=transport) as http:
        generator = OpenAIEmbeddingGenerator(
            "e", base_url="http://127.0.0.1:1/v1", http_client=http
        )
        with pytest.raises(ProviderError) as caught:
            await generator.generate(["a", "b"])
        assert caught.value.code == "malformed"


async def test_requests_carry_the_current_trace_context(otel: Otel) -> None:
    async with FakeOpenAIServer() as server:
        generator = OpenAIEmbeddingGenerator("emb", base_url=server.base_url, api_key="k")
        tracer = otel.tracer_provider.get_tracer("test")
        with tracer.start_as_current_span("embed") as span:
            await generator.generate(["x"])
        await generator.generate(["y"])
        await generator.aclose()
    traced, untraced = server.requests
    trace_id, span_id = traced.headers["traceparent"].split("-")[1:3]
    assert (trace_id, span_id) == (
        format(span.get_span_context().trace_id, "032x"),
        format(span.get_span_context().span_id, "016x"),
    )
    assert "traceparent" not in untraced.headers


def test_validation() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        OpenAIEmbeddingGenerator("e", base_url="http://127.0.0.1:1/v1", batch_size=0)
