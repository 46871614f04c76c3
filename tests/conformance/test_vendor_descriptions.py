"""The vendors' published API descriptions as the gateway's judge.

Requests are drawn from OpenAI's and Anthropic's own descriptions (the cuts in
``descriptions/``, see `tests.conformance.descriptions`), most as published and some
broken on purpose (a value of another type, a field dropped or added, an enum's value the
description does not list), and sent over HTTP to ``chat-pipeline serve`` in front of the
project's fakes, whose answers are drawn too (text, tool calls, reasoning, stop reasons,
usage). Each exchange is judged by `tests.conformance.harness.Rig.exchange`: no 5xx; 200
bodies and every streamed event valid for the vendor's response schema; 4xx statuses the
gateway documents, in the vendor's error shape; one whole log line per request. A request
valid for the description that the gateway refuses naming a field (it serves a documented
subset) is sent again without that field, so most draws end in an answer to judge.

Only HTTP is used: the suite is the safety net of moving the formats' code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.testing import FakeResponse
from tests.conformance.descriptions import (
    Description,
    Json,
    Served,
    nullable_as_null,
    untyped_as_untyped,
)
from tests.conformance.harness import MODELS, Api, Rig

pytestmark = [pytest.mark.gateway, pytest.mark.conformance]


def _openai_allowances(schemas: dict[str, Any]) -> None:
    """Where OpenAI's description is stricter than OpenAI's own API (see each). Its 3.0
    keyword ``nullable`` in a 3.1 document (which would make a stream chunk's
    ``finish_reason: null`` fail) is read as meant for requests and answers alike:
    `nullable_as_null`, below."""
    # OpenAI's streams send the response with ``usage: null`` in ``response.created`` and
    # ``response.in_progress`` (nothing is counted yet); the description's ``Response``
    # declares usage an object.
    for part in schemas["Response"]["allOf"]:
        usage = part.get("properties", {}).get("usage")
        if usage is not None:
            part["properties"]["usage"] = {"anyOf": [usage, {"type": "null"}]}


def _anthropic_allowances(schemas: dict[str, Any]) -> None:
    """Where Anthropic's description is stricter than Anthropic's own API (see each)."""
    # Anthropic's streams send ``ping`` events (its streaming documentation says so, and
    # the SDKs skip them); the description's event union has no member for them.
    schemas["PingEvent"] = {
        "type": "object",
        "properties": {"type": {"const": "ping"}},
        "required": ["type"],
    }
    schemas["MessageStreamEvent"]["oneOf"].append({"$ref": "#/components/schemas/PingEvent"})


def _repairs(schemas: dict[str, Any]) -> None:
    nullable_as_null(schemas)
    untyped_as_untyped(schemas)


OPENAI = Description("openai", _repairs, _openai_allowances)
ANTHROPIC = Description("anthropic", _repairs, _anthropic_allowances)

CHAT = Api(
    "chat",
    "/v1/chat/completions",
    OPENAI,
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
)
RESPONSES = Api(
    "responses", "/v1/responses", OPENAI, "CreateResponse", "Response", "ResponseStreamEvent"
)
MESSAGES = Api(
    "messages", "/v1/messages", ANTHROPIC, "CreateMessageParams", "Message", "MessageStreamEvent"
)
LIST_MODELS = Api("models", "/v1/models", OPENAI, None, "ListModelsResponse", None, logged=False)
ONE_MODEL = Api("model", "/v1/models", OPENAI, None, "Model", None, logged=False)

# A valid request refused for a field the gateway does not serve is sent again without it,
# at most this many times.
_RESENDS = 20
# A field named by a refusal: a path such as ``input[2].content[0].type``.
_PARAM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)*)[:]? ")
_REQUIRED = frozenset({"model", "messages", "input", "max_tokens"})


# -- what is drawn --------------------------------------------------------------------------------


def model_names() -> st.SearchStrategy[str]:
    """Mostly names the gateway serves; sometimes any string (a 404)."""
    # Any string, control characters (a newline) included: none may break the log line.
    anything = st.text(min_size=1, max_size=24)
    # One draw in ten is any string (a 404); the others a name the gateway serves.
    served = st.sampled_from(MODELS)
    return st.sampled_from([served] * 9 + [anything]).flatmap(lambda names: names)


_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,15}", fullmatch=True)
_ARGUMENTS = st.dictionaries(
    st.text(min_size=1, max_size=6), st.integers() | st.text(max_size=8), max_size=3
).map(json.dumps)
_STOP_REASONS = {
    "gpt": ["stop", "length", "content_filter", "tool_calls"],
    "responses": ["max_output_tokens", "content_filter"],
    "claude": ["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal", "pause_turn"],
}


def upstream_answers(route: str) -> st.SearchStrategy[FakeResponse]:
    """What the fake upstream of `route` answers: text, tool calls, custom tool calls,
    reasoning or thinking, a stop reason of its API, usage and cache usage."""
    custom = st.lists(st.tuples(_NAMES, st.text(max_size=12)), max_size=1)
    return st.builds(
        FakeResponse,
        text=st.text(max_size=40),
        tool_calls=st.lists(st.tuples(_NAMES, _ARGUMENTS), max_size=2),
        custom_tool_calls=custom if route != "claude" else st.just(()),
        stop_reason=st.none() | st.sampled_from(_STOP_REASONS[route]),
        usage=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)),
        cache_usage=st.tuples(st.integers(0, 1000), st.integers(0, 1000)),
        reasoning_tokens=st.integers(0, 100),
        reasoning=st.none() | st.text(max_size=20),
        thinking=st.text(max_size=20),
    )


@dataclass(frozen=True)
class Case:
    body: Json
    route: str
    answer: FakeResponse
    made_up: frozenset[str]
    """Values the case made up for open enums (an echo of one is the case's own)."""


@st.composite
def _broken(draw: st.DrawFn, body: dict[str, Any]) -> tuple[Json, frozenset[str]]:
    """`body` with one thing broken: a value of another type, a field dropped or added, or
    a string replaced by one no enum lists (an open enum's unknown value)."""
    paths = list(_paths(body))
    where = draw(st.sampled_from(paths))
    how = draw(st.sampled_from(["retype", "drop", "add", "unknown"]))
    made_up: set[str] = set()
    broken = json.loads(json.dumps(body))
    parent, key = _locate(broken, where)
    if how == "add" and isinstance(parent[key], dict):
        parent[key]["x_" + draw(_NAMES)] = draw(st.integers() | st.text(max_size=4))
    elif how == "drop" and isinstance(parent, dict):
        del parent[key]
    elif how == "unknown" and isinstance(parent[key], str):
        value = "zz-" + draw(st.from_regex(r"[a-z0-9]{4,8}", fullmatch=True))
        parent[key] = value
        made_up.add(value)
    else:
        current = parent[key]
        others = [v for v in (None, True, 7, -1.5, "x", [], {}) if type(v) is not type(current)]
        parent[key] = draw(st.sampled_from(others))
    return broken, frozenset(made_up)


def _paths(value: Json, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path] if path else []
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _paths(inner, (*path, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += _paths(inner, (*path, index))
    return found[:200]


def _locate(root: Json, path: tuple[Any, ...]) -> tuple[Any, Any]:
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    return parent, path[-1]


# Fields a description leaves optional that every request to the gateway needs: drawn
# always (a request without one is a draw spent on one 400).
_NEEDED = {"responses": ["input"]}
# What the gateway documents it refuses (docs/gateway/formats.md): half the draws leave it
# out, so that most of them are answered, and judged; the other half draw everything.
_REFUSED = {
    "chat": Served(
        fields=frozenset(
            {
                "audio",
                "modalities",
                "prediction",
                "web_search_options",
                "functions",
                "function_call",
                "logprobs",
                "top_logprobs",
                "n",
                "moderation",
                "prompt_cache_options",
                "prompt_cache_retention",
            }
        ),
        types=frozenset({"input_audio", "file", "custom"}),
        roles=frozenset({"function"}),
    ),
    "responses": Served(
        fields=frozenset(
            {
                "previous_response_id",
                "conversation",
                "background",
                "prompt",
                "max_tool_calls",
                "include",
                "truncation",
                "top_logprobs",
                "store",
                "context_management",
                "moderation",
                "prompt_cache_options",
            }
        ),
        types=frozenset(
            {
                "item_reference",
                "input_file",
                "allowed_tools",
                "apply_patch_call",
                "apply_patch_call_output",
                "code_interpreter_call",
                "compaction",
                "computer_call",
                "computer_call_output",
                "file_search_call",
                "image_generation_call",
                "local_shell_call",
                "local_shell_call_output",
                "mcp_approval_request",
                "mcp_approval_response",
                "mcp_call",
                "mcp_list_tools",
                "shell_call",
                "shell_call_output",
                "tool_search_call",
                "tool_search_output",
                "program",
                "program_output",
            }
        ),
    ),
    "messages": Served(types=frozenset({"image", "document"})),
}


def cases(api: Api, stream: bool) -> st.SearchStrategy[Case]:
    assert api.request is not None
    needed = _NEEDED.get(api.name, [])
    bodies = api.description.bodies(api.request, needed) | api.description.bodies(
        api.request, needed, _REFUSED.get(api.name)
    )

    @st.composite
    def draw_case(draw: st.DrawFn) -> Case:
        body = draw(bodies)
        model = draw(model_names())
        body = {**body, "model": model, "stream": stream}
        made_up: frozenset[str] = frozenset()
        if draw(st.integers(0, 5)) == 0:  # a fifth to a third of the draws (0 is favoured)
            body, made_up = draw(_broken(body))
        route = model if model in ("gpt", "responses", "claude") else "gpt"
        return Case(body, route, draw(upstream_answers(route)), made_up)

    return draw_case()


# -- sending again without a refused field ---------------------------------------------------------


def refused_field(body: Json) -> str | None:
    """The field a 400 names: OpenAI's ``param``, else its message's first word (the
    gateway's messages start with the field, in every format)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None
    if isinstance(error.get("param"), str):
        return str(error["param"])
    match = _PARAM.match(str(error.get("message", "")))
    return match.group(1) if match else None


def without(body: Json, field: str) -> Json | None:
    """`body` without what `field` names: the innermost list item on its path, else its
    top-level field; None when that is a field every request needs, or not there."""
    steps: list[Any] = []
    for name, index in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]", field):
        steps.append(name if name else int(index))
    if not steps or (steps[0] in _REQUIRED and len(steps) == 1):
        return None
    cut = max((i for i, step in enumerate(steps) if isinstance(step, int)), default=0)
    target = steps[: cut + 1]
    copy = json.loads(json.dumps(body))
    parent = copy
    try:
        for step in target[:-1]:
            parent = parent[step]
        del parent[target[-1]]
    except (KeyError, IndexError, TypeError):
        return None
    return copy


def judged(rig: Rig, api: Api, case: Case, stream: bool) -> None:
    """Send the case (again without each field the gateway refuses, while the request is
    valid for the description) and fail with every problem found."""
    body = case.body
    problems: list[str] = []
    for _ in range(_RESENDS + 1):
        rig.upstreams.answer(case.route, case.answer)
        invalid = api.description.violated_by(api.request or "", body)
        outcome = rig.exchange(api, body, stream=stream, invalid=invalid, echoed=case.made_up)
        problems += outcome.problems
        if outcome.status != 400 or invalid or problems:
            break
        field = refused_field(outcome.body)
        following = without(body, field) if field is not None else None
        if following is None:
            break
        body = following
    assert not problems, "\n".join(problems)


def _property(rig: Rig, budget: Callable[[Any], Any], api: Api, stream: bool) -> None:
    @budget
    @given(case=cases(api, stream))
    def run(case: Case) -> None:
        judged(rig, api, case, stream)

    run()


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions_as_openai_describes_them(
    rig: Rig, budget: Callable[[Any], Any], stream: bool
) -> None:
    _property(rig, budget, CHAT, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_as_openai_describes_them(
    rig: Rig, budget: Callable[[Any], Any], stream: bool
) -> None:
    _property(rig, budget, RESPONSES, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_as_anthropic_describes_them(
    rig: Rig, budget: Callable[[Any], Any], stream: bool
) -> None:
    _property(rig, budget, MESSAGES, stream)


def test_models_as_openai_describes_them(rig: Rig, budget: Callable[[Any], Any]) -> None:
    @budget
    @given(model=model_names())
    def run(model: str) -> None:
        problems = rig.exchange(LIST_MODELS, None).problems
        # Dots escaped too: a client would read "/v1/models/." as "/v1/models/".
        escaped = quote(model, safe="").replace(".", "%2E")
        problems += rig.exchange(ONE_MODEL, None, path=f"/v1/models/{escaped}").problems
        assert not problems, "\n".join(problems)

    run()
    assert rig.unread_log_lines() == []  # the models endpoints log no line


@pytest.mark.parametrize("api", [CHAT, RESPONSES, MESSAGES], ids=lambda api: api.name)
def test_a_model_name_forges_no_log_line(rig: Rig, api: Api) -> None:
    base: dict[str, Any] = {
        "chat": {"messages": [{"role": "user", "content": "hi"}]},
        "responses": {"input": "hi"},
        "messages": {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    }[api.name]
    forged = (
        "gpt\nINFO:     POST /v1/chat/completions 200 1.0 ms request_id=req_forged "
        "response_id=- model=x route=- attempts=- fallback=- served_model=- key=-: ok"
    )
    problems = []
    for model in (forged, "gpt\r\nWARNING: forged", "gpt\rforged", "\x1b[2Kgpt"):
        for stream in (False, True):
            body = {**base, "model": model, "stream": stream}
            outcome = rig.exchange(api, body, stream=stream, counted=False)
            problems += outcome.problems
            problems += [f"a line no request accounts for: {line!r}" for line in rig.resync()]
    assert not problems, "\n".join(problems)
