"""Semantic route selection latency after the index is built, and index build time.

For 100, 1,000, 10,000 and 100,000 profile utterances of dimension 384 (random unit
vectors spread over 10 routes), prints the median selection latency of
`SemanticRoutingChatClient` (embedding excluded: a precomputed query vector), the index
build time, and the same selection done by a pure-Python loop in the same run, as a ratio.
(``semantic-router`` is not compared yet: its encoders do not take precomputed vectors
in a way this script could time fairly; see the README.)

    python benchmarks/bench_semantic.py [--sizes 100 1000 10000 100000] [--queries 200]
    python benchmarks/bench_semantic.py --under-load [--sizes 10000] [--concurrency 64]
        [--queries 200]

``--under-load`` pins this process to CPU 0, keeps CPU 1 busy with a spinning process (a
bounded one), and runs `--concurrency` selections at a time: it prints p50/p99 selection
latency of the router and, in the same run, of the same similarities computed by
numpy's ``einsum`` (the router's previous kernel: one thread, numpy's own loop) and by one
BLAS product over the whole matrix (``matrix @ query``: its first kernel, which fans out to
OpenBLAS's threads).

OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE, where the machine sets them, slow numpy's kernels;
unset both for this command alone to see the kernel's own speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import numpy.typing as npt

from middleware.routing import Route, RoutingContext, SemanticRoutingChatClient
from pipeline import ChatMessage, ChatOptions
from pipeline.testing import ScriptedChatClient

DIMENSIONS = 384
ROUTES = 10
Step = Callable[[int, list[float]], Awaitable[None]]


class MatrixGenerator:
    """Returns precomputed vectors: utterance i is row i; a query text 'q<j>' is query j."""

    def __init__(self, matrix: npt.NDArray[np.float32], queries: npt.NDArray[np.float32]) -> None:
        self.matrix = matrix
        self.queries = queries

    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        if len(values) == 1 and values[0].startswith("q"):
            return self.queries[int(values[0][1:])][None, :]
        return self.matrix

    async def aclose(self) -> None:
        return None


def python_select(
    rows: list[list[float]], owners: list[int], query: list[float], routes: int
) -> int:
    """The loop a hand-written router would run: top-1 cosine (rows pre-normalized)."""
    best_score, best_route = -2.0, 0
    for row, owner in zip(rows, owners, strict=True):
        score = sum(a * b for a, b in zip(row, query, strict=True))
        if score > best_score:
            best_score, best_route = score, owner
    return best_route if best_route < routes else 0


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


async def measure(size: int, queries: int, rng: np.random.Generator) -> None:
    router, generator, query_vectors = await _router(size, queries, rng)

    start = time.perf_counter()
    await router.warm()
    build = time.perf_counter() - start

    samples = []
    for j in range(queries):
        context = RoutingContext([ChatMessage.user(f"q{j}")], ChatOptions(), streaming=False)
        start = time.perf_counter()
        await router.select_client(context)
        samples.append(time.perf_counter() - start)
    ours = median_ms(samples)

    rows = generator.matrix.tolist()
    owners = [i for i in range(ROUTES) for _ in range(i, size, ROUTES)]
    loop_queries = min(queries, max(3, 20_000 // size))  # bounded: the loop is slow
    loop_samples = []
    for j in range(loop_queries):
        query = query_vectors[j].tolist()
        start = time.perf_counter()
        python_select(rows, owners, query, ROUTES)
        loop_samples.append(time.perf_counter() - start)
    loop = median_ms(loop_samples)
    print(
        f"{size:>7} x {DIMENSIONS}: select median {ours:8.3f} ms   build {build * 1000:8.2f} ms   "
        f"pure-Python loop {loop:9.3f} ms   speed-up {loop / ours:8.1f}x"
    )


def percentile_ms(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000


def start_spinner() -> subprocess.Popen[bytes]:
    """The busy neighbour: a bounded spin (120 s at most), killed when the measurement ends."""
    spin = "import time\nend = time.time() + 120\nwhile time.time() < end: pass"
    return subprocess.Popen([sys.executable, "-c", spin])


async def measure_under_load(
    size: int, concurrency: int, rounds: int, rng: np.random.Generator
) -> None:
    import os

    router, generator, _ = await _router(size, concurrency * rounds, rng)
    spinner = start_spinner()
    try:
        if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
            os.sched_setaffinity(spinner.pid, {1})
            os.sched_setaffinity(0, {0})
        await router.warm()
        index = router._snapshot.index
        assert index is not None
        matrix = generator.matrix

        async def select(j: int, samples: list[float]) -> None:
            context = RoutingContext([ChatMessage.user(f"q{j}")], ChatOptions(), streaming=False)
            start = time.perf_counter()
            await router.select_client(context)
            samples.append(time.perf_counter() - start)

        def kernel(product: Callable[[npt.NDArray[np.float32]], object]) -> Step:
            async def step(j: int, samples: list[float]) -> None:
                start = time.perf_counter()
                product(generator.queries[j])
                samples.append(time.perf_counter() - start)
                await asyncio.sleep(0)

            return step

        steps: tuple[tuple[str, Step], ...] = (
            ("router (tiled BLAS, one thread)", select),
            ("its scan alone", kernel(index.similarities)),
            ("einsum (previous kernel)", kernel(lambda q: np.einsum("ij,j->i", matrix, q))),
            ("one BLAS product (OpenBLAS threads)", kernel(lambda q: matrix @ q)),
        )
        # Each kernel runs its own rounds, the router's first: the index is 15 MB at
        # 10,000 x 384, and interleaving with another 15 MB kernel would have each evict the
        # other from the cache, which is not the load being measured. The threaded product
        # runs last, as OpenBLAS's threads keep spinning after a product.
        samples: dict[str, list[float]] = {label: [] for label, _ in steps}
        for label, step in steps:
            for r in range(rounds):
                await asyncio.gather(
                    *(step(r * concurrency + c, samples[label]) for c in range(concurrency))
                )
        for label, _ in steps:
            p50, p99 = percentile_ms(samples[label], 0.5), percentile_ms(samples[label], 0.99)
            print(
                f"{size:>7} x {DIMENSIONS}, {concurrency} concurrent, other core busy: {label:<37}"
                f" p50 {p50:7.3f} ms  p99 {p99:7.3f} ms  ({len(samples[label])} selections)"
            )
    finally:
        spinner.kill()
        spinner.wait()


async def _router(
    size: int, queries: int, rng: np.random.Generator
) -> tuple[SemanticRoutingChatClient, MatrixGenerator, npt.NDArray[np.float32]]:
    matrix = rng.standard_normal((size, DIMENSIONS)).astype(np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    query_vectors = rng.standard_normal((queries, DIMENSIONS)).astype(np.float32)
    query_vectors /= np.linalg.norm(query_vectors, axis=1, keepdims=True)
    generator = MatrixGenerator(matrix, query_vectors)
    clients = [ScriptedChatClient(name=f"r{i}") for i in range(ROUTES)]
    profiles = {
        Route(f"r{i}", clients[i]): [f"u{j}" for j in range(i, size, ROUTES)] for i in range(ROUTES)
    }
    router = SemanticRoutingChatClient(
        generator, profiles, ScriptedChatClient(name="default"), threshold=-1.0
    )
    order = [j for i in range(ROUTES) for j in range(i, size, ROUTES)]
    generator.matrix = matrix[order]
    return router, generator, query_vectors


async def main(sizes: list[int], queries: int, under_load: bool, concurrency: int) -> None:
    rng = np.random.default_rng(7)
    for size in sizes:
        if under_load:
            await measure_under_load(size, concurrency, max(1, queries // concurrency), rng)
        else:
            await measure(size, queries, rng)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10_000, 100_000])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--under-load", action="store_true")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(main(args.sizes, args.queries, args.under_load, args.concurrency))
