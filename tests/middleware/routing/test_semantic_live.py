"""Semantic routing with local encoders, per-route thresholds, live routes, decisions,
saved indexes and fitting."""

import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from middleware.routing import Route, SemanticRoutingChatClient
from middleware.routing.semantic import (
    PROBES,
    SEMANTIC_REASON,
    RouteDecision,
    RouteProfile,
)
from pipeline.errors import ProviderError, RoutingError, SemanticIndexError
from pipeline.providers import HashingEmbeddingGenerator
from pipeline.providers.local import LocalEmbeddingGenerator
from pipeline.testing import ScriptedChatClient, collect, reply
from tests.otel import Otel
from tests.pipeline.providers.test_local_embeddings import FakeSentenceTransformer


def unit(*values: float) -> list[float]:
    vector = np.asarray(values, dtype=np.float64)
    return list(vector / np.linalg.norm(vector))


TABLE: dict[str, list[float]] = {
    "x1": unit(1, 0, 0),
    "x2": unit(1, 0.2, 0),
    "y1": unit(0, 1, 0),
    "z1": unit(0, 0, 1),
    "invoice?": unit(1, 0.1, 0),
    "bug?": unit(0.1, 1, 0),
    "weather?": unit(0, 0.05, 1),
    "between": unit(1, 1, 0),
}


class TableGenerator:
    """Async embedder by table lookup (unknown texts: a hashed vector); yields to the loop
    once per call so concurrent requests interleave; counts the texts it embedded."""

    def __init__(self, dimensions: int = 3, identity: str = "table") -> None:
        self.dimensions = dimensions
        self.identity = identity
        self.calls: list[list[str]] = []
        self.hashing = HashingEmbeddingGenerator(dimensions=max(2, dimensions))

    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        self.calls.append(list(values))
        await asyncio.sleep(0)
        rows = []
        for v in values:
            if v in TABLE and self.dimensions == 3:
                rows.append(np.asarray(TABLE[v], dtype=np.float32))
            else:
                rows.append((await self.hashing.generate([v]))[0][: self.dimensions] + 0.01)
        return np.stack(rows).astype(np.float32)

    async def aclose(self) -> None:
        return None

    def texts(self) -> list[str]:
        return [t for call in self.calls for t in call]


def clients(*names: str) -> dict[str, ScriptedChatClient]:
    return {n: ScriptedChatClient(reply(n), name=n) for n in names}


def router_of(
    generator: object, **options: object
) -> tuple[SemanticRoutingChatClient, dict[str, ScriptedChatClient]]:
    routes = clients("billing", "code", "weather", "general")
    router = SemanticRoutingChatClient(
        generator,  # type: ignore[arg-type]
        {
            Route("billing", routes["billing"]): ["x1", "x2"],
            Route("code", routes["code"]): ["y1"],
        },
        Route("general", routes["general"]),
        **options,  # type: ignore[arg-type]
    )
    return router, routes


# -- encoders the router accepts ----------------------------------------------------------


async def test_a_sentence_transformers_model_is_accepted_as_it_is(streaming: bool) -> None:
    model = FakeSentenceTransformer(dimensions=256)
    routes = clients("billing", "code", "general")
    router = SemanticRoutingChatClient(
        model,  # type: ignore[arg-type]
        {
            Route("billing", routes["billing"]): ["refund my invoice", "invoice charged twice"],
            Route("code", routes["code"]): ["python exception trace", "fix python bug"],
        },
        routes["general"],
        threshold=0.4,
    )
    assert isinstance(router.generator, LocalEmbeddingGenerator)
    assert (await collect(router, "my invoice was charged", streaming=streaming)).text == "billing"
    assert (await collect(router, "python exception", streaming=streaming)).text == "code"
    assert (await collect(router, "zzz qqq", streaming=streaming)).text == "general"
    decision = router.route_sync("refund invoice")  # no event loop needed for a local model
    assert decision.route_name == "billing"


async def test_a_sync_adapter_is_wrapped_at_construction(streaming: bool) -> None:
    class SyncAdapter:
        def generate(self, values: Sequence[str]) -> np.ndarray:
            return np.asarray([TABLE[v] for v in values], dtype=np.float32)

    router, _ = router_of(SyncAdapter())
    assert isinstance(router.generator, LocalEmbeddingGenerator)
    # The first request works (it used to fail: an array cannot be awaited).
    assert (await collect(router, "invoice?", streaming=streaming)).text == "billing"
    assert (await collect(router, "bug?", streaming=streaming)).text == "code"


def test_what_cannot_embed_is_refused_at_construction() -> None:
    for embedder in (object(), type("NoClose", (), {"generate": lambda self, v: None})):
        if isinstance(embedder, type):

            class AsyncNoClose:
                async def generate(self, values: Sequence[str]) -> None: ...

            embedder = AsyncNoClose()
        with pytest.raises(TypeError, match="embedding_generator"):
            router_of(embedder)


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (np.zeros((1, 4), dtype=np.float32), "expected dimension 3, got 4"),
        (np.asarray([[np.nan, 0, 0]], dtype=np.float32), "NaN"),
        (np.zeros((2, 3), dtype=np.float32), "expected 1 vectors"),
    ],
)
async def test_bad_query_vectors_from_a_local_encoder_are_typed(
    streaming: bool, result: object, match: str
) -> None:
    class Encoder:
        result: object = None

        def encode(self, sentences: list[str]) -> object:
            if self.result is not None:
                return self.result
            return np.asarray([TABLE[s] for s in sentences], dtype=np.float32)

    encoder = Encoder()
    router, _ = router_of(encoder)
    await router.warm()
    encoder.result = result
    result = await collect(router, "invoice?", streaming=streaming)
    # What the encoder got wrong is the generator's ProviderError: an embedding error, so
    # the default route; a vector of another dimension than the index is the router's
    # RoutingError, naming what was expected.
    if result.error is None:
        assert result.text == "general"
    else:
        assert isinstance(result.error, RoutingError) and match in str(result.error)
    strict, _ = router_of(encoder, on_embedding_error="raise")
    strict._snapshot = router._snapshot
    assert isinstance(
        (await collect(strict, "invoice?", streaming=streaming)).error, RoutingError | ProviderError
    )


async def test_bad_profile_vectors_are_typed() -> None:
    class Encoder:
        def encode(self, sentences: list[str]) -> object:
            return np.full((len(sentences), 3), np.inf, dtype=np.float32)

    router, _ = router_of(Encoder())
    with pytest.raises(ProviderError, match="NaN or infinity"):
        await router.warm()


# -- warm, thresholds, decisions -----------------------------------------------------------


async def test_warm_builds_the_index_before_any_request(streaming: bool) -> None:
    generator = TableGenerator()
    router, _ = router_of(generator)
    assert not router.is_warm
    await router.warm()
    assert router.is_warm and generator.calls == [["x1", "x2", "y1"]]
    await router.warm()  # built: nothing again
    assert (await collect(router, "invoice?", streaming=streaming)).text == "billing"
    assert generator.calls[1:] == [["invoice?"]]


async def test_per_route_thresholds(streaming: bool, otel: Otel) -> None:
    routes = clients("billing", "code", "general")
    router = SemanticRoutingChatClient(
        TableGenerator(),
        {
            Route("billing", routes["billing"]): RouteProfile(["x1"], threshold=0.999),
            Route("code", routes["code"]): ["y1"],
        },
        routes["general"],
        threshold=0.5,
        **otel.providers,
    )
    assert router.thresholds == {"billing": 0.999, "code": 0.5}
    # invoice? scores 0.995 on billing: below billing's own threshold, above the router's.
    assert (await collect(router, "invoice?", streaming=streaming)).text == "general"
    assert (await collect(router, "bug?", streaming=streaming)).text == "code"
    reasons = [dict(s.attributes or {})[SEMANTIC_REASON] for s in otel.attempt_spans()]
    assert reasons == ["below_threshold", "match"]
    with pytest.raises(ValueError, match=r"profile 'billing': threshold 2.0 cannot be reached"):
        SemanticRoutingChatClient(
            TableGenerator(),
            {routes["billing"]: RouteProfile(["x1"], threshold=2.0)},
            routes["general"],
        )


async def test_route_returns_every_routes_score() -> None:
    router, _ = router_of(TableGenerator())
    decision = await router.route("invoice?")
    assert isinstance(decision, RouteDecision)
    assert decision.route_name == "billing" and decision.reason == "match"
    assert decision.score == pytest.approx(float(np.dot(TABLE["invoice?"], TABLE["x2"])), abs=1e-5)
    # Every route, ranked, at the default top_k=1 (not only the winner).
    assert [s.route_name for s in decision.scores] == ["billing", "code"]
    assert decision.scores[1].score == pytest.approx(
        float(np.dot(TABLE["invoice?"], TABLE["y1"])), abs=1e-5
    )
    assert [s.route_name for s in await router.explain("bug?")] == ["code", "billing"]
    below = await router.route("weather?")
    assert below.route is None and below.reason == "below_threshold" and below.candidate is not None
    assert (await router.route("  ")).reason == "no_user_text"


async def test_route_sync_takes_a_vector_or_needs_a_sync_encoder() -> None:
    router, _ = router_of(TableGenerator())
    with pytest.raises(RoutingError, match="warm"):
        router.route_sync(np.asarray(TABLE["bug?"]))
    await router.warm()
    assert router.route_sync(np.asarray(TABLE["bug?"])).route_name == "code"
    with pytest.raises(TypeError, match="await route"):
        router.route_sync("bug?")
    with pytest.raises(RoutingError, match="dimension 3"):
        router.route_sync(np.ones(5))


# -- live routes -----------------------------------------------------------------------------


async def test_add_and_remove_routes_while_serving(streaming: bool) -> None:
    generator = TableGenerator()
    router, routes = router_of(generator)
    assert (await collect(router, "weather?", streaming=streaming)).text == "general"
    await router.add_route(Route("weather", routes["weather"]), ["z1"])
    assert (await collect(router, "weather?", streaming=streaming)).text == "weather"
    removed = await router.remove_route("billing")
    assert removed.name == "billing" and routes["billing"].close_count == 0
    assert (await collect(router, "invoice?", streaming=streaming)).text == "general"
    assert [r.name for r in router.routes] == ["code", "weather"]
    with pytest.raises(ValueError, match="already"):
        await router.add_route(Route("code", routes["code"]), ["y1"])
    with pytest.raises(KeyError, match="nope"):
        await router.remove_route("nope")
    await router.remove_route("code")
    with pytest.raises(ValueError, match="last profile route"):
        await router.remove_route("weather")
    await router.aclose()
    assert routes["weather"].close_count == 1  # an added route is owned


async def test_routes_added_before_the_index_is_built_are_embedded_with_it() -> None:
    generator = TableGenerator()
    router, routes = router_of(generator)
    await router.add_route(Route("weather", routes["weather"]), RouteProfile(["z1"], threshold=0.9))
    assert generator.calls == []
    assert (await router.route("weather?")).route_name == "weather"
    assert generator.calls[0] == ["x1", "x2", "y1", "z1"]


async def test_no_request_sees_a_half_built_index_under_1000_concurrent_requests(
    streaming: bool,
) -> None:
    generator = TableGenerator()
    router, routes = router_of(generator)
    await router.warm()
    queries = ["invoice?", "weather?", "bug?", "between"] * 250

    async def change() -> None:
        for _ in range(5):
            await router.add_route(Route("weather", routes["weather"]), ["z1"])
            await asyncio.sleep(0)
            removed = await router.remove_route("billing")
            await asyncio.sleep(0)
            await router.add_route(removed, ["x1", "x2"])
            await router.remove_route("weather")

    changing = asyncio.create_task(change())
    tasks = []
    for wave in range(50):  # 20 requests per turn of the loop, while the routes change
        tasks += [
            asyncio.create_task(collect(router, q, streaming=streaming))
            for q in queries[wave * 20 : (wave + 1) * 20]
        ]
        await asyncio.sleep(0)
    results = await asyncio.gather(*tasks)
    await changing
    allowed = {
        "invoice?": {"billing", "general"},  # billing removed: nothing else is near
        "weather?": {"weather", "general"},
        "bug?": {"code"},
        "between": {"billing", "code"},  # x and y tie closely: either, never an error
    }
    assert len(results) == 1000
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    for query, result in zip(queries, results, strict=True):
        assert result.text in allowed[query], (query, result.text)
    seen = {r.text for q, r in zip(queries, results, strict=True) if q == "weather?"}
    assert seen == {"weather", "general"}  # requests really ran across the changes
    assert [r.name for r in router.routes] == ["code", "billing"]


# -- saving and loading -------------------------------------------------------------------


async def test_save_and_load_skip_embedding_the_profiles(tmp_path: Path, streaming: bool) -> None:
    path = tmp_path / "index.npz"
    router, _ = router_of(TableGenerator())
    await router.save(path)
    generator = TableGenerator()
    again, _ = router_of(generator)
    assert await again.load(path) == 0
    assert generator.texts() == list(PROBES)  # only the probes: no profile utterance
    assert (await collect(again, "invoice?", streaming=streaming)).text == "billing"
    # A profile utterance the file lacks is embedded now.
    routes = clients("billing", "general")
    grown = SemanticRoutingChatClient(
        TableGenerator(),
        {Route("billing", routes["billing"]): ["x1", "x2", "between"]},
        routes["general"],
    )
    assert await grown.load(path) == 1


async def test_an_index_from_another_embedder_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "index.npz"
    router, _ = router_of(TableGenerator(dimensions=8, identity="model-a"))
    await router.save(path)
    for generator, match in [
        (
            TableGenerator(dimensions=8, identity="model-b"),
            "made with embedder 'model-a'.*'model-b'",
        ),
        (TableGenerator(dimensions=4, identity="model-a"), "dimension 8.*gives dimension 4"),
    ]:
        other, _ = router_of(generator)
        with pytest.raises(SemanticIndexError, match=match):
            await other.load(path)
        assert not other.is_warm  # nothing changed

    class Shifted(TableGenerator):
        async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
            return (await super().generate(values))[:, ::-1].copy()  # another model, same shape

    other, _ = router_of(Shifted(dimensions=8, identity="model-a"))
    with pytest.raises(SemanticIndexError, match="other vectors"):
        await other.load(path)
    (tmp_path / "junk.npz").write_bytes(b"not an index")
    with pytest.raises(SemanticIndexError, match="not a saved semantic index"):
        await other.load(tmp_path / "junk.npz")


# -- fitting --------------------------------------------------------------------------------


def clustered(seed: int = 0) -> tuple[dict[str, list[float]], list[tuple[str, str | None]]]:
    """Three routes as tight clusters on three axes of 8 dimensions; out-of-scope texts
    near the middle, some of them near a route (a near miss)."""
    rng = np.random.default_rng(seed)
    table: dict[str, list[float]] = {}
    examples: list[tuple[str, str | None]] = []
    for r, name in enumerate(["billing", "code", "weather"]):
        for i in range(16):
            v = np.zeros(8)
            v[r] = 1.0
            v += rng.normal(0, 0.15, 8)
            table[f"{name} {i}"] = list(v / np.linalg.norm(v))
            if i >= 4:
                examples.append((f"{name} {i}", name))
    for i in range(30):
        v = rng.normal(0, 1, 8)
        v[3:] += 1.5  # the dimensions no route uses
        table[f"none {i}"] = list(v / np.linalg.norm(v))
        examples.append((f"none {i}", None))
    return table, examples


def fitted_router(
    table: dict[str, list[float]],
) -> tuple[SemanticRoutingChatClient, dict[str, ScriptedChatClient]]:
    class Generator:
        async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
            return np.asarray([table[v] for v in values], dtype=np.float32)

        async def aclose(self) -> None:
            return None

    routes = clients("billing", "code", "weather", "general")
    router = SemanticRoutingChatClient(
        Generator(),
        {
            Route(n, routes[n]): [f"{n} {i}" for i in range(4)]
            for n in ("billing", "code", "weather")
        },
        routes["general"],
        threshold=-1.0,  # accepts everything: fitting must find where to reject
    )
    return router, routes


@pytest.mark.parametrize("head", [False, True])
async def test_fit_sets_thresholds_that_reject_out_of_scope(streaming: bool, head: bool) -> None:
    table, examples = clustered()
    router, _ = fitted_router(table)
    report = await router.fit(examples, validation=0.25, head=head)
    assert report.mode == ("head" if head else "thresholds") and report.applied
    assert (
        report.validation_examples > 0
        and report.fitted_examples + report.validation_examples == len(examples)
    )
    assert report.before.out_of_scope_rejection == 0.0  # threshold -1 accepted everything
    assert report.after.out_of_scope_rejection >= 0.85
    assert report.after.macro_f1 > report.before.macro_f1
    assert set(report.thresholds) == {"billing", "code", "weather"}
    assert (router.head is not None) is head
    assert (await collect(router, "code 1", streaming=streaming)).text == "code"
    outside = [t for t, label in examples if label is None][:6]
    chosen = [(await collect(router, t, streaming=streaming)).text for t in outside]
    assert chosen.count("general") >= 5


async def test_fit_with_apply_false_changes_nothing() -> None:
    table, examples = clustered()
    router, _ = fitted_router(table)
    report = await router.fit(examples, validation=None, apply=False)
    assert not report.applied and router.thresholds == {
        "billing": -1.0,
        "code": -1.0,
        "weather": -1.0,
    }


@pytest.mark.parametrize("head", [False, True])
async def test_fit_on_too_few_examples_says_what_is_needed(head: bool) -> None:
    table, examples = clustered()
    router, _ = fitted_router(table)
    few = [*[e for e in examples if e[1] != "code"][:12], ("code 5", "code")]
    with pytest.raises(ValueError, match="needs at least") as caught:
        await router.fit(few, validation=None, head=head)
    message = str(caught.value)
    assert "'code' has 1" in message and "out of scope (label None) has 0" in message
    with pytest.raises(ValueError, match="no route named 'nope'"):
        await router.fit([("code 5", "nope")])


async def test_a_fitted_head_survives_removal_and_is_dropped_on_add(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table, examples = clustered()
    router, routes = fitted_router(table)
    await router.fit(examples, validation=None, head=True)
    assert router.head is not None
    await router.remove_route("weather")
    assert router.head is not None and router.head.routes == ("billing", "code")
    assert (await router.route("code 2")).route_name == "code"
    with caplog.at_level(logging.WARNING):
        await router.add_route(Route("weather", routes["weather"]), ["weather 0"])
    assert router.head is None and "fitted head was dropped" in caplog.text
    assert "weather 0" not in caplog.text  # route names only, never utterances


async def test_save_and_load_keep_fitted_thresholds_and_head(tmp_path: Path) -> None:
    table, examples = clustered()
    router, _ = fitted_router(table)
    await router.fit(examples, validation=None, head=True)
    path = tmp_path / "fitted.npz"
    table.update({p: list(np.eye(8)[i + 4]) for i, p in enumerate(PROBES)})
    await router.save(path)
    again, _ = fitted_router(table)
    await again.load(path)
    assert again.thresholds == router.thresholds and again.head is not None
    outside = [t for t, label in examples if label is None]
    assert [(await again.route(t)).route_name for t in outside] == [
        (await router.route(t)).route_name for t in outside
    ]


def _rewritten(good: Path, target: Path, change: object) -> Path:
    """`good`'s arrays, changed by `change(arrays, meta)`, saved as `target`."""
    with np.load(good, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    original = arrays["meta"]
    meta = json.loads(bytes(original).decode())
    change(arrays, meta)  # type: ignore[operator]
    if arrays.get("meta") is original:  # the change was to the metadata's contents
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(target, **arrays)
    return target


def _meta(key: str, value: object) -> object:
    def change(arrays: dict[str, np.ndarray], meta: dict[str, object]) -> None:
        meta[key] = value

    return change


def _array(key: str, value: object) -> object:
    def change(arrays: dict[str, np.ndarray], meta: dict[str, object]) -> None:
        arrays[key] = np.asarray(value)

    return change


def _nan_row(arrays: dict[str, np.ndarray], meta: dict[str, object]) -> None:
    arrays["vectors"] = arrays["vectors"].copy()
    arrays["vectors"][0, 0] = np.nan


def _scaled(arrays: dict[str, np.ndarray], meta: dict[str, object]) -> None:
    arrays["vectors"] = arrays["vectors"] * 10.0  # every query would go to one route


def _no_meta(arrays: dict[str, np.ndarray], meta: dict[str, object]) -> None:
    del arrays["meta"]


BAD_FILES = {
    "nan-vector": _nan_row,
    "non-unit-vectors": _scaled,
    "no-metadata": _no_meta,
    "metadata-not-an-object": _array("meta", np.frombuffer(b"[1, 2]", dtype=np.uint8)),
    "metadata-not-json": _array("meta", np.frombuffer(b"\xff\xfe", dtype=np.uint8)),
    "metadata-of-floats": _array("meta", np.zeros(4)),
    "routes-not-a-list": _meta("routes", "billing"),
    "route-without-name": _meta("routes", [{"utterances": ["x1"], "threshold": None}]),
    "utterances-not-strings": _meta(
        "routes", [{"name": "b", "utterances": [1], "threshold": None}]
    ),
    "threshold-not-a-number": _meta(
        "routes", [{"name": "b", "utterances": ["x1"], "threshold": "high"}]
    ),
    "dimensions-as-text": _meta("dimensions", "8"),
    "dimensions-bool": _meta("dimensions", True),
    "fewer-vectors-than-utterances": _array("vectors", np.eye(8, dtype=np.float32)[:1]),
    "vectors-of-text": _array("vectors", np.array([["a"] * 8] * 3)),
    "vectors-one-dimensional": _array("vectors", np.ones(8, dtype=np.float32)),
    "probes-wrong-shape": _array("probes", np.eye(8, dtype=np.float32)[:2]),
    "head-weights-wrong-shape": _array("head_weights", np.zeros((3, 2), dtype=np.float32)),
    "head-bias-nan": _array("head_bias", np.full(4, np.nan, dtype=np.float32)),
    "head-thresholds-missing": lambda arrays, meta: arrays.pop("head_thresholds"),
    "head-not-names": _meta("head", [1, 2, 3]),
}


@pytest.mark.parametrize("how", list(BAD_FILES))
async def test_a_bad_index_file_is_refused_and_the_router_keeps_its_index(
    tmp_path: Path, how: str
) -> None:
    table, examples = clustered()
    table.update({p: list(np.eye(8)[i + 4]) for i, p in enumerate(PROBES)})
    router, _ = fitted_router(table)
    await router.fit(examples, validation=None, head=True)
    good = tmp_path / "good.npz"
    await router.save(good)
    serving, _ = fitted_router(table)
    await serving.load(good)
    before = [(await serving.route(t)).route_name for t, _ in examples]
    head, thresholds = serving.head, serving.thresholds
    bad = _rewritten(good, tmp_path / "bad.npz", BAD_FILES[how])
    with pytest.raises(SemanticIndexError):
        await serving.load(bad)
    # Nothing changed: the same index, head and thresholds route every query as before.
    assert serving.head is head and serving.thresholds == thresholds
    assert [(await serving.route(t)).route_name for t, _ in examples] == before


@pytest.mark.parametrize("what", ["empty", "truncated", "npy", "not-a-zip", "pickled"])
async def test_a_file_that_is_no_index_is_a_semantic_index_error(tmp_path: Path, what: str) -> None:
    router, _ = router_of(TableGenerator())
    good = tmp_path / "good.npz"
    await router.save(good)
    path = tmp_path / "bad.npz"
    if what == "empty":
        path.write_bytes(b"")
    elif what == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif what == "npy":
        np.save(path.with_suffix(".npy"), np.eye(3))
        path = path.with_suffix(".npy")
    elif what == "not-a-zip":
        path.write_bytes(b"PK\x03\x04 but nothing more")
    else:
        np.savez(path, meta=np.array([{"a": 1}], dtype=object))
    other, _ = router_of(TableGenerator())
    with pytest.raises(SemanticIndexError, match="not a saved semantic index"):
        await other.load(path)
    assert not other.is_warm
