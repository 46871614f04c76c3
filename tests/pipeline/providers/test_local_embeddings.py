import asyncio
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from pipeline.errors import ProviderError
from pipeline.providers.local import LocalEmbeddingGenerator


class FakeSentenceTransformer:
    """Shaped like ``sentence_transformers.SentenceTransformer.encode``: a list of texts in,
    a float32 (n, d) array out; deterministic (hashed words); records each call's thread,
    size and the most calls in flight at once."""

    def __init__(self, dimensions: int = 16) -> None:
        self.dimensions = dimensions
        self.threads: list[int] = []
        self.sizes: list[int] = []
        self.running = 0
        self.most_running = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Semaphore(0)  # released as each call starts
        self._lock = threading.Lock()
        self.result: Any = None

    def vector(self, text: str) -> np.ndarray:
        out = np.zeros(self.dimensions, dtype=np.float32)
        for word in text.lower().split():
            out[zlib.crc32(word.encode()) % self.dimensions] += 1.0
        return out

    def encode(self, sentences: list[str], batch_size: int = 32, **_: object) -> Any:
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        self.entered.release()
        try:
            self.threads.append(threading.get_ident())
            self.sizes.append(len(sentences))
            if self.gate is not None:
                assert self.gate.wait(10)
            if self.result is not None:
                return self.result
            return np.stack([self.vector(s) for s in sentences])
        finally:
            with self._lock:
                self.running -= 1


async def test_encodes_off_the_event_loop_in_batches() -> None:
    model = FakeSentenceTransformer()
    generator = LocalEmbeddingGenerator(model, batch_size=4)
    texts = [f"text number {i}" for i in range(10)]
    vectors = await generator.generate(texts)
    assert vectors.shape == (10, 16) and vectors.dtype == np.float32
    np.testing.assert_array_equal(vectors[3], model.vector("text number 3"))
    assert model.sizes == [4, 4, 2]  # in order, at most batch_size per encode
    assert threading.get_ident() not in model.threads
    assert generator.dimensions == 16
    assert generator.identity.endswith("FakeSentenceTransformer")
    np.testing.assert_array_equal(generator.encode(texts), vectors)  # the same, synchronously
    await generator.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await generator.generate(["x"])


@pytest.mark.parametrize("limit", [1, 2])
async def test_concurrent_calls_are_bounded(limit: int) -> None:
    model = FakeSentenceTransformer()
    model.gate = threading.Event()
    generator = LocalEmbeddingGenerator(model, max_concurrency=limit)
    tasks = [asyncio.create_task(generator.generate([f"q{i}"])) for i in range(6)]
    for _ in range(limit):  # until the workers hold their calls
        assert await asyncio.to_thread(model.entered.acquire, timeout=10)
    assert model.running == limit
    model.gate.set()
    results = await asyncio.gather(*tasks)
    assert [r.shape for r in results] == [(1, 16)] * 6
    assert model.most_running == limit
    await generator.aclose()


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (np.zeros((3, 4), dtype=np.float32), r"shape \(3, 4\) for 2 texts"),
        (np.zeros(4, dtype=np.float32), r"shape \(4,\) for 2 texts"),
        (np.asarray([[np.nan, 1.0], [1.0, 1.0]]), "NaN or infinity"),
        ([[1.0, 2.0], [1.0]], "non-numeric or ragged"),
        ([["a", "b"], ["c", "d"]], "non-numeric or ragged"),
        (np.zeros((2, 0), dtype=np.float32), "dimension 0"),
    ],
)
async def test_bad_encoder_output_is_a_provider_error(result: object, match: str) -> None:
    model = FakeSentenceTransformer()
    model.result = result
    generator = LocalEmbeddingGenerator(model)
    with pytest.raises(ProviderError, match=match) as caught:
        await generator.generate(["secret canary one", "secret canary two"])
    assert caught.value.provider == "local" and caught.value.code == "malformed"
    assert "canary" not in str(caught.value)
    with pytest.raises(ProviderError, match=match):
        generator.encode(["secret canary one", "secret canary two"])


async def test_a_changed_dimension_is_refused() -> None:
    model = FakeSentenceTransformer()
    generator = LocalEmbeddingGenerator(model)
    await generator.generate(["a"])
    model.dimensions = 8
    with pytest.raises(ProviderError, match="dimension 8 after 16"):
        await generator.generate(["b"])


def test_construction_refuses_what_cannot_encode() -> None:
    with pytest.raises(TypeError, match="encode"):
        LocalEmbeddingGenerator(object())  # type: ignore[arg-type]

    class AsyncEncode:
        async def encode(self, sentences: Sequence[str]) -> None: ...

    with pytest.raises(TypeError, match="coroutine"):
        LocalEmbeddingGenerator(AsyncEncode())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        LocalEmbeddingGenerator(FakeSentenceTransformer(), batch_size=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        LocalEmbeddingGenerator(FakeSentenceTransformer(), max_concurrency=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model"):
        LocalEmbeddingGenerator("  ")


def test_a_model_by_name_without_sentence_transformers_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.providers import local

    monkeypatch.setattr(local, "_sentence_transformers_installed", lambda: False)
    with pytest.raises(ImportError, match=r"chat-pipeline\[local\]"):
        LocalEmbeddingGenerator("all-MiniLM-L6-v2")
    # An encoder object never needs it.
    assert LocalEmbeddingGenerator(FakeSentenceTransformer()).identity


async def test_closing_closes_the_encoder_when_it_can() -> None:
    class Closable(FakeSentenceTransformer):
        closed = 0

        def close(self) -> None:
            self.closed += 1

    model = Closable()
    generator = LocalEmbeddingGenerator(model)
    await generator.aclose()
    await generator.aclose()
    assert model.closed == 1


async def test_a_sync_generate_adapter_is_wrapped() -> None:
    class SyncAdapter:
        def generate(self, values: Sequence[str]) -> np.ndarray:
            return np.ones((len(values), 3), dtype=np.float32)

    generator = LocalEmbeddingGenerator.wrapping(SyncAdapter())
    assert (await generator.generate(["a", "b"])).shape == (2, 3)
    assert "SyncAdapter" in generator.identity
