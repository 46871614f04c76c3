"""Per-route evals: send a case set to each route directly and score the answers.

Each case goes to each route alone (no failover); the report holds per-route pass rates,
latency percentiles, tokens and cost, and the answers only when asked for.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import math
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, Literal

import pydantic
from pydantic import ConfigDict, Field

from pipeline._settings import problems_of, suggest
from pipeline._validation import ShapeCheck
from pipeline.client import ChatClient, close_all, ensure_chat_client
from pipeline.errors import ConfigError, ResponseValidationError, classify
from pipeline.types import ChatMessage, ChatOptions, ChatResponse, ChatResponseUpdate

if TYPE_CHECKING:
    from middleware.routing.context import Price, Route
    from pipeline.config import PipelineConfig

__all__ = [
    "MAX_CASES_BYTES",
    "MAX_LINE_BYTES",
    "MAX_REPORTED_PROBLEMS",
    "CaseResult",
    "EvalCase",
    "EvalReport",
    "Expectation",
    "RouteSummary",
    "load_cases",
    "load_validators",
    "parse_cases",
    "run_eval",
]

Progress = Callable[[int, int], None]

MAX_LINE_BYTES = 4 * 1024 * 1024
"""The longest case line read (a case this long already exceeds most context windows)."""
MAX_CASES_BYTES = 128 * 1024 * 1024
"""The largest case file read."""
MAX_REPORTED_PROBLEMS = 20
"""Problems listed in a `ConfigError` about cases; the rest are counted."""
_MIB = 1024 * 1024


class _Problems:
    """Problems found: the first `MAX_REPORTED_PROBLEMS` kept, the rest only counted, so a
    file of a million bad lines makes a short message (and a small list)."""

    def __init__(self, source: str = "") -> None:
        self.source = source
        self.kept: list[tuple[str, str]] = []
        self.count = 0

    def add(self, where: str, what: str) -> None:
        self.count += 1
        if len(self.kept) < MAX_REPORTED_PROBLEMS:
            self.kept.append((where, what))

    def extend(self, problems: Iterable[tuple[str, str]]) -> None:
        for where, what in problems:
            self.add(where, what)

    def raise_if_any(self) -> None:
        if self.count:
            raise self.error()

    def error(self) -> ConfigError:
        """One error listing the kept problems and counting the others (at least one)."""
        problems = list(self.kept)
        if self.count > len(problems):
            problems.append(
                (
                    self.source,
                    f"... and {self.count - len(problems):,} more problems "
                    f"(the first {len(problems)} are listed)",
                )
            )
        return ConfigError.from_problems(problems)


# -- cases ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a case's answer must satisfy; every field given must hold (none: any answer)."""

    validator: str | None = None
    json_schema: Mapping[str, Any] | None = None
    contains: str | None = None
    regex: str | None = None
    strip_fences: bool = False


@dataclass(frozen=True, slots=True)
class EvalCase:
    """One case: its id, the messages sent, the options (or None) and the expectation."""

    id: str
    messages: Sequence[ChatMessage]
    options: ChatOptions | None = None
    expect: Expectation = field(default_factory=Expectation)


class _Line(pydantic.BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, hide_input_in_errors=True)


class _MessageLine(_Line):
    role: Literal["system", "user", "assistant"]
    content: str


class _OptionsLine(_Line):
    model_id: str | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: list[str] | None = None
    seed: int | None = None
    response_format: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    session_id: str | None = None
    additional_properties: dict[str, Any] = Field(default_factory=dict)


class _ExpectLine(_Line):
    validator: Annotated[str, Field(min_length=1)] | None = None
    json_schema: dict[str, Any] | None = None
    contains: Annotated[str, Field(min_length=1)] | None = None
    regex: Annotated[str, Field(min_length=1)] | None = None
    strip_fences: bool = False


class _CaseLine(_Line):
    id: Annotated[str, Field(min_length=1)] | int
    messages: Any  # checked by `_messages`, for key paths without union member names
    options: _OptionsLine | None = None
    expect: _ExpectLine = Field(default_factory=_ExpectLine)


_MESSAGE_LIST: pydantic.TypeAdapter[list[_MessageLine]] = pydantic.TypeAdapter(list[_MessageLine])


def _messages(value: Any) -> tuple[list[ChatMessage], list[tuple[str, str]]]:
    """The messages of a case line, or what is wrong with them (key path, problem)."""
    if isinstance(value, str):
        if not value.strip():
            return [], [("messages", "must not be empty")]
        return [ChatMessage.user(value)], []
    if not isinstance(value, list):
        return [], [("messages", "expected a string or a list of {role, content} objects")]
    if not value:
        return [], [("messages", "must not be empty")]
    try:
        lines = _MESSAGE_LIST.validate_python(value, strict=True)
    except pydantic.ValidationError as exc:
        return [], [(path, message) for path, message, _ in problems_of(exc, None, ("messages",))]
    return [ChatMessage(m.role, m.content) for m in lines], []


def _case_from(line: _CaseLine, messages: list[ChatMessage]) -> EvalCase:
    options = None
    if line.options is not None:
        fields = type(line.options).model_fields
        options = ChatOptions(**{name: getattr(line.options, name) for name in fields})
    fields = type(line.expect).model_fields
    expect = Expectation(**{name: getattr(line.expect, name) for name in fields})
    return EvalCase(str(line.id), messages, options, expect)


def _expectation_problems(expect: Expectation) -> list[tuple[str, str]]:
    """What is wrong with an expectation, found without any validator from code."""
    found: list[tuple[str, str]] = []
    if expect.regex is not None:
        try:
            re.compile(expect.regex)
        except re.error as exc:
            found.append(("expect.regex", f"not a valid regular expression ({exc.msg})"))
    if expect.json_schema is not None:
        try:
            ShapeCheck(expect.json_schema)
        except (TypeError, ValueError, ImportError) as exc:
            found.append(("expect.json_schema", str(exc)))
    return found


def parse_cases(lines: Iterable[str], source: str = "cases") -> list[EvalCase]:
    """Cases from JSONL lines; a `ConfigError` lists the problems (``line N: key: what``;
    the first `MAX_REPORTED_PROBLEMS`, then how many more)."""
    problems = _Problems(source)
    cases = _parse(lines, source, problems)
    problems.raise_if_any()
    return cases


def _parse(lines: Iterable[str], source: str, problems: _Problems) -> list[EvalCase]:
    cases: list[EvalCase] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{source} line {number}"
        try:
            line = _CaseLine.model_validate_json(text)
        except pydantic.ValidationError as exc:
            top = [e["type"] for e in exc.errors(include_url=False) if not e["loc"]]
            if "json_invalid" in top:
                problems.add(where, "not valid JSON")
            elif top:
                problems.add(where, "expected a JSON object")
            else:
                problems.extend(
                    (f"{where}: {path}", message)
                    for path, message, _ in problems_of(exc, _CaseLine)
                )
            continue
        messages, wrong = _messages(line.messages)
        if wrong:
            problems.extend((f"{where}: {path}", message) for path, message in wrong)
            continue
        case = _case_from(line, messages)
        for path, message in _expectation_problems(case.expect):
            problems.add(f"{where}: {path}", message)
        if case.id in seen:
            problems.add(f"{where}: id", f"duplicates the id of line {seen[case.id]}")
        seen.setdefault(case.id, number)
        cases.append(case)
    if not cases and not problems.count:
        problems.add(source, "holds no cases")
    return cases


def _size(limit: int) -> str:
    return f"{limit // _MIB} MiB" if limit % _MIB == 0 else f"{limit} bytes"


def _read_lines(stream: IO[bytes], source: str, problems: _Problems) -> Iterator[str]:
    """The lines of `stream`, at most `MAX_LINE_BYTES` each and `MAX_CASES_BYTES` in all:
    past either limit the problem is recorded and reading stops. A line that is not UTF-8
    is recorded and read as blank (so line numbers stay right)."""
    line_limit, file_limit = MAX_LINE_BYTES, MAX_CASES_BYTES
    total = 0
    for number in range(1, file_limit + 2):  # a line holds at least its newline
        raw = stream.readline(line_limit + 1)
        if not raw:
            return
        total += len(raw)
        if total > file_limit:
            problems.add(source, f"larger than {_size(file_limit)} (the limit of a case file)")
            return
        if raw.endswith(b"\n"):
            raw = raw[:-1]
        elif len(raw) > line_limit:
            problems.add(
                f"{source} line {number}",
                f"longer than {_size(line_limit)} (the limit of a case line)",
            )
            return
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.add(f"{source} line {number}", f"not UTF-8 text (byte {exc.start})")
            yield ""


def load_cases(path: str | os.PathLike[str]) -> list[EvalCase]:
    """Read a JSONL case file (see the module docstring for its limits)."""
    file = Path(path)
    problems = _Problems(file.name)
    try:
        with file.open("rb") as stream:
            size = os.fstat(stream.fileno()).st_size  # 0 for a pipe or a device
            if size > MAX_CASES_BYTES:
                limit = _size(MAX_CASES_BYTES)
                raise ConfigError(file.name, f"larger than {limit} (the limit of a case file)")
            cases = _parse(_read_lines(stream, file.name, problems), file.name, problems)
    except OSError as exc:
        raise ConfigError("", f"cannot read {file}: {exc.strerror or type(exc).__name__}") from exc
    problems.raise_if_any()
    return cases


def load_validators(spec: str) -> dict[str, Any]:
    """The validators named by ``module:attribute``: a mapping of names to validators, a
    list of them (named by their ``__name__``) or one model class. The current directory
    is importable, as for ``python -m``."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError("--validators", f"expected module:attribute, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("--validators", f"cannot import {module_name!r}: {exc}") from exc
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ConfigError("--validators", f"{module_name!r} has no {attribute!r}") from None
    if isinstance(found, Mapping):
        return {str(name): value for name, value in found.items()}
    items = found if isinstance(found, list | tuple) else [found]
    named: dict[str, Any] = {}
    for item in items:
        name = getattr(item, "__name__", None)
        if not isinstance(name, str):
            raise ConfigError(
                "--validators",
                f"{spec}: expected a dict of validators, a list of models or a model",
            )
        named[name] = item
    return named


# -- results --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One case on one route. `failure` is ``error`` (the route raised; `error_kind` and
    `error_type` say how) or ``expectation`` (`reason` says which failed); `text` is the
    answer only when asked for."""

    case_id: str
    route: str
    passed: bool
    failure: Literal["error", "expectation"] | None
    reason: str | None
    error_kind: str | None
    error_type: str | None
    latency: float
    time_to_first_update: float | None
    input_tokens: int | None
    output_tokens: int | None
    cost: float | None
    text: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = {
            "case": self.case_id,
            "route": self.route,
            "passed": self.passed,
            "failure": self.failure,
            "reason": self.reason,
            "error_kind": self.error_kind,
            "error_type": self.error_type,
            "latency_s": self.latency,
            "time_to_first_update_s": self.time_to_first_update,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost": self.cost,
        }
        if self.text is not None:
            data["text"] = self.text
        return data


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` quantile (0 < q <= 1) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _total(counts: Iterable[int | None]) -> int | None:
    known = [count for count in counts if count is not None]
    return sum(known) if known else None


@dataclass(frozen=True, slots=True)
class RouteSummary:
    """One route's figures over every case (see the module docstring for percentiles).
    Token totals are None when no call reported usage; `cost` when the route has no price."""

    route: str
    cases: int
    passed: int
    errors: int
    latency_p50: float | None
    latency_p95: float | None
    first_update_p50: float | None
    first_update_p95: float | None
    input_tokens: int | None
    output_tokens: int | None
    cost: float | None

    @property
    def pass_rate(self) -> float:
        return self.passed / self.cases if self.cases else 0.0

    @classmethod
    def of(cls, route: str, results: Sequence[CaseResult], priced: bool) -> RouteSummary:
        answered = [r.latency for r in results if r.failure != "error"]
        firsts = [r.time_to_first_update for r in results if r.time_to_first_update is not None]
        return cls(
            route=route,
            cases=len(results),
            passed=sum(r.passed for r in results),
            errors=sum(r.failure == "error" for r in results),
            latency_p50=percentile(answered, 0.5),
            latency_p95=percentile(answered, 0.95),
            first_update_p50=percentile(firsts, 0.5),
            first_update_p95=percentile(firsts, 0.95),
            input_tokens=_total(r.input_tokens for r in results),
            output_tokens=_total(r.output_tokens for r in results),
            cost=sum(r.cost or 0.0 for r in results) if priced else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "route": self.route,
            "cases": self.cases,
            "passed": self.passed,
            "errors": self.errors,
            "pass_rate": self.pass_rate,
            "latency_p50_s": self.latency_p50,
            "latency_p95_s": self.latency_p95,
            "time_to_first_update_p50_s": self.first_update_p50,
            "time_to_first_update_p95_s": self.first_update_p95,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost": self.cost,
        }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _count(tokens: int | None) -> str:
    return "-" if tokens is None else str(tokens)


@dataclass(frozen=True, slots=True)
class EvalReport:
    """Every result (route by route, cases in file order) and each route's summary."""

    results: list[CaseResult]
    routes: dict[str, RouteSummary]

    def below(self, min_pass_rate: float) -> list[str]:
        """The routes whose pass rate is below `min_pass_rate`."""
        return [name for name, s in self.routes.items() if s.pass_rate < min_pass_rate]

    def table(self) -> str:
        """The per-route table, one line per route (milliseconds for times)."""
        header = (
            "route",
            "cases",
            "passed",
            "pass rate",
            "errors",
            "latency p50/p95 ms",
            "first update p50/p95 ms",
            "tokens in/out",
            "cost",
        )
        rows = [header]
        for s in self.routes.values():
            rows.append(
                (
                    s.route,
                    str(s.cases),
                    str(s.passed),
                    f"{s.pass_rate:.1%}",
                    str(s.errors),
                    f"{_ms(s.latency_p50)} / {_ms(s.latency_p95)}",
                    f"{_ms(s.first_update_p50)} / {_ms(s.first_update_p95)}",
                    f"{_count(s.input_tokens)} / {_count(s.output_tokens)}",
                    "-" if s.cost is None else f"{s.cost:.6f}",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = []
        for row in rows:
            cells = [row[0].ljust(widths[0])]
            cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def failures(self, limit: int = 20) -> str:
        """One line per failed case (route, case id, why), at most `limit` lines."""
        failed = [r for r in self.results if not r.passed]
        lines = [f"{r.route}  {r.case_id}: {r.reason}" for r in failed[:limit]]
        if len(failed) > limit:
            lines.append(f"... and {len(failed) - limit} more (see --json)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "routes": [s.to_json() for s in self.routes.values()],
            "cases": [r.to_json() for r in self.results],
        }


# -- running --------------------------------------------------------------------------------


_Check = Callable[[ChatResponse], Awaitable[str | None]]


def _shape(check: ShapeCheck, label: str) -> _Check:
    async def run(response: ChatResponse) -> str | None:
        try:
            value = check(response)
            if check.may_await and inspect.isawaitable(value):
                await value
        except ResponseValidationError as error:
            return f"{label}: {error.message}"
        return None

    return run


def _text_check(test: Callable[[str], bool], reason: str) -> _Check:
    async def run(response: ChatResponse) -> str | None:
        return None if test(response.text) else reason

    return run


_WORKER = Path(__file__).with_name("_regex_search.py")


class _RegexSearches:
    """``re.search`` in worker processes (`pipeline._regex_search`), each search bounded by
    `limit` seconds: a worker still searching at the limit is killed, since a backtracking
    search cannot be stopped in this process (``re`` holds the GIL while it matches).

    Workers start on first use and are reused; there are never more than searches in
    flight (at most the run's concurrency). `aclose` ends them all.
    """

    def __init__(self, limit: float | None) -> None:
        self.limit = limit
        self._idle: list[asyncio.subprocess.Process] = []
        self._started: list[asyncio.subprocess.Process] = []

    async def _worker(self) -> asyncio.subprocess.Process:
        if self._idle:
            return self._idle.pop()
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",  # no environment variables, user site or script folder on the path
            "-S",  # nor site-packages: it needs the standard library only
            str(_WORKER),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self._started.append(worker)
        return worker

    async def search(self, pattern: str, text: str) -> str | None:
        """None when `pattern` is found in `text`, else why the expectation failed."""
        worker = await self._worker()
        request = json.dumps({"pattern": pattern, "text": text}).encode() + b"\n"
        assert worker.stdin is not None  # both are pipes (see _worker)
        assert worker.stdout is not None
        try:
            async with asyncio.timeout(self.limit):
                worker.stdin.write(request)
                await worker.stdin.drain()
                answer = await worker.stdout.readline()
        except TimeoutError:
            await self._end(worker)
            return f"the expected regex did not finish within {self.limit:g} s"
        except BaseException:
            await self._end(worker)
            raise
        if answer not in (b"0\n", b"1\n"):  # the worker died (out of memory, killed)
            await self._end(worker)
            return "the expected regex could not be searched (the worker process failed)"
        self._idle.append(worker)
        return None if answer == b"1\n" else "does not match the expected regex"

    async def _end(self, worker: asyncio.subprocess.Process) -> None:
        if worker.returncode is None:
            worker.kill()
        # Reaping a killed process is prompt; shielded so a cancelled search still reaps.
        await asyncio.shield(worker.wait())
        self._started.remove(worker)

    async def aclose(self) -> None:
        """End every worker: idle ones finish when their input closes."""
        for worker in self._idle:
            assert worker.stdin is not None
            worker.stdin.close()
        for worker in list(self._started):
            try:
                async with asyncio.timeout(5):
                    await worker.wait()
            except TimeoutError:
                worker.kill()
                await worker.wait()
        self._idle.clear()
        self._started.clear()


def _regex_check(pattern: str, searches: _RegexSearches) -> _Check:
    async def run(response: ChatResponse) -> str | None:
        return await searches.search(pattern, response.text)

    return run


def _checks(
    case: EvalCase, validators: Mapping[str, Any], searches: _RegexSearches
) -> list[_Check]:
    expect = case.expect
    checks: list[_Check] = []
    if expect.validator is not None:
        check = ShapeCheck(validators[expect.validator], strip_fences=expect.strip_fences)
        checks.append(_shape(check, f"validator {expect.validator}"))
    if expect.json_schema is not None:
        check = ShapeCheck(expect.json_schema, strip_fences=expect.strip_fences)
        checks.append(_shape(check, "json_schema"))
    if expect.contains is not None:
        needle = expect.contains
        checks.append(
            _text_check(lambda text: needle in text, "does not contain the expected text")
        )
    if expect.regex is not None:
        checks.append(_regex_check(expect.regex, searches))
    return checks


def _resolve_validators(
    cases: Sequence[EvalCase],
    validators: Mapping[str, Any],
    searches: _RegexSearches,
    problems: _Problems,
) -> dict[str, list[_Check]]:
    checks: dict[str, list[_Check]] = {}
    for case in cases:
        where = f"case {case.id!r}"
        name = case.expect.validator
        if name is not None and name not in validators:
            known = ", ".join(sorted(validators)) or "none were given"
            problems.add(
                f"{where}: expect.validator",
                f"unknown validator {name!r}{suggest(name, validators)} (known: {known})",
            )
            continue
        problems.extend((f"{where}: {p}", m) for p, m in _expectation_problems(case.expect))
        try:
            checks[case.id] = _checks(case, validators, searches)
        except (TypeError, ValueError, ImportError) as exc:
            problems.add(f"{where}: expect.validator", str(exc))
    return checks


@dataclass(slots=True)
class _Target:
    name: str
    client: ChatClient
    price: Price | None


async def _one(
    target: _Target,
    case: EvalCase,
    checks: Sequence[_Check],
    *,
    request_timeout: float | None,
    include_text: bool,
    clock: Callable[[], float],
) -> CaseResult:
    updates: list[ChatResponseUpdate] = []
    first: float | None = None
    error: Exception | None = None
    timer = asyncio.timeout(request_timeout)
    started = clock()
    try:
        async with timer:
            options = case.options.clone() if case.options is not None else None
            stream = target.client.get_streaming_response(list(case.messages), options)
            async with contextlib.aclosing(stream):
                async for update in stream:  # bounded by the route and the timeout
                    if first is None:
                        first = clock() - started
                    updates.append(update)
    except Exception as exc:  # cancellation (a BaseException) ends the whole run
        error = exc
    latency = clock() - started

    def result(**fields: Any) -> CaseResult:
        return CaseResult(
            case_id=case.id,
            route=target.name,
            latency=latency,
            time_to_first_update=first,
            **fields,
        )

    if error is not None:
        kind = classify(error).value
        why = (
            f"timed out after {request_timeout:g} s"
            if timer.expired() and request_timeout is not None
            else f"error: {kind} ({type(error).__name__})"
        )
        return result(
            passed=False,
            failure="error",
            reason=why,
            error_kind=classify(error).value,
            error_type=type(error).__name__,
            input_tokens=None,
            output_tokens=None,
            cost=None,
        )
    response = ChatResponse.from_updates(updates)
    usage = response.usage
    input_tokens = usage.input_tokens if usage is not None else None
    output_tokens = usage.output_tokens if usage is not None else None
    cost = None
    if target.price is not None and usage is not None:
        cost = target.price.cost(input_tokens, output_tokens)
    reason: str | None = None
    for check in checks:
        reason = await check(response)
        if reason is not None:
            break
    return result(
        passed=reason is None,
        failure=None if reason is None else "expectation",
        reason=reason,
        error_kind=None,
        error_type=None,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cost=cost,
        text=response.text if include_text else None,
    )


def _unknown_routes(
    wanted: Sequence[str], known: Sequence[str], what: str
) -> list[tuple[str, str]]:
    return [
        (f"routes.{name}", f"is not {what}{suggest(name, known)}")
        for name in wanted
        if name not in known
    ]


async def _targets_from_config(config: PipelineConfig, wanted: Sequence[str]) -> list[_Target]:
    targets: list[_Target] = []
    try:
        for name in wanted:
            route = config.build_route(name)
            targets.append(_Target(name, route.client, route.price))
    except BaseException:
        await close_all([target.client for target in targets], "routes")
        raise
    return targets


def _targets_from_mapping(routes: Mapping[str, Any], wanted: Sequence[str]) -> list[_Target]:
    from middleware.routing.context import Route

    targets = []
    for name in wanted:
        item = routes[name]
        if isinstance(item, Route):
            targets.append(_Target(name, item.client, item.price))
        else:
            targets.append(_Target(name, ensure_chat_client(item, f"route {name!r}"), None))
    return targets


async def run_eval(
    source: str | os.PathLike[str] | PipelineConfig | Mapping[str, Route | ChatClient],
    cases: str | os.PathLike[str] | Sequence[EvalCase],
    *,
    environment: str | None = None,
    routes: Sequence[str] | None = None,
    validators: Mapping[str, Any] | None = None,
    concurrency: int = 4,
    request_timeout: float | None = 120.0,
    include_text: bool = False,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> EvalReport:
    """Send every case to every route and score the answers (see the module docstring).

    `source` is a TOML file (read with `environment`), a loaded `PipelineConfig`, or a
    mapping of route names to `Route`s or clients; `routes` picks some of them, in that
    order. `cases` is a JSONL file or `EvalCase`s. `validators` maps the names cases use to
    validators. `progress(done, total)` hears each finished request.
    """
    if isinstance(routes, str):
        raise TypeError("routes must be a sequence of route names, not one string")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
    if request_timeout is not None and (
        isinstance(request_timeout, bool)
        or not isinstance(request_timeout, int | float)
        or not request_timeout > 0
    ):
        raise ValueError(
            f"request_timeout must be a positive number of seconds or None, got {request_timeout!r}"
        )
    case_list = load_cases(cases) if isinstance(cases, str | os.PathLike) else list(cases)
    if not case_list:
        raise ConfigError("cases", "holds no cases")
    if len({case.id for case in case_list}) != len(case_list):
        raise ConfigError("cases", "case ids must be unique")
    # Every problem (cases, validators, configuration, route names) is reported at once,
    # before any client is built.
    problems = _Problems()
    searches = _RegexSearches(request_timeout)
    checks = _resolve_validators(case_list, validators or {}, searches, problems)
    if isinstance(source, str | os.PathLike):
        from pipeline.config import load_config

        try:
            source = load_config(source, environment)
        except ConfigError as exc:
            problems.extend(exc.problems)
            raise problems.error() from None
    known = list(source) if isinstance(source, Mapping) else source.route_names
    wanted = list(routes) if routes is not None else known
    what = "given" if isinstance(source, Mapping) else "defined"
    problems.extend(_unknown_routes(wanted, known, what))
    if not wanted:
        problems.add("routes", "none to evaluate")
    twice = sorted({name for name in wanted if wanted.count(name) > 1})
    if twice:
        problems.add("routes", f"listed more than once: {', '.join(twice)}")
    problems.raise_if_any()
    owned = not isinstance(source, Mapping)
    if isinstance(source, Mapping):
        targets = _targets_from_mapping(source, wanted)
    else:
        targets = await _targets_from_config(source, wanted)
    try:
        jobs = [(target, case) for case in case_list for target in targets]
        results: list[CaseResult | None] = [None] * len(jobs)
        done = 0
        pending = iter(enumerate(jobs))

        async def worker() -> None:
            nonlocal done
            # One shared iterator: each job is taken once, by one worker.
            for index, (target, case) in pending:
                results[index] = await _one(
                    target,
                    case,
                    checks[case.id],
                    request_timeout=request_timeout,
                    include_text=include_text,
                    clock=clock,
                )
                done += 1
                if progress is not None:
                    progress(done, len(jobs))

        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(jobs))):
                group.create_task(worker())
    finally:
        try:
            await searches.aclose()
        finally:
            if owned:
                await close_all([target.client for target in targets], "routes")
    finished = [r for r in results if r is not None]
    order = {target.name: i for i, target in enumerate(targets)}
    finished.sort(key=lambda r: order[r.route])  # stable: cases stay in file order
    summaries = {
        target.name: RouteSummary.of(
            target.name,
            [r for r in finished if r.route == target.name],
            priced=target.price is not None,
        )
        for target in targets
    }
    return EvalReport(finished, summaries)
