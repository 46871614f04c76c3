"""Every span, event, metric and attribute name this project defines, and its tracers and meters.

The project's own names live in its own namespace, ``chat_pipeline.*``: what a router did
(``chat_pipeline.route.*``, per attempt and on the request's span above it), what the cache
did (``chat_pipeline.cache.*``), and what one layer did (retries, breaker changes, the
request's end, the gateway). ``ai.*`` is the Vercel AI SDK's namespace and is never used.
Where a semantic-convention constant exists (``opentelemetry-semantic-conventions``: GenAI,
HTTP, server, url, network, error) the layers use it and never a hand-typed string.

A span attribute and a metric never share a name: ``chat_pipeline.route.attempts`` is the
request span's attempt count, and ``chat_pipeline.route.attempt.count`` the counter of
attempts (``chat_pipeline_route_attempt_count_total`` in Prometheus).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from opentelemetry import metrics, trace
from opentelemetry.metrics import _internal as _metrics_internal
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as _gen_ai
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_HEADER_TEMPLATE
from opentelemetry.semconv.schemas import Schemas

from pipeline._version import __version__

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter, MeterProvider
    from opentelemetry.trace import Tracer, TracerProvider

__all__ = [
    "USAGE_DETAILS",
    "BACKUP_CALLS_METRIC",
    "BREAKER_FROM",
    "BREAKER_NAME",
    "BREAKER_REASON",
    "BREAKER_SCOPE",
    "BREAKER_TO",
    "CACHE_KIND",
    "CACHE_LOOKUPS_METRIC",
    "CACHE_RESULT",
    "CACHE_SAVED_COST_METRIC",
    "CACHE_SCOPE",
    "CACHE_SIMILARITY",
    "CLIENT_DISCONNECTED",
    "COMMITTED_FAILURES_METRIC",
    "COOLDOWNS_METRIC",
    "COST",
    "COST_ESTIMATED",
    "COST_METRIC",
    "GATEWAY_MODEL",
    "GATEWAY_REQUEST_ID",
    "GATEWAY_SCOPE",
    "HEALTH_FAILURE_RATIO_METRIC",
    "HEALTH_IN_FLIGHT_METRIC",
    "HEALTH_LATENCY_METRIC",
    "HEDGES_STARTED_METRIC",
    "HEDGES_WON_METRIC",
    "INVALID_ARGUMENTS",
    "OPENINFERENCE_CHAIN",
    "OPENINFERENCE_SPAN_KIND",
    "PIPELINE_SCOPE",
    "REQUEST_END",
    "RETRY_ATTEMPT",
    "RETRY_DELAY",
    "RETRY_EVENT",
    "ROUTE_ATTEMPT",
    "ROUTE_ATTEMPTS",
    "ROUTE_ATTEMPT_COUNT_METRIC",
    "ROUTE_ATTEMPT_SPAN",
    "ROUTE_DURATION",
    "ROUTE_FALLBACK",
    "ROUTE_HEDGE",
    "ROUTE_NAME",
    "ROUTE_OUTCOME",
    "ROUTE_OUTPUT_COMMITTED",
    "ROUTE_SELECTION",
    "ROUTE_TERMINAL",
    "ROUTE_TIME_TO_FIRST_UPDATE",
    "ROUTING_SCOPE",
    "SCHEMA_URL",
    "SEMANTIC_REASON",
    "SEMANTIC_SCORE",
    "BUDGETS_SCOPE",
    "BUDGET_REFUSALS_METRIC",
    "BUDGET_REASON",
    "BUDGET_SCOPE_NAME",
    "BUDGET_SOFT_LIMIT_METRIC",
    "SPEND_COST_METRIC",
    "SPEND_DROPPED_METRIC",
    "SPEND_KEY",
    "SPEND_MODEL",
    "SPEND_REASON",
    "SPEND_SCOPE",
    "SPEND_SPOOLED_METRIC",
    "SPEND_TEAM",
    "SPEND_UNPRICED_METRIC",
    "SPEND_WRITTEN_METRIC",
    "STATE_CHANGE_EVENT",
    "STATE_CHANGE_METRIC",
    "TIME_TO_FIRST_UPDATE_METRIC",
    "TOOLS_SCOPE",
    "TOOL_TYPE_FUNCTION",
    "meter",
    "tracer",
]

# -- instrumentation scopes -------------------------------------------------------------------

PIPELINE_SCOPE: Final = "chat_pipeline"
"""The telemetry layer's scope (``chat {model}`` spans, GenAI client metrics)."""
ROUTING_SCOPE: Final = "chat_pipeline.routing"
TOOLS_SCOPE: Final = "chat_pipeline.tools"
BREAKER_SCOPE: Final = "chat_pipeline.breaker"
GATEWAY_SCOPE: Final = "chat_pipeline.gateway"
CACHE_SCOPE: Final = "chat_pipeline.cache"
SPEND_SCOPE: Final = "chat_pipeline.spend"
BUDGETS_SCOPE: Final = "chat_pipeline.budgets"

SCHEMA_URL: Final[str] = list(Schemas)[-1].value
"""The newest schema of the installed ``opentelemetry-semantic-conventions``: the version
whose constants every layer uses (the package adds a member per version it generates)."""

# -- routing: one span per attempt, the routing story on the request's span -------------------

ROUTE_ATTEMPT_SPAN: Final = "route_attempt"
"""An attempt's span is ``route_attempt {route}``."""
ROUTE_NAME: Final = "chat_pipeline.route.name"
ROUTE_ATTEMPT: Final = "chat_pipeline.route.attempt"
"""The attempt's number within its request (1 for the first)."""
ROUTE_OUTCOME: Final = "chat_pipeline.route.outcome"
ROUTE_OUTPUT_COMMITTED: Final = "chat_pipeline.route.output_committed"
ROUTE_TIME_TO_FIRST_UPDATE: Final = "chat_pipeline.route.time_to_first_update"
ROUTE_DURATION: Final = "chat_pipeline.route.duration"
ROUTE_TERMINAL: Final = "chat_pipeline.route.terminal"
ROUTE_ATTEMPTS: Final = "chat_pipeline.route.attempts"
"""On the request's span above a router: how many attempts the request took (with
`ROUTE_NAME`, the route of the last one)."""
ROUTE_FALLBACK: Final = "chat_pipeline.route.fallback"
"""On the request's span above a router: whether a route after the first served it."""
ROUTE_SELECTION: Final = "chat_pipeline.route.selection"
"""Why the attempt's route was chosen: ``strategy`` (the balancing strategy's pick),
``preferred`` (the session's route), ``probe`` (a probe of an outlier route), ``failover``
(the next route after a failure) or ``hedge`` (started beside a slow attempt)."""
ROUTE_HEDGE: Final = "chat_pipeline.route.hedge"
"""Whether the attempt was a hedge (started while another attempt of the request ran)."""
SEMANTIC_SCORE: Final = "chat_pipeline.route.semantic.score"
SEMANTIC_REASON: Final = "chat_pipeline.route.semantic.reason"

OPENINFERENCE_SPAN_KIND: Final = "openinference.span.kind"
"""Attempt spans are steps of a chain, not model calls: without this, OpenInference readers
(Arize Phoenix) infer "LLM" from the GenAI attributes and list 1 + N model calls a request."""
OPENINFERENCE_CHAIN: Final = "CHAIN"

ROUTE_ATTEMPT_COUNT_METRIC: Final = "chat_pipeline.route.attempt.count"
"""Counter of attempts by route and outcome (not ``chat_pipeline.route.attempts``: that name is the
request span's attribute)."""
BACKUP_CALLS_METRIC: Final = "chat_pipeline.route.backup_calls"
COMMITTED_FAILURES_METRIC: Final = "chat_pipeline.route.output_committed_failures"
COST_METRIC: Final = "chat_pipeline.route.cost"
"""Counter of what attempts cost, by route (in the price's currency unit): every attempt
priced, a failed one that used tokens included."""
COST: Final = "chat_pipeline.cost"
"""On an attempt's span: what the attempt cost, in its currency unit (the route's `Price`,
else the price book's; absent when unpriced)."""
COST_ESTIMATED: Final = "chat_pipeline.cost.estimated"
"""On an attempt's span: whether the cost rests on estimated token counts (the provider
reported none, or the stream was cut before it did)."""
TIME_TO_FIRST_UPDATE_METRIC: Final = "chat_pipeline.route.time_to_first_update"
HEDGES_STARTED_METRIC: Final = "chat_pipeline.route.hedges.started"
"""Counter of hedged attempts started, by route."""
HEDGES_WON_METRIC: Final = "chat_pipeline.route.hedges.won"
"""Counter of hedged attempts whose answer reached the caller, by route."""
COOLDOWNS_METRIC: Final = "chat_pipeline.route.cooldowns"
"""Counter of cooldowns a route went into (a ``Retry-After`` answer), by route."""
HEALTH_LATENCY_METRIC: Final = "chat_pipeline.route.health.latency"
"""Gauge: a route's latency estimate (s): its peak-EWMA time to first update."""
HEALTH_IN_FLIGHT_METRIC: Final = "chat_pipeline.route.health.in_flight"
"""Gauge: a route's attempts in flight in this process."""
HEALTH_FAILURE_RATIO_METRIC: Final = "chat_pipeline.route.health.failure_ratio"
"""Gauge: a route's decaying failure ratio (0 to 1)."""

# -- the response cache ------------------------------------------------------------------------

CACHE_RESULT: Final = "chat_pipeline.cache.result"
"""On the request's span (and a label of `CACHE_LOOKUPS_METRIC`): what the response cache did:
``hit``, ``miss``, ``bypass`` (the request asked for no cache, or cannot be cached) or
``refresh`` (called the provider and stored the new answer)."""
CACHE_KIND: Final = "chat_pipeline.cache.kind"
"""On the request's span (and a label of `CACHE_LOOKUPS_METRIC`): ``exact`` or ``semantic``
(which lookup hit; for a miss, the last lookup made)."""
CACHE_SIMILARITY: Final = "chat_pipeline.cache.similarity"
"""On the request's span: the cosine similarity of the best semantic candidate, when the
semantic lookup had one."""
CACHE_LOOKUPS_METRIC: Final = "chat_pipeline.cache.lookups"
"""Counter of requests through a response cache, by `CACHE_RESULT` and `CACHE_KIND`."""
CACHE_SAVED_COST_METRIC: Final = "chat_pipeline.cache.saved_cost"
"""Counter of what cache hits saved: the cost the stored answer had when its route had a
`Price`, by the route that served it (``chat_pipeline.route.name``)."""

# -- the spend ledger -------------------------------------------------------------------------

SPEND_COST_METRIC: Final = "chat_pipeline.spend.cost"
"""Counter of what the recorded attempts cost, by route, model (`gen_ai.response.model`),
key name (`SPEND_KEY`) and team (`SPEND_TEAM`), in the currency unit."""
SPEND_UNPRICED_METRIC: Final = "chat_pipeline.spend.unpriced"
"""Counter of recorded attempts no price was found for, by route and model."""
SPEND_WRITTEN_METRIC: Final = "chat_pipeline.spend.written"
"""Counter of records the ledger wrote to its database."""
SPEND_SPOOLED_METRIC: Final = "chat_pipeline.spend.spooled"
"""Counter of records the ledger put in its spool while its database was unavailable."""
SPEND_DROPPED_METRIC: Final = "chat_pipeline.spend.dropped"
"""Counter of records the ledger dropped, by `SPEND_REASON` (``queue_full``,
``spool_full``): its bounds were reached."""
SPEND_KEY: Final = "chat_pipeline.spend.key"
"""On the spend metrics: the caller's key's name (never the secret)."""
SPEND_TEAM: Final = "chat_pipeline.spend.team"
SPEND_MODEL: Final = "chat_pipeline.spend.model"
"""On the spend metrics: the model that served (or was asked for, when none answered)."""
SPEND_REASON: Final = "chat_pipeline.spend.reason"

# -- budgets and rate limits ------------------------------------------------------------------

BUDGET_REFUSALS_METRIC: Final = "chat_pipeline.budget.refusals"
"""Counter of requests refused by `BUDGET_REASON` (``budget_exceeded``,
``rate_limit_exceeded``, ``unavailable``) and `BUDGET_SCOPE_NAME` (``key``, ``team``,
``user``)."""
BUDGET_SOFT_LIMIT_METRIC: Final = "chat_pipeline.budget.soft_limit_passed"
"""Counter of requests admitted past a soft budget limit, by `BUDGET_SCOPE_NAME`."""
BUDGET_REASON: Final = "chat_pipeline.budget.reason"
BUDGET_SCOPE_NAME: Final = "chat_pipeline.budget.scope"
"""Whose budget or limit: ``key``, ``team`` or ``user`` (never a key's name: bounded
cardinality)."""

# -- layers -----------------------------------------------------------------------------------

REQUEST_END: Final = "chat_pipeline.request.end"
"""On a request's span: ``canceled`` or ``abandoned`` when the caller ended it early."""

RETRY_EVENT: Final = "chat_pipeline.retry"
RETRY_ATTEMPT: Final = "chat_pipeline.retry.attempt"
"""On a retry event: the number of the attempt about to start."""
RETRY_DELAY: Final = "chat_pipeline.retry.delay"
"""On a retry event: seconds waited before it."""

STATE_CHANGE_EVENT: Final = "chat_pipeline.circuit_breaker.state_change"
STATE_CHANGE_METRIC: Final = "chat_pipeline.circuit_breaker.state_changes"
BREAKER_NAME: Final = "chat_pipeline.circuit_breaker.name"
BREAKER_FROM: Final = "chat_pipeline.circuit_breaker.from"
BREAKER_TO: Final = "chat_pipeline.circuit_breaker.to"
BREAKER_REASON: Final = "chat_pipeline.circuit_breaker.reason"
"""On a state-change event to ``open`` that this process decided: why (``fail_max``,
``failure_ratio``, ``slow_call_ratio``, ``probe``). Not on the metric."""

TOOL_TYPE_FUNCTION: Final = "function"
"""``gen_ai.tool.type`` of a tool that runs in this process (the conventions list the value
but define no constant for it)."""
INVALID_ARGUMENTS: Final = "invalid_arguments"
"""``error.type`` of a tool call whose arguments do not fit the tool."""

GATEWAY_MODEL: Final = "chat_pipeline.gateway.model"
"""On the gateway's span: the model name the client asked for (one `/v1/models` lists)."""
# The parts of a response's token counts the GenAI conventions name: reasoning (of the
# output), read from and written to a prompt cache (of the input). On the chat span they
# are the conventions' attributes; on ``gen_ai.client.token.usage`` they are data points of
# their own, whose ``gen_ai.token.type`` is the second name (the conventions define only
# ``input`` and ``output``, which keep counting every token: these are parts of them, never
# to be added to them).
USAGE_DETAILS: Final = (
    ("reasoning_tokens", _gen_ai.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS, "reasoning"),
    ("cache_read_tokens", _gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, "cache_read"),
    ("cache_write_tokens", _gen_ai.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, "cache_creation"),
)
"""(`UsageDetails` field, span attribute, token type on the usage metric)."""
CLIENT_DISCONNECTED: Final = "chat_pipeline.gateway.client_disconnected"
"""On the gateway's span: the client went away before its answer was complete (the request
was cancelled)."""
GATEWAY_REQUEST_ID: Final = f"{HTTP_RESPONSE_HEADER_TEMPLATE}.x-request-id"
"""On the gateway's span: the request id the response carries (the caller's, or a fresh
one), as the HTTP conventions name a response header."""


# -- tracers and meters -----------------------------------------------------------------------


def tracer(scope: str, provider: TracerProvider | None = None) -> Tracer:
    """The tracer of `scope` (the global provider unless one is given), with the library's
    version and `SCHEMA_URL`."""
    return trace.get_tracer(scope, __version__, provider, schema_url=SCHEMA_URL)


def meter(scope: str, provider: MeterProvider | None = None) -> Meter:
    """The meter of `scope` (the global provider unless one is given), with the library's
    version and `SCHEMA_URL`."""
    return metrics.get_meter(scope, __version__, provider, schema_url=SCHEMA_URL)


def global_tracer_provider_set() -> bool:
    """Whether a global tracer provider is set (until then the global tracer's spans
    record nothing and carry no context of their own).

    The API keeps it in a module variable, None until set: `trace.get_tracer_provider()`,
    the public way to ask, reads the environment at every call, dearer than the span it
    would spare. Should a release rename the variable, this says True (spans are made as
    before, only slower). A provider the environment names
    (``OTEL_PYTHON_TRACER_PROVIDER``) is set at the first `get_tracer_provider()`: whoever
    asks this per request calls that once first."""
    return getattr(trace, "_TRACER_PROVIDER", True) is not None


def global_meter_provider_set() -> bool:
    """Whether a global meter provider is set (until then the global meter's instruments
    record nothing); as `global_tracer_provider_set`."""
    return getattr(_metrics_internal, "_METER_PROVIDER", True) is not None
