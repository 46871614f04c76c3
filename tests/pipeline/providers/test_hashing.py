import numpy as np
import pytest

from pipeline.providers import HashingEmbeddingGenerator


async def test_deterministic_unit_vectors() -> None:
    generator = HashingEmbeddingGenerator(dimensions=64)
    first = await generator.generate(["hello world", "hello world", "", "other text"])
    assert first.shape == (4, 64) and first.dtype == np.float32
    np.testing.assert_array_equal(first[0], first[1])
    assert np.linalg.norm(first[0]) == pytest.approx(1.0, abs=1e-6)
    assert np.linalg.norm(first[2]) == 0.0  # empty text: the zero vector
    again = await HashingEmbeddingGenerator(dimensions=64).generate(["hello world"])
    np.testing.assert_array_equal(again[0], first[0])
    assert float(first[0] @ first[3]) < 0.9
    assert (await generator.generate([])).shape == (0, 64)
    assert generator.calls == 2 and generator.texts_embedded == 4


def test_validation() -> None:
    with pytest.raises(ValueError):
        HashingEmbeddingGenerator(dimensions=1)
    with pytest.raises(ValueError):
        HashingEmbeddingGenerator(ngrams=())


async def test_values_must_be_strings() -> None:
    with pytest.raises(TypeError):
        await HashingEmbeddingGenerator().generate("not a list")
