"""What a response cache and the code serving a request tell each other, per request.

The gateway (or any server in front of a pipeline) opens a `CacheReport` for each request
with `enter_cache_report`: its `partition` says whose request it is (the caller's identity,
the model asked for), so a cache beneath keeps every partition's entries apart, and its
`user` names the user the request is for (a cache partitioned by user keeps them apart);
the cache fills in what it did (`result`, `kind`, `age`, `similarity`) for the response
headers. Request-local (a context variable): nothing outlives the request.
"""

from __future__ import annotations

import contextvars

__all__ = ["CacheReport", "current_cache_report", "enter_cache_report", "exit_cache_report"]


class CacheReport:
    """One request's cache story: `partition` (given by the server, or None: whose request
    it is) and `user` (the user the request names, for a cache partitioned by user), then
    what the cache did: `result` (``hit``, ``miss``, ``bypass``, ``refresh``; None when no
    cache ran), `kind` (``exact`` or ``semantic``), `age` (whole seconds since a hit's
    answer was stored) and `similarity` (a semantic hit's score)."""

    __slots__ = ("age", "kind", "partition", "result", "similarity", "user")

    def __init__(self, partition: str | None = None, user: str | None = None) -> None:
        self.partition = partition
        self.user = user
        self.result: str | None = None
        self.kind: str | None = None
        self.age: int | None = None
        self.similarity: float | None = None


_report: contextvars.ContextVar[CacheReport | None] = contextvars.ContextVar(
    "chat_pipeline_cache_report", default=None
)

current_cache_report = _report.get
enter_cache_report = _report.set
exit_cache_report = _report.reset
