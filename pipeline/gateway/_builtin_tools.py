"""What the gateway does with a provider's built-in (server-side) tools: the Responses API's
``web_search``, ``file_search``, ``code_interpreter``..., Anthropic's server tools
(``web_search_20250305``, ``code_execution_...``). The routes behind the gateway run no
tools: a built-in tool is something only that provider's own servers can run.

``[gateway] builtin_tools`` chooses, for every inbound format alike:

* ``"drop"`` (the default): the request is served without those tools, as if the client
  had not offered them. A coding agent offers web search by default and works without it
  (the model answers from what it has, or uses the agent's own tools);
* ``"refuse"``: a 400 naming the first such tool, for a deployment that would rather a
  client learn at once that web search is not available.

Either way the choice is said in the ``x-chat-pipeline-builtin-tools`` response header
(``dropped=web_search`` or ``refused=web_search``: the tool types, never their settings)
and on the request's log line (``builtin_tools=...``).

An inbound format lists the built-in tools of a request in `ChatRequest.builtin_tools`
(their types, in the order sent) and leaves them out of the pipeline's tools; the body
layer applies the policy (`apply`) once the request is parsed.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import quote

from pipeline.gateway.wire import ChatRequest, WireError

__all__ = ["BUILTIN_TOOLS_HEADER", "BuiltinToolPolicy", "apply", "header_value"]

BuiltinToolPolicy = Literal["drop", "refuse"]
"""``[gateway] builtin_tools``: what happens to built-in tools no route can run."""

BUILTIN_TOOLS_HEADER = b"x-chat-pipeline-builtin-tools"
"""The response header that says what was done with a request's built-in tools."""


def header_value(request: ChatRequest, policy: BuiltinToolPolicy) -> str | None:
    """``dropped=web_search,...`` or ``refused=...`` for a request that offered built-in
    tools; None for one that offered none."""
    if not request.builtin_tools:
        return None
    verb = "refused" if policy == "refuse" else "dropped"
    # The types are what the client wrote (the formats take only tokens): percent-encoded
    # all the same, so a header value never carries a line break or a byte beyond ASCII.
    kinds = (quote(kind, safe="_.-") for kind in dict.fromkeys(request.builtin_tools))
    return verb + "=" + ",".join(kinds)


def apply(request: ChatRequest, policy: BuiltinToolPolicy, param: str = "tools") -> None:
    """Apply the policy to a parsed request: nothing to do for ``drop`` (the format left
    the tools out), a `WireError` (400) for ``refuse`` when the request offered any."""
    if policy == "refuse" and request.builtin_tools:
        kind = quote(request.builtin_tools[0], safe="_.-")
        raise WireError(
            400,
            f"{param}: the built-in tool {kind!r} cannot run behind this gateway "
            "(its routes run no provider-side tools); leave it out",
            param=param,
            code="unsupported_tool",
        )
