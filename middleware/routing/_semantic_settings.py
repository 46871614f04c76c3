"""`SemanticSettings`, apart from the semantic router: it needs no numpy, so a configuration
loader validates a semantic router's settings without loading numpy (nor a configuration
without one)."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import Field, model_validator

from pipeline._settings import Settings

__all__ = ["Aggregation", "SemanticSettings"]

Aggregation = Literal["mean", "sum", "max"]


class SemanticSettings(Settings):
    """How a semantic router scores: `threshold` (below it the default route is chosen),
    `top_k` utterances aggregated per route by `aggregation`, the query embedding's time
    limit and what an embedding failure does (``default`` or ``raise``)."""

    threshold: float = 0.3
    """The score below which the default route is chosen (it must be reachable by `aggregation` of
    cosine scores)."""
    top_k: Annotated[int, Field(ge=1)] = 1
    """Utterances with the best scores, over all routes, that are aggregated per route."""
    aggregation: Aggregation = "mean"
    """How a route's scores among the top k become one: `mean`, `sum` or `max`."""
    embedding_timeout: Annotated[float, Field(gt=0)] | None = 10.0
    """Seconds the query's embedding may take before the default route is chosen (or the error
    raised; unset: no limit)."""
    on_embedding_error: Literal["default", "raise"] = "default"
    """What an embedding that fails, times out or comes back zero does: `default` (choose the
    default route) or `raise`."""

    @model_validator(mode="after")
    def _reachable(self) -> Self:
        reach = float(self.top_k) if self.aggregation == "sum" else 1.0
        if not -reach <= self.threshold <= reach:
            raise ValueError(
                f"threshold {self.threshold} cannot be reached: {self.aggregation} of cosine "
                f"scores lies in [{-reach:g}, {reach:g}]"
            )
        return self
