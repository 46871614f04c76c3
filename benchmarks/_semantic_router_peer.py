"""aurelio's semantic-router on given vectors, for bench_semantic_quality.py.

It runs in an environment of its own (semantic-router pins openai<3, the project's tests
need openai 3): ``python _semantic_router_peer.py INPUT.json OUTPUT.json``. INPUT has the
profiles, the fitting examples, the test texts and a vector for every text; OUTPUT has, for
the router at its defaults and after its own ``fit``, the route chosen for each test text
(null: none), and how long each took. Its defaults (1.x): `IndexedRouter` with top_k 5,
mean aggregation and no threshold (the best route always wins); its fit: `fit()` (Platt
calibration on the labelled utterances) and then ``confidence_threshold = 0.5``, as its
README does.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(source: str, target: str) -> None:
    from semantic_router import IndexedRouter, Route
    from semantic_router.encoders import DenseEncoder

    with open(source) as stream:
        data = json.load(stream)
    vectors: dict[str, list[float]] = data["vectors"]

    class TableEncoder(DenseEncoder):  # type: ignore[misc]
        """The benchmark's vectors, looked up by text: every router sees the same ones."""

        name: str = "table"

        def __call__(self, docs: list[Any]) -> list[list[float]]:
            return [vectors[d] for d in docs]

        async def acall(self, docs: list[Any]) -> list[list[float]]:
            return self(docs)

    def build() -> Any:
        routes = [Route(name=name, utterances=list(u)) for name, u in data["profiles"].items()]
        return IndexedRouter(encoder=TableEncoder(), routes=routes)

    def predict(router: Any) -> tuple[list[str | None], float]:
        started = time.perf_counter()
        chosen = [router(text).name for text in data["test"]]
        return chosen, time.perf_counter() - started

    results: dict[str, Any] = {}
    router = build()
    results["defaults"], results["defaults_seconds"] = predict(router)
    fitting = data["fit"]
    started = time.perf_counter()
    router.fit(X=[t for t, _ in fitting], y=[label for _, label in fitting])
    # Its README's next step after fit(): a probability threshold ("act only when it's more
    # likely right than wrong").
    router.confidence_threshold = 0.5
    results["fit_seconds"] = time.perf_counter() - started
    results["fitted"], results["fitted_seconds"] = predict(router)
    import semantic_router

    results["version"] = getattr(semantic_router, "__version__", "unknown")
    with open(target, "w") as stream:
        json.dump(results, stream)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
