"""The conformance suite's rig: the project's fake upstreams, ``chat-pipeline serve`` in
front of them, a client over real HTTP, and the judge of each exchange.

The fakes (`FakeOpenAIServer`: Chat Completions and Responses; `FakeAnthropicServer`) run on
an event loop in a thread of their own, so the property tests drive the gateway from plain
synchronous code; what they answer is set per request (`Upstreams.answer`). The gateway is
a real process (only its HTTP and its log are seen, as a client and an operator see them),
routing each model name to one route: ``gpt`` (Chat Completions), ``responses`` (OpenAI
Responses), ``claude`` (Anthropic Messages) and ``pipeline`` (an ordered router over them).

`Rig.exchange` sends one request and judges it: no 5xx; a 200's body, or each streamed
event, valid for the vendor's response schema; a 4xx a status the gateway documents, in the
vendor's error shape; and exactly one log line for it, whole (a line the request's own
values could break or forge is found). Everything is counted (`Tally`) for the summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse
from tests.conformance.descriptions import Description, Json, dumps
from tests.processes import UVICORN_PORT, ChildProcess, StartError, serve_argv

T = TypeVar("T")

ROUTES = ("gpt", "responses", "claude")
MODELS = (*ROUTES, "pipeline")
"""The model names the gateway serves: a route each, and the router over them."""

# The statuses the gateway documents for what a client sends (docs/gateway/formats.md,
# operations.md): a refused request, a key, an unknown model, a method, a slow or large
# body, a content type, the per-key limit, a head too large.
DOCUMENTED_4XX = frozenset({400, 401, 404, 405, 408, 413, 415, 429, 431})

# One request's log line, whole: the gateway's fields in order, ending with the outcome.
LOG_LINE = re.compile(
    r"(INFO|WARNING): +(GET|POST) (/v1/\S+) (\d{3}|-) \d+\.\d ms request_id=(\S+) "
    r"response_id=\S+ model=.* route=\S+ attempts=\S+ fallback=\S+ served_model=.* "
    r"key=\S+( builtin_tools=\S+)?: \S.*\n?"
)
_STARTED = "Application startup complete"
# How many lines may stand between a request's line and where it was expected.
_LOOK_AHEAD = 200


@dataclass(frozen=True)
class Api:
    """An endpoint and its vendor's schemas (component names in `description`)."""

    name: str
    path: str
    description: Description
    request: str | None
    response: str
    event: str | None
    error: str = "ErrorResponse"
    logged: bool = True
    """Whether the gateway logs a line per request (the format endpoints do; the plain
    ones, ``/v1/models``, do not)."""


@dataclass
class Tally:
    """What the suite sent and found, per endpoint and stream flag."""

    statuses: Counter[tuple[str, bool, int]] = field(default_factory=Counter)
    schema_invalid_requests: Counter[tuple[str, bool]] = field(default_factory=Counter)
    server_errors: int = 0
    schema_failures: int = 0
    log_failures: int = 0
    events: int = 0

    def requests(self) -> int:
        return sum(self.statuses.values())

    def lines(self) -> list[str]:
        per: Counter[tuple[str, bool]] = Counter()
        by_status: dict[tuple[str, bool], Counter[int]] = {}
        for (path, stream, status), count in self.statuses.items():
            per[(path, stream)] += count
            by_status.setdefault((path, stream), Counter())[status] += count
        out = []
        for (path, stream), count in sorted(per.items()):
            statuses = ", ".join(f"{s}: {n}" for s, n in sorted(by_status[(path, stream)].items()))
            invalid = self.schema_invalid_requests[(path, stream)]
            out.append(
                f"  {path} stream={str(stream).lower()}: {count} requests "
                f"({invalid} schema-violating; statuses {statuses})"
            )
        out.append(
            f"  total {self.requests()} requests, {self.events} streamed events: "
            f"{self.server_errors} 5xx, {self.schema_failures} schema failures, "
            f"{self.log_failures} missing, extra or broken log lines"
        )
        return out


class Upstreams:
    """The fake upstreams, on an event loop in a thread of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="conformance upstreams", daemon=True
        )
        self._thread.start()
        self.openai = FakeOpenAIServer()
        self.anthropic = FakeAnthropicServer()
        self.run(self.openai.__aenter__())
        self.run(self.anthropic.__aenter__())

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def answer(self, route: str, response: FakeResponse) -> None:
        """What the upstream of `route` answers next (and until told otherwise)."""
        server = self.anthropic if route == "claude" else self.openai
        server.default = response
        # The fakes record every request; the suite reads none of them.
        self.openai.requests.clear()
        self.anthropic.requests.clear()

    def close(self) -> None:
        self.run(self.openai.__aexit__(None, None, None))
        self.run(self.anthropic.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


def gateway_config(path: Path, upstreams: Upstreams) -> Path:
    openai, anthropic = upstreams.openai.base_url, upstreams.anthropic.base_url
    path.write_text(
        f"""
[routes.gpt]
provider = "openai"
model = "upstream-gpt"
base_url = "{openai}"

[routes.responses]
provider = "openai_responses"
model = "upstream-responses"
base_url = "{openai}"

[routes.claude]
provider = "anthropic"
model = "upstream-claude"
base_url = "{anthropic}"
api_key_env = "CONFORMANCE_UPSTREAM_KEY"

[router]
kind = "ordered"
order = ["gpt", "responses", "claude"]
"""
    )
    return path


@dataclass
class Outcome:
    status: int
    body: Json
    events: list[tuple[str | None, Json]]
    problems: list[str]
    request_id: str | None


class Rig:
    """The gateway in front of the fakes, a client, and the judge (see the module)."""

    def __init__(self, workdir: Path, tally: Tally) -> None:
        self.tally = tally
        self.upstreams = Upstreams()
        config = gateway_config(workdir / "gateway.toml", self.upstreams)
        env = {**os.environ, "CONFORMANCE_UPSTREAM_KEY": "upstream-key"}
        argv = serve_argv(config, "--log-level", "info")
        self.gateway = ChildProcess("chat-pipeline serve", argv, env=env, own_group=True)
        try:
            self.gateway.wait_for_line(_STARTED, timeout=120)
            port = self.gateway.wait_for_port(UVICORN_PORT, timeout=5)
        except StartError:
            self.close()
            raise
        self._cursor = next(i for i, line in enumerate(self.gateway.lines) if _STARTED in line) + 1
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        self.gateway.stop()
        self.upstreams.close()

    # -- one exchange ---------------------------------------------------------------------------

    def exchange(
        self,
        api: Api,
        body: Json | None,
        *,
        stream: bool = False,
        path: str | None = None,
        invalid: bool = False,
        echoed: frozenset[str] = frozenset(),
        counted: bool = True,
    ) -> Outcome:
        """Send `body` (GET without one) and judge the answer. `invalid`: the body violates
        the request schema (counted so). `echoed`: values the request itself made up (an
        open enum's unknown value): a 200 that echoes one back is not the gateway's flaw.
        `counted`: whether the exchange counts in the tally (an expected failure's does
        not)."""
        if not counted:
            kept, self.tally = self.tally, Tally()
            try:
                return self.exchange(api, body, stream=stream, path=path, invalid=invalid)
            finally:
                self.tally = kept
        path = path or api.path
        if body is None:
            response = self.client.get(path)
        else:
            response = self.client.post(path, content=json.dumps(body).encode())
        status = response.status_code
        self.tally.statuses[(api.path, stream, status)] += 1
        if invalid:
            self.tally.schema_invalid_requests[(api.path, stream)] += 1
        problems: list[str] = []
        parsed: Json = None
        events: list[tuple[str | None, Json]] = []
        kind = response.headers.get("content-type", "")
        if status >= 500:
            self.tally.server_errors += 1
            problems.append(f"{status} (a 5xx): {response.text[:400]}")
        elif status == 200 and kind.startswith("text/event-stream"):
            events = sse_events(response.text)
            self.tally.events += len(events)
            problems += self._judge_stream(api, events, echoed)
        elif status == 200:
            parsed = _json(response.text)
            problems += self._judge(api, api.response, parsed, echoed, "the body")
        else:
            parsed = _json(response.text)
            if status not in DOCUMENTED_4XX:
                problems.append(f"status {status} is none the gateway documents")
            problems += self._judge(api, api.error, parsed, frozenset(), f"the {status} body")
        request_id = response.headers.get("x-request-id")
        if api.logged:
            log = self._log_line(request_id)
            if log:
                self.tally.log_failures += 1
                problems += log
        return Outcome(status, parsed, events, problems, request_id)

    def _judge(
        self, api: Api, schema: str, instance: Json, echoed: frozenset[str], what: str
    ) -> list[str]:
        errors = [
            error
            for error in api.description.errors(schema, instance)
            if not any(f'"{value}"' in error for value in echoed)
        ]
        if errors:
            self.tally.schema_failures += 1
            return [f"{what} is no valid {schema}: {'; '.join(errors)} in {dumps(instance)}"]
        return []

    def _judge_stream(
        self, api: Api, events: list[tuple[str | None, Json]], echoed: frozenset[str]
    ) -> list[str]:
        """Every event valid for the vendor's stream event schema, and none an in-band
        error: the fakes never fail, so a stream that ends in one failed in the gateway."""
        assert api.event is not None
        problems = []
        if not events:
            problems.append("a 200 stream without events")
        for index, (name, data) in enumerate(events):
            if data == "[DONE]":
                if index != len(events) - 1:
                    problems.append("[DONE] before the end of the stream")
                continue
            kind = data.get("type") if isinstance(data, dict) else None
            if name == "error" or kind in ("error", "response.failed") or "error" in data:
                problems.append(f"the stream failed in-band: {dumps(data)}")
            # Judged by the union's member of its type: its errors say more.
            member = api.description.member(api.event, kind)
            if member is None:
                self.tally.schema_failures += 1
                problems.append(f"event {index}: no {api.event} has type {kind!r}")
                continue
            problems += self._judge(api, member, data, echoed, f"event {index} ({kind})")
        return problems

    def _log_line(self, request_id: str | None) -> list[str]:
        """The request's log line: the next line of the gateway's output, whole."""
        if request_id is None:
            return ["no x-request-id header"]
        marker = f"request_id={request_id} "
        problems = []
        # The request's line is the next one; lines before it are none of its own (a
        # traceback, a forged line): reported, and read past, so one failure is told once.
        for skipped in range(_LOOK_AHEAD):
            try:
                line = self.gateway.line(self._cursor, timeout=30 if skipped == 0 else 2)
            except StartError:
                return [*problems, f"no log line for request {request_id}"]
            self._cursor += 1
            if marker in line:
                if not LOG_LINE.fullmatch(line):
                    problems.append(f"request {request_id}'s log line is broken: {line!r}")
                return problems
            problems.append(f"a log line no request accounts for: {line!r}")
        return [*problems, f"no log line for request {request_id}"]

    def resync(self) -> list[str]:
        """The lines logged since the last request's own, up to a request sent now (which
        is logged after them): what the previous requests left beside their own lines."""
        response = self.client.post(
            "/v1/chat/completions",
            content=b'{"model": "resync", "messages": [{"role": "user", "content": "x"}]}',
        )
        marker = f"request_id={response.headers.get('x-request-id')} "
        skipped = []
        for _ in range(1000):  # bounded: the lines of the requests sent since
            line = self.gateway.line(self._cursor, timeout=30)
            self._cursor += 1
            if marker in line:
                return skipped
            skipped.append(line)
        raise AssertionError("the gateway logged no line for the resync request")

    def unread_log_lines(self) -> list[str]:
        """Lines the gateway logged that no request accounts for (so far)."""
        lines = self.gateway.lines[self._cursor :]
        self._cursor += len(lines)
        return list(lines)


def sse_events(text: str) -> list[tuple[str | None, Json]]:
    """The (event name, data) pairs of a server-sent event stream; data parsed as JSON
    (``[DONE]`` kept as that string)."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name = None
        data = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].lstrip(" "))
        if data:
            payload = "\n".join(data)
            events.append((name, payload if payload == "[DONE]" else _json(payload)))
    return events


def _json(text: str) -> Json:
    try:
        return json.loads(text)
    except ValueError:
        return {"not JSON": text[:200]}
