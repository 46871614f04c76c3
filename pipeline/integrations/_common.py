"""What the framework adapters share: the pipeline check, tool definitions, the served route.

Nothing here imports a framework.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline import _scope
from pipeline.client import ChatClient, ensure_chat_client
from pipeline.types import ChatMessage, ChatRole, Content

__all__ = [
    "AgentTool",
    "append_message",
    "ServedRoute",
    "check_agent_pipeline",
    "ensure_no_tool_results",
    "ensure_not_tool_results",
    "route_report",
    "served_route",
]

# The chain of a pipeline is short; the bound keeps a cycle of references from looping.
_MAX_CLIENTS = 256


@dataclass(frozen=True, slots=True)
class AgentTool:
    """A tool the agent offers the model and runs itself: a definition only, which the
    providers put on the wire (`name`, `description`, JSON-schema `parameters`) and no layer
    of the pipeline can run."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a tool needs a non-empty name")


def _links(client: object) -> Iterator[object]:
    """The clients `client` calls: a pipeline's chain, a layer's inner client, a router's
    routes."""
    for attribute in ("client", "inner"):
        linked = getattr(client, attribute, None)
        if linked is not None:
            yield linked
    owned = getattr(client, "owned_clients", None)
    if callable(owned):
        yield from owned()


def _tool_runner(chat: object) -> str | None:
    """The description of the first function-invocation layer reachable from `chat`, or
    None. Routers are searched through `owned_clients()`; a custom router that does not
    list its routes is not (`ensure_no_tool_results` guards that case at run time)."""
    from middleware.function_invocation import FunctionInvokingChatClient

    seen: set[int] = set()
    pending: list[object] = [chat]
    while pending and len(seen) < _MAX_CLIENTS:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, FunctionInvokingChatClient):
            return current.describe_layer()
        pending.extend(_links(current))
    return None


def check_agent_pipeline(chat: object, adapter: str) -> ChatClient:
    """`chat` as a `ChatClient` an agent can use, or a clear error.

    The agent runs its own tools. A function-invocation layer in the pipeline would answer
    the agent's tool calls itself (as calls to tools it does not know) and loop, so a
    pipeline that has one is refused here, where the adapter is made.
    """
    client = ensure_chat_client(chat, "chat")
    layer = _tool_runner(client)
    if layer is not None:
        raise ValueError(
            f"{adapter}: the pipeline runs tools itself ({layer}), but the agent runs its own "
            "tools; build the pipeline for the agent without use_function_invocation() (or "
            "[layers] function_invocation = false)"
        )
    return client


def append_message(
    conversation: list[ChatMessage], role: ChatRole, contents: Sequence[Content]
) -> None:
    """Add a message of `role` to `conversation`; a tool result joins the tool message
    before it, so one message carries a turn's results (as the function-invocation layer
    sends them)."""
    if role is ChatRole.TOOL and conversation and conversation[-1].role is ChatRole.TOOL:
        conversation[-1].contents.extend(contents)
        return
    conversation.append(ChatMessage(role, list(contents)))


def ensure_not_tool_results(role: ChatRole | None, adapter: str) -> None:
    """Raise when a response's message (or a streamed update) of `role` carries tool
    results: a layer of the pipeline ran tools (one the construction check could not see,
    behind a custom router)."""
    if role is ChatRole.TOOL:
        raise RuntimeError(
            f"{adapter}: the pipeline answered with tool results, so a layer in it runs "
            "tools; the agent runs its own tools: remove the pipeline's "
            "function-invocation layer"
        )


def ensure_no_tool_results(messages: Sequence[ChatMessage], adapter: str) -> None:
    """`ensure_not_tool_results` for every message of a response."""
    for message in messages:
        ensure_not_tool_results(message.role, adapter)


@dataclass(frozen=True, slots=True)
class ServedRoute:
    """Which route served a request, as the router below told it: the route's name, its
    client's provider and model, how many attempts the request took and whether a route
    after the first served it. Every field is None (and `attempts` 0) when no router is in
    the pipeline."""

    name: str | None = None
    provider_name: str | None = None
    model_id: str | None = None
    attempts: int = 0
    fallback: bool = False

    def as_metadata(self) -> dict[str, Any]:
        """The route's fields for a framework's response metadata (set fields only)."""
        if self.name is None:
            return {}
        return {
            "route": self.name,
            "route_attempts": self.attempts,
            "route_fallback": self.fallback,
        }


def route_report() -> tuple[_scope.RouteReport, Any]:
    """A fresh route report made current: a router below fills it as its attempts end.
    Give the token back with `_scope.exit_report` in the same context."""
    report = _scope.RouteReport()
    return report, _scope.enter_report(report)


def served_route(report: _scope.RouteReport) -> ServedRoute:
    """What `report` says about the route that served (or last failed)."""
    if report.route_name is None:
        return ServedRoute()
    # The router stores the route's client metadata (a `ChatClientMetadata`).
    return ServedRoute(
        name=report.route_name,
        provider_name=getattr(report.metadata, "provider_name", None),
        model_id=getattr(report.metadata, "model_id", None),
        attempts=report.attempts,
        fallback=report.fallback,
    )
