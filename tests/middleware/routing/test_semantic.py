import asyncio
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from middleware.routing import Route, SemanticRoutingChatClient
from middleware.routing.semantic import SEMANTIC_REASON, SEMANTIC_SCORE
from pipeline import ChatMessage, ChatPipeline
from pipeline.errors import RoutingError
from pipeline.providers import HashingEmbeddingGenerator
from pipeline.testing import ScriptedChatClient, collect, reply
from tests.otel import Otel

AXES = {"x": [1.0, 0.0, 0.0], "y": [0.0, 1.0, 0.0], "z": [0.0, 0.0, 1.0]}


def unit(*values: float) -> list[float]:
    vector = np.asarray(values, dtype=np.float64)
    return list(vector / np.linalg.norm(vector))


class TableGenerator:
    """Embeds by table lookup; counts calls; can be gated, broken or made to misbehave."""

    def __init__(self, table: dict[str, list[float]], dimensions: int = 3) -> None:
        self.table = table
        self.dimensions = dimensions
        self.calls: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.called = asyncio.Event()  # set by the first call
        self.fail_with: BaseException | None = None
        self.override: object = None
        self.close_count = 0

    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        self.calls.append(list(values))
        self.called.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        if self.override is not None and len(values) == 1:
            return self.override  # type: ignore[return-value]
        return np.asarray([self.table[v] for v in values], dtype=np.float32)

    async def aclose(self) -> None:
        self.close_count += 1


def clients(*names: str) -> dict[str, ScriptedChatClient]:
    return {n: ScriptedChatClient(reply(n), name=n) for n in names}


def make(
    generator: TableGenerator, routes: dict[str, ScriptedChatClient], **options: object
) -> SemanticRoutingChatClient:
    profiles = {
        Route("billing", routes["billing"]): ["x1", "x2"],
        Route("code", routes["code"]): ["y1"],
    }
    return SemanticRoutingChatClient(
        generator, profiles, Route("general", routes["general"]), **options
    )  # type: ignore[arg-type]


TABLE = {
    "x1": AXES["x"],
    "x2": unit(1, 0.2, 0),
    "y1": AXES["y"],
    "invoice?": unit(1, 0.1, 0),
    "bug?": unit(0.1, 1, 0),
    "weather?": AXES["z"],
    "between": unit(1, 1, 0),
}


async def test_best_profile_is_selected_and_the_index_is_cached(streaming: bool) -> None:
    generator = TableGenerator(TABLE)
    routes = clients("billing", "code", "general")
    router = make(generator, routes)
    assert (await collect(router, "invoice?", streaming=streaming)).text == "billing"
    assert (await collect(router, "bug?", streaming=streaming)).text == "code"
    assert (await collect(router, "weather?", streaming=streaming)).text == "general"
    profile_calls = [c for c in generator.calls if len(c) > 1]
    assert profile_calls == [["x1", "x2", "y1"]]  # embedded once, however many requests
    assert len(generator.calls) == 4


async def test_concurrent_first_requests_embed_once(streaming: bool) -> None:
    generator = TableGenerator(TABLE)
    generator.gate = asyncio.Event()
    router = make(generator, clients("billing", "code", "general"))
    tasks = [
        asyncio.create_task(collect(router, "invoice?", streaming=streaming)) for _ in range(10)
    ]
    await generator.called.wait()  # the profile's build is under way, held at the gate
    generator.gate.set()
    results = await asyncio.gather(*tasks)
    assert {r.text for r in results} == {"billing"}
    assert sum(1 for c in generator.calls if c == ["x1", "x2", "y1"]) == 1


async def test_cancelled_first_request_does_not_cancel_the_build() -> None:
    generator = TableGenerator(TABLE)
    generator.gate = asyncio.Event()
    router = make(generator, clients("billing", "code", "general"))
    first = asyncio.create_task(router.get_response("invoice?"))
    second = asyncio.create_task(router.get_response("bug?"))
    await generator.called.wait()  # the build the first request started is under way
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    generator.gate.set()
    assert (await second).text == "code"


async def test_failed_build_is_retried_by_the_next_request() -> None:
    generator = TableGenerator(TABLE)
    generator.fail_with = ConnectionError("embedding service down")
    router = make(generator, clients("billing", "code", "general"))
    with pytest.raises(ConnectionError):
        await router.get_response("invoice?")
    generator.fail_with = None
    assert (await router.get_response("invoice?")).text == "billing"


def test_global_top_k_aggregation() -> None:
    # Route a has one excellent and two poor matches; route b has three good ones.
    table = {
        "a1": unit(1, 0, 0),
        "a2": unit(0, 0, 1),
        "a3": unit(0, 0.1, 1),
        "b1": unit(0.8, 0.6, 0),
        "b2": unit(0.8, 0.6, 0.05),
        "b3": unit(0.8, 0.6, 0.1),
        "q": unit(1, 0.3, 0),
    }
    routes = clients("a", "b", "general")
    profiles = {
        Route("a", routes["a"]): ["a1", "a2", "a3"],
        Route("b", routes["b"]): ["b1", "b2", "b3"],
    }

    def choose(top_k: int, aggregation: str) -> str:
        router = SemanticRoutingChatClient(
            TableGenerator(table),
            profiles,
            routes["general"],
            top_k=top_k,
            aggregation=aggregation,
            threshold=0.0,  # type: ignore[arg-type]
        )
        return asyncio.run(router.get_response("q")).text

    # q . a1 = 0.958; q . b* = 0.946, 0.944, 0.940 (all b above a's others).
    assert choose(1, "mean") == "a"
    assert choose(3, "max") == "a"  # a1 is in the top 3 and is the single best
    assert choose(3, "sum") == "b"  # top 3 is a1, b1, b2: b sums two
    assert choose(4, "mean") == "a"  # a: 0.958; b: mean of three slightly lower scores
    assert choose(4, "sum") == "b"


async def test_explain_ranks_routes() -> None:
    router = make(TableGenerator(TABLE), clients("billing", "code", "general"), top_k=3)
    ranked = await router.explain("invoice?")
    assert [r.route_name for r in ranked] == ["billing", "code"]
    assert ranked[0].score > ranked[1].score


async def test_below_threshold_and_no_user_text_use_default(streaming: bool, otel: Otel) -> None:
    routes = clients("billing", "code", "general")
    router = make(TableGenerator(TABLE), routes, threshold=0.9, **otel.providers)
    assert (await collect(router, "between", streaming=streaming)).text == "general"
    assistant_only = [ChatMessage.system("s"), ChatMessage.assistant("a")]
    assert (await collect(router, assistant_only, streaming=streaming)).text == "general"
    reasons = [dict(s.attributes or {}) for s in otel.attempt_spans()]
    assert reasons[0][SEMANTIC_REASON] == "below_threshold"
    assert reasons[0][SEMANTIC_SCORE] == pytest.approx(1.2 / (2**0.5 * 1.04**0.5), abs=1e-4)
    assert reasons[1][SEMANTIC_REASON] == "no_user_text"
    assert all("between" not in repr(r) for r in reasons)


async def test_match_is_recorded_on_the_attempt_span(otel: Otel) -> None:
    router = make(TableGenerator(TABLE), clients("billing", "code", "general"), **otel.providers)
    await router.get_response("invoice?")
    (span,) = otel.attempt_spans()
    attributes = dict(span.attributes or {})
    assert attributes["chat_pipeline.route.name"] == "billing"
    assert attributes[SEMANTIC_REASON] == "match" and attributes[SEMANTIC_SCORE] > 0.9


async def test_last_user_message_is_the_query() -> None:
    router = make(TableGenerator(TABLE), clients("billing", "code", "general"))
    messages = [
        ChatMessage.user("bug?"),
        ChatMessage.assistant("..."),
        ChatMessage.user("invoice?"),
    ]
    assert (await router.get_response(messages)).text == "billing"


@pytest.mark.parametrize(
    ("profiles", "options", "match"),
    [
        ({}, {}, "non-empty mapping"),
        ({"billing": []}, {}, "non-empty list"),
        ({"billing": ["ok", "  "]}, {}, "utterance 1 is blank"),
        ({"billing": "x1"}, {}, "non-empty list"),
        ({"billing": ["x1"]}, {"top_k": 0}, "top_k must be at least 1, got 0"),
        ({"billing": ["x1"]}, {"top_k": 2}, "exceeds the number of utterances"),
        ({"billing": ["x1", "x2"]}, {"threshold": 1.5}, r"lies in \[-1, 1\]"),
        (
            {"billing": ["x1", "x2"]},
            {"threshold": 2.5, "top_k": 2, "aggregation": "sum"},
            r"\[-2, 2\]",
        ),
        ({"billing": ["x1"]}, {"aggregation": "median"}, "aggregation must be"),
        ({"billing": ["x1"]}, {"embedding_timeout": 0}, "embedding_timeout"),
    ],
)
def test_invalid_configuration(
    profiles: dict[str, list[str]], options: dict[str, object], match: str
) -> None:
    routes = clients("billing", "general")
    keyed = {Route(name, routes[name]): value for name, value in profiles.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        SemanticRoutingChatClient(TableGenerator(TABLE), keyed, routes["general"], **options)  # type: ignore[arg-type]


def test_generator_must_be_an_embedding_generator() -> None:
    with pytest.raises(TypeError, match="embedding_generator"):
        SemanticRoutingChatClient(object(), {ScriptedChatClient(): ["a"]}, ScriptedChatClient())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (np.zeros((2, 3), dtype=np.float32), "expected 1 vectors"),
        (np.zeros((1, 4), dtype=np.float32), "expected dimension 3, got 4"),
        (np.asarray([[np.nan, 0, 0]], dtype=np.float32), "NaN"),
    ],
)
async def test_bad_query_embeddings_fail_clearly(
    streaming: bool, override: object, match: str
) -> None:
    generator = TableGenerator(TABLE)
    router = make(generator, clients("billing", "code", "general"))
    await router.get_response("invoice?")
    generator.override = override
    result = await collect(router, "invoice?", streaming=streaming)
    assert isinstance(result.error, RoutingError)
    assert match in str(result.error)


async def test_bad_profile_embeddings_fail_clearly() -> None:
    generator = TableGenerator({**TABLE, "x1": [0.0, 0.0, 0.0]})
    router = make(generator, clients("billing", "code", "general"))
    with pytest.raises(RoutingError, match="utterance 0 is the zero vector"):
        await router.get_response("invoice?")


@pytest.mark.parametrize("problem", ["error", "timeout", "zero"])
async def test_embedding_trouble_uses_default_or_raises(
    streaming: bool, otel: Otel, problem: str
) -> None:
    generator = TableGenerator(TABLE)
    routes = clients("billing", "code", "general")
    router = make(generator, routes, embedding_timeout=0.01, **otel.providers)
    await router.get_response("x1")  # build the index first
    if problem == "error":
        generator.fail_with = ConnectionError("down")
    elif problem == "timeout":
        generator.gate = asyncio.Event()  # never set: the query embedding hangs
    else:
        generator.override = np.zeros((1, 3), dtype=np.float32)
    result = await collect(router, "invoice?", streaming=streaming)
    assert result.text == "general"
    reason = dict(otel.attempt_spans()[-1].attributes or {})[SEMANTIC_REASON]
    assert (
        reason
        == {
            "error": "embedding_error",
            "timeout": "embedding_timeout",
            "zero": "zero_query_vector",
        }[problem]
    )
    strict = make(generator, routes, embedding_timeout=0.01, on_embedding_error="raise")
    strict._snapshot = router._snapshot
    failed = await collect(strict, "invoice?", streaming=streaming)
    assert isinstance(failed.error, ConnectionError | TimeoutError | RoutingError)


async def test_owned_clients_and_generator_closed_once() -> None:
    generator = TableGenerator(TABLE)
    routes = clients("billing", "code", "general")
    profiles = {Route("billing", routes["billing"]): ["x1"], Route("code", routes["code"]): ["y1"]}
    router = SemanticRoutingChatClient(generator, profiles, Route("again", routes["billing"]))
    await router.aclose()
    await router.aclose()
    assert (routes["billing"].close_count, routes["code"].close_count, generator.close_count) == (
        1,
        1,
        1,
    )
    kept = TableGenerator(TABLE)
    left = SemanticRoutingChatClient(
        kept, {routes["general"]: ["x1"]}, routes["general"], leave_open=True
    )
    await left.aclose()
    assert kept.close_count == 0 and routes["general"].close_count == 0


async def test_builder_and_the_offline_generator(streaming: bool) -> None:
    routes = clients("billing", "code", "general")
    chat = (
        ChatPipeline.builder()
        .use_semantic_routing(
            HashingEmbeddingGenerator(),
            {
                Route("billing", routes["billing"]): [
                    "refund my invoice",
                    "billing question about my invoice",
                ],
                Route("code", routes["code"]): [
                    "python stack trace error",
                    "fix this exception in my code",
                ],
            },
            routes["general"],
            threshold=0.2,
        )
        .build()
    )
    assert (
        await collect(chat, "why was my invoice charged twice", streaming=streaming)
    ).text == "billing"
    assert (await collect(chat, "exception in my python code", streaming=streaming)).text == "code"
    assert (await collect(chat, "zzz qqq", streaming=streaming)).text == "general"


async def test_a_large_index_is_scored_off_the_event_loop(
    streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from middleware.routing import semantic

    loop_thread = threading.get_ident()
    scored_on: list[int] = []
    original = SemanticRoutingChatClient._decide

    def spy(
        self: SemanticRoutingChatClient, snapshot: object, query: object, *, ranked: bool
    ) -> object:
        scored_on.append(threading.get_ident())
        return original(self, snapshot, query, ranked=ranked)  # type: ignore[arg-type]

    monkeypatch.setattr(SemanticRoutingChatClient, "_decide", spy)
    router = make(TableGenerator(TABLE), clients("billing", "code", "general"))
    assert (await collect(router, "invoice?", streaming=streaming)).text == "billing"
    monkeypatch.setattr(semantic, "OFF_LOOP_ELEMENTS", 0)  # every index is "large" now
    assert (await collect(router, "bug?", streaming=streaming)).text == "code"
    assert scored_on[0] == loop_thread and scored_on[1] != loop_thread


@pytest.mark.parametrize(
    ("utterances", "dimensions", "tile", "block"),
    [(1, 3, 400_000, 16_384), (10, 7, 8, 4), (1_000, 64, 1_000, 300), (33, 5, 1, 1)],
)
def test_the_tiled_index_scores_like_one_product(
    utterances: int, dimensions: int, tile: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline import _vectors

    monkeypatch.setattr(_vectors, "TILE_ELEMENTS", tile)
    monkeypatch.setattr(_vectors, "BLOCK_UTTERANCES", block)
    rng = np.random.default_rng(utterances)
    matrix = rng.standard_normal((utterances, dimensions)).astype(np.float32)
    query = rng.standard_normal(dimensions).astype(np.float32)
    index = _vectors.VectorIndex(matrix)
    expected = matrix.astype(np.float64) @ query.astype(np.float64)
    scores = index.similarities(query)
    assert scores.shape == (utterances,) and scores.dtype == np.float32
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-4)
    assert np.array_equal(index.similarities(query), scores)  # no state kept between queries


async def test_a_tiled_index_picks_the_same_routes(
    streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline import _vectors

    monkeypatch.setattr(_vectors, "TILE_ELEMENTS", 2)  # one dimension per product
    monkeypatch.setattr(_vectors, "BLOCK_UTTERANCES", 1)  # one utterance per block
    router = make(TableGenerator(TABLE), clients("billing", "code", "general"))
    assert (await collect(router, "invoice?", streaming=streaming)).text == "billing"
    assert (await collect(router, "bug?", streaming=streaming)).text == "code"
    assert (await collect(router, "weather?", streaming=streaming)).text == "general"
