"""Fitting a semantic router from labelled utterances (numpy only): per-route thresholds by
coordinate ascent on macro-F1, and a linear head (multinomial logistic regression over the
embeddings with an out-of-scope class) whose probability thresholds are fitted on
out-of-fold predictions. `RoutingMetrics` is how both are judged (and the benchmark too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "FitReport",
    "LinearHead",
    "RoutingMetrics",
    "fit_thresholds",
    "stratified_split",
    "train_head",
]

_Labels = Sequence[str | None]


@dataclass(frozen=True, slots=True)
class RoutingMetrics:
    """How well a router's choices match labelled utterances.

    `accuracy`: share of utterances given their label (a route, or None for out of scope).
    `in_scope_accuracy`: the same over utterances that belong to a route.
    `out_of_scope_rejection`: share of out-of-scope utterances sent to no route.
    `false_rejection`: share of in-scope utterances sent to no route.
    `macro_f1`: the mean F1 over the labels present (every route and "out of scope").
    """

    examples: int
    accuracy: float
    in_scope_accuracy: float
    out_of_scope_rejection: float
    false_rejection: float
    macro_f1: float

    @classmethod
    def of(cls, expected: _Labels, predicted: _Labels, routes: Sequence[str]) -> RoutingMetrics:
        if len(expected) != len(predicted):
            raise ValueError("expected and predicted labels differ in length")
        position = {name: i for i, name in enumerate(routes)}
        none = len(routes)
        y = np.asarray([none if e is None else position[e] for e in expected], dtype=np.intp)
        p = np.asarray(
            [none if e is None else position.get(e, none + 1) for e in predicted], dtype=np.intp
        )
        return cls._of(y, p, none)

    @classmethod
    def _of(cls, y: npt.NDArray[np.intp], p: npt.NDArray[np.intp], none: int) -> RoutingMetrics:
        n = len(y)
        inside = y != none
        outside = ~inside
        return cls(
            examples=n,
            accuracy=float(np.mean(y == p)) if n else 0.0,
            in_scope_accuracy=float(np.mean(y[inside] == p[inside])) if inside.any() else 0.0,
            out_of_scope_rejection=float(np.mean(p[outside] == none)) if outside.any() else 0.0,
            false_rejection=float(np.mean(p[inside] == none)) if inside.any() else 0.0,
            macro_f1=macro_f1(y, p, none + 2),
        )


def macro_f1(y: npt.NDArray[np.intp], p: npt.NDArray[np.intp], classes: int) -> float:
    """Mean F1 over the classes present in `y`."""
    tp = np.bincount(y[y == p], minlength=classes).astype(np.float64)
    support = np.bincount(y, minlength=classes).astype(np.float64)
    chosen = np.bincount(p, minlength=classes).astype(np.float64)
    present = support > 0
    if not present.any():
        return 0.0
    f1 = 2 * tp[present] / (support[present] + chosen[present])
    return float(np.mean(f1))


@dataclass(frozen=True, slots=True)
class FitReport:
    """What `SemanticRoutingChatClient.fit` did: `mode` (``thresholds`` or ``head``), the
    similarity `thresholds` per route, the head's probability `head_thresholds` (or None),
    the router's metrics on the validation examples `before` and `after` fitting (on the
    fitting examples themselves when there was no validation set), the example counts, and
    whether the result was `applied`."""

    mode: str
    thresholds: dict[str, float]
    head_thresholds: dict[str, float] | None
    before: RoutingMetrics
    after: RoutingMetrics
    fitted_examples: int
    validation_examples: int
    applied: bool


def stratified_split(
    examples: list[tuple[str, str | None]], fraction: float, seed: int
) -> tuple[list[tuple[str, str | None]], list[tuple[str, str | None]]]:
    """Hold out `fraction` of each label's examples (at least one stays in the fitting part)."""
    if fraction <= 0:
        return list(examples), []
    rng = np.random.default_rng(seed)
    by_label: dict[str | None, list[int]] = {}
    for i, (_, label) in enumerate(examples):
        by_label.setdefault(label, []).append(i)
    held: set[int] = set()
    for indices in by_label.values():
        count = min(len(indices) - 1, round(len(indices) * fraction))
        if count > 0:
            held.update(int(i) for i in rng.permutation(indices)[:count])
    fitting = [e for i, e in enumerate(examples) if i not in held]
    validation = [e for i, e in enumerate(examples) if i in held]
    return fitting, validation


def fit_thresholds(
    scores: npt.NDArray[np.float64],
    candidates: npt.NDArray[np.intp],
    labels: _Labels,
    routes: Sequence[str],
    initial: npt.NDArray[np.float64],
    *,
    reach: float,
    rounds: int = 4,
) -> npt.NDArray[np.float64]:
    """Per-route thresholds maximizing macro-F1 of "the best route if its score reaches its
    threshold, else none" over the examples (each with its best route's `scores` and
    position in `candidates`). Coordinate ascent from `initial`: each route's threshold in
    turn takes the middle of the best candidates (midpoints between its examples' scores)."""
    position = {name: i for i, name in enumerate(routes)}
    none = len(routes)
    y = np.asarray([none if label is None else position[label] for label in labels], dtype=np.intp)
    thresholds = np.clip(initial.astype(np.float64, copy=True), -reach, reach)
    finite = np.isfinite(scores)

    def objective(limits: npt.NDArray[np.float64]) -> float:
        accepted = finite & (scores >= limits[candidates])
        p = np.where(accepted, candidates, none)
        return macro_f1(y, p, none + 1)

    best = objective(thresholds)
    for _ in range(rounds):
        changed = False
        for r in range(len(routes)):
            mine = np.unique(scores[(candidates == r) & finite])
            if mine.size == 0:
                continue
            options = np.concatenate(
                [[max(-reach, float(mine[0]) - 1e-3)], (mine[:-1] + mine[1:]) / 2, [reach]]
            )
            values = []
            for option in options:
                trial = thresholds.copy()
                trial[r] = option
                values.append(objective(trial))
            top = max(values)
            if top > best + 1e-12:
                winners = [o for o, v in zip(options, values, strict=True) if v >= top - 1e-12]
                thresholds[r] = float(winners[len(winners) // 2])
                best = top
                changed = True
        if not changed:
            break
    return thresholds


@dataclass(frozen=True, slots=True, eq=False)
class LinearHead:
    """A multinomial logistic regression over unit embeddings: one class per route and a
    last one for "out of scope". A query goes to no route when the out-of-scope class is
    the most likely, or when its best route's probability is below that route's
    `thresholds` entry."""

    routes: tuple[str, ...]
    weights: npt.NDArray[np.float32]  # (d, routes + 1)
    bias: npt.NDArray[np.float32]  # (routes + 1,)
    thresholds: npt.NDArray[np.float64]  # (routes,)

    def probabilities(self, query: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        """Class probabilities (routes, then out of scope) for one unit vector."""
        logits = (query @ self.weights + self.bias).astype(np.float64)
        logits -= logits.max()
        exp = np.exp(logits)
        result: npt.NDArray[np.float64] = exp / exp.sum()
        return result

    def _probabilities_many(self, vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        logits = (vectors @ self.weights + self.bias).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        result: npt.NDArray[np.float64] = exp / exp.sum(axis=1, keepdims=True)
        return result

    def predict(self, vectors: npt.NDArray[np.float32]) -> list[str | None]:
        probabilities = self._probabilities_many(vectors)
        scores, best = _head_scores(probabilities)
        return [
            self.routes[b] if s >= self.thresholds[b] else None
            for s, b in zip(scores, best, strict=True)
        ]

    def without(self, position: int) -> LinearHead:
        """The head without one route (the others' probabilities renormalize)."""
        keep = [i for i in range(len(self.routes) + 1) if i != position]
        return LinearHead(
            self.routes[:position] + self.routes[position + 1 :],
            np.ascontiguousarray(self.weights[:, keep]),
            self.bias[keep],
            np.delete(self.thresholds, position),
        )


def _head_scores(
    probabilities: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.intp]]:
    """Best route and its probability per row; -inf where out of scope is the most likely."""
    routes = probabilities[:, :-1]
    best = np.argmax(routes, axis=1)
    score = routes[np.arange(len(best)), best]
    return np.where(probabilities[:, -1] > score, -np.inf, score), best


def _softmax_regression(
    features: npt.NDArray[np.float32],
    y: npt.NDArray[np.intp],
    classes: int,
    *,
    l2: float,
    iterations: int,
    rate: float,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Class-balanced, L2-regularized softmax regression by full-batch Adam on standardized
    features; the weights returned apply to the raw features (standardization folded in)."""
    x = features.astype(np.float64)
    mean = x.mean(axis=0)
    scale = x.std(axis=0) + 1e-6
    z = (x - mean) / scale
    n, d = z.shape
    counts = np.bincount(y, minlength=classes).astype(np.float64)
    per_class = np.where(counts > 0, n / (classes * np.maximum(counts, 1)), 0.0)
    sample = per_class[y]
    sample /= sample.sum()
    targets = np.zeros((n, classes))
    targets[np.arange(n), y] = 1.0
    w = np.zeros((d, classes))
    b = np.zeros(classes)
    m_w, v_w, m_b, v_b = np.zeros_like(w), np.zeros_like(w), np.zeros_like(b), np.zeros_like(b)
    beta1, beta2 = 0.9, 0.999
    for step in range(1, iterations + 1):
        logits = z @ w + b
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - targets) * sample[:, None]
        grad_w = z.T @ g + l2 * w
        grad_b = g.sum(axis=0)
        m_w = beta1 * m_w + (1 - beta1) * grad_w
        v_w = beta2 * v_w + (1 - beta2) * grad_w**2
        m_b = beta1 * m_b + (1 - beta1) * grad_b
        v_b = beta2 * v_b + (1 - beta2) * grad_b**2
        correction1, correction2 = 1 - beta1**step, 1 - beta2**step
        w -= rate * (m_w / correction1) / (np.sqrt(v_w / correction2) + 1e-8)
        b -= rate * (m_b / correction1) / (np.sqrt(v_b / correction2) + 1e-8)
    raw_w = w / scale[:, None]
    raw_b = b - mean / scale @ w
    return raw_w.astype(np.float32), raw_b.astype(np.float32)


HEAD_L2 = 1e-3
HEAD_ITERATIONS = 300
HEAD_RATE = 0.05
HEAD_FOLDS = 5


def train_head(
    vectors: npt.NDArray[np.float32],
    labels: _Labels,
    routes: Sequence[str],
    *,
    seed: int = 0,
) -> LinearHead:
    """Train the head on unit `vectors` labelled with route names (None: out of scope); its
    per-route probability thresholds are fitted on out-of-fold predictions (`HEAD_FOLDS`
    folds), so they reflect unseen utterances rather than the training set."""
    position = {name: i for i, name in enumerate(routes)}
    none = len(routes)
    y = np.asarray([none if label is None else position[label] for label in labels], dtype=np.intp)
    classes = none + 1
    rng = np.random.default_rng(seed)
    folds = np.empty(len(y), dtype=np.intp)
    for c in range(classes):
        members = rng.permutation(np.flatnonzero(y == c))
        folds[members] = np.arange(len(members)) % HEAD_FOLDS
    out_of_fold = np.zeros((len(y), classes))
    for k in range(HEAD_FOLDS):
        train, test = folds != k, folds == k
        if not test.any():
            continue
        w, b = _softmax_regression(
            vectors[train],
            y[train],
            classes,
            l2=HEAD_L2,
            iterations=HEAD_ITERATIONS,
            rate=HEAD_RATE,
        )
        out_of_fold[test] = LinearHead(tuple(routes), w, b, np.zeros(none))._probabilities_many(
            vectors[test]
        )
    scores, best = _head_scores(out_of_fold)
    thresholds = fit_thresholds(scores, best, labels, routes, np.zeros(none), reach=1.0)
    w, b = _softmax_regression(
        vectors, y, classes, l2=HEAD_L2, iterations=HEAD_ITERATIONS, rate=HEAD_RATE
    )
    return LinearHead(tuple(routes), w, b, thresholds)
