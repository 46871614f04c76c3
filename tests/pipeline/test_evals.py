"""Per-route evals: scripted routes, routes over real HTTP, case files and the CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
import textwrap
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

from middleware.routing import Price, Route
from pipeline import ChatMessage, ChatOptions, ChatResponseUpdate, TextContent, UsageDetails
from pipeline.cli import main
from pipeline.client import ChatClientMetadata
from pipeline.errors import ConfigError, TransientProviderError
from pipeline.evals import (
    MAX_LINE_BYTES,
    MAX_REPORTED_PROBLEMS,
    EvalCase,
    Expectation,
    load_cases,
    parse_cases,
    run_eval,
)
from pipeline.testing import FakeOpenAIServer, FakeResponse, ScriptedChatClient, fail, hang, reply

CANARY = "CANARY-eval-91c2"
GOOD = '{"number": "A-1", "total": 12.5}'
BAD = '{"number": "' + CANARY + '"}'  # no total


class Invoice(pydantic.BaseModel):
    number: str
    total: float


def invoice_cases(count: int = 4) -> list[EvalCase]:
    return [
        EvalCase(f"c{i}", [ChatMessage.user(f"invoice {i}")], expect=Expectation("Invoice"))
        for i in range(count)
    ]


def ticking() -> Callable[[], float]:
    """A clock that moves one second per reading: each request reads it three times
    (start, first update, end), so with one request at a time latency is 2 s and time to
    first update 1 s."""
    counter = itertools.count()
    return lambda: float(next(counter))


USAGE = UsageDetails(10, 5, 15)


async def test_scripted_routes_give_the_expected_table() -> None:
    good = ScriptedChatClient(reply(GOOD, usage=USAGE), name="good")
    flaky = ScriptedChatClient(
        [reply(GOOD), reply(BAD), reply(GOOD), reply(BAD)], name="flaky", repeat_last=False
    )
    report = await run_eval(
        {"good": Route("good", good, price=Price(1.0, 2.0)), "flaky": flaky},
        invoice_cases(),
        validators={"Invoice": Invoice},
        concurrency=1,
        clock=ticking(),
    )
    assert report.table().splitlines() == [
        "route  cases  passed  pass rate  errors  latency p50/p95 ms  first update p50/p95 ms"
        "  tokens in/out      cost",
        "good       4       4     100.0%       0     2000.0 / 2000.0          1000.0 / 1000.0"
        "        40 / 20  0.000080",
        "flaky      4       2      50.0%       0     2000.0 / 2000.0          1000.0 / 1000.0"
        "          - / -         -",
    ]
    assert report.below(0.75) == ["flaky"] and report.below(0.5) == []
    assert [(r.route, r.case_id, r.passed) for r in report.results] == [
        ("good", "c0", True),
        ("good", "c1", True),
        ("good", "c2", True),
        ("good", "c3", True),
        ("flaky", "c0", True),
        ("flaky", "c1", False),
        ("flaky", "c2", True),
        ("flaky", "c3", False),
    ]
    failed = [r for r in report.results if not r.passed]
    assert {r.reason for r in failed} == {
        "validator Invoice: response is not a valid Invoice: 1 problem (total: missing)"
    }
    assert {r.failure for r in failed} == {"expectation"}
    assert (good.call_count, flaky.call_count) == (4, 4)
    assert good.close_count == flaky.close_count == 0  # the caller's clients stay open


async def test_counts_hold_at_any_concurrency() -> None:
    flaky = ScriptedChatClient([reply(GOOD), reply(BAD)] * 5, name="flaky", repeat_last=False)
    report = await run_eval(
        {"flaky": flaky}, invoice_cases(10), validators={"Invoice": Invoice}, concurrency=4
    )
    summary = report.routes["flaky"]
    assert (summary.cases, summary.passed, summary.errors) == (10, 5, 0)
    assert summary.pass_rate == 0.5


async def test_answers_stay_out_of_results_unless_asked() -> None:
    client = ScriptedChatClient(reply(BAD), name="r")
    report = await run_eval({"r": client}, invoice_cases(1), validators={"Invoice": Invoice})
    assert CANARY not in json.dumps(report.to_json()) and CANARY not in report.failures()
    kept = await run_eval(
        {"r": client}, invoice_cases(1), validators={"Invoice": Invoice}, include_text=True
    )
    assert kept.results[0].text == BAD and kept.to_json()["cases"][0]["text"] == BAD


async def test_errors_and_timeouts_are_failures_with_kinds() -> None:
    broken = ScriptedChatClient(fail(TransientProviderError(status_code=503)), name="broken")
    stuck = ScriptedChatClient(hang(), name="stuck")
    cases = [EvalCase("c0", [ChatMessage.user("hi")])]
    report = await run_eval({"broken": broken, "stuck": stuck}, cases, request_timeout=0.05)
    by_route = {r.route: r for r in report.results}
    assert by_route["broken"].reason == "error: transient (TransientProviderError)"
    assert by_route["broken"].error_kind == "transient"
    assert by_route["stuck"].reason == "timed out after 0.05 s"
    assert by_route["stuck"].failure == "error"
    assert stuck.streams_closed == 1
    summary = report.routes["broken"]
    assert (summary.errors, summary.passed, summary.latency_p50) == (1, 0, None)


@pytest.mark.parametrize(
    ("expect", "passes"),
    [
        (Expectation(contains="12.5"), True),
        (Expectation(contains="13"), False),
        (Expectation(regex=r'"total":\s*12\.5'), True),
        (Expectation(regex=r"^\["), False),
        (Expectation(json_schema={"type": "object", "required": ["total"]}), True),
        (Expectation(json_schema={"type": "array"}), False),
        (Expectation(validator="Invoice", contains="A-1"), True),
        (Expectation(validator="Invoice", contains="B-2"), False),
        (Expectation(), True),
    ],
)
async def test_each_expectation(expect: Expectation, passes: bool) -> None:
    client = ScriptedChatClient(reply(GOOD))
    report = await run_eval(
        {"r": client},
        [EvalCase("c", [ChatMessage.user("hi")], expect=expect)],
        validators={"Invoice": Invoice},
    )
    assert report.results[0].passed is passes


async def test_fenced_json_needs_strip_fences() -> None:
    client = ScriptedChatClient(reply("```json\n" + GOOD + "\n```"))
    cases = [
        EvalCase("plain", [ChatMessage.user("x")], expect=Expectation("Invoice")),
        EvalCase(
            "fenced", [ChatMessage.user("x")], expect=Expectation("Invoice", strip_fences=True)
        ),
    ]
    report = await run_eval({"r": client}, cases, validators={"Invoice": Invoice})
    assert [r.passed for r in report.results] == [False, True]


async def test_options_and_messages_reach_the_route_unshared() -> None:
    client = ScriptedChatClient(reply("ok"))
    options = ChatOptions(temperature=0.0, max_output_tokens=20)
    case = EvalCase("c", [ChatMessage.system("be brief"), ChatMessage.user("hi")], options)
    await run_eval({"a": client, "b": client}, [case])
    assert client.call_count == 2
    for call in client.calls:
        assert [m.text for m in call.messages] == ["be brief", "hi"]
        assert call.options is not options and call.streaming
        assert call.options_snapshot is not None
        assert call.options_snapshot.max_output_tokens == 20


class Gate:
    """A client whose calls wait until `width` of them are in flight at once."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.in_flight = 0
        self.most = 0
        self.calls = 0
        self.open = asyncio.Event()
        self.metadata = ChatClientMetadata(provider_name="gate", name="gate")

    async def get_response(self, messages: Any, options: Any = None) -> Any:
        raise NotImplementedError

    async def get_streaming_response(
        self, messages: Any, options: Any = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        self.calls += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.width:
            self.open.set()
        await self.open.wait()
        self.in_flight -= 1
        yield ChatResponseUpdate(contents=[TextContent("ok")])

    async def aclose(self) -> None:
        return None


async def test_concurrency_is_bounded() -> None:
    gate = Gate(width=3)
    cases = [EvalCase(f"c{i}", [ChatMessage.user("x")]) for i in range(10)]
    progress: list[tuple[int, int]] = []
    report = await run_eval(
        {"g": gate}, cases, concurrency=3, progress=lambda d, t: progress.append((d, t))
    )
    assert gate.calls == 10 and gate.most == 3
    assert report.routes["g"].passed == 10
    assert progress == [(i, 10) for i in range(1, 11)]


# -- case files ----------------------------------------------------------------------------


def test_a_case_file_parses_every_shape() -> None:
    lines = [
        '{"id": "a", "messages": "hi", "expect": {"contains": "x"}}',
        "",
        '{"id": 2, "messages": [{"role": "system", "content": "s"}, {"role": "user", '
        '"content": "u"}], "options": {"temperature": 0, "seed": 7, "stop": ["\\n"]}, '
        '"expect": {"validator": "Invoice", "strip_fences": true}}',
    ]
    first, second = parse_cases(lines)
    assert first.id == "a" and [m.text for m in first.messages] == ["hi"]
    assert first.options is None and first.expect == Expectation(contains="x")
    assert second.id == "2" and [m.role for m in second.messages] == ["system", "user"]
    assert second.options is not None
    assert (second.options.temperature, second.options.seed, second.options.stop) == (
        0,
        7,
        ["\n"],
    )
    assert second.expect == Expectation(validator="Invoice", strip_fences=True)


def test_a_bad_case_file_names_every_problem() -> None:
    lines = [
        "not json " + CANARY,
        '{"id": "a", "messages": "hi", "expct": {}}',
        '{"id": "b", "messages": [{"role": "robot", "content": "x"}]}',
        '{"id": "c", "messages": []}',
        '{"id": "d", "messages": "hi", "expect": {"regex": "("}}',
        '{"id": "e", "messages": "hi", "expect": {"json_schema": {"type": "nope"}}}',
        '{"id": "e", "messages": "hi"}',
        '{"id": "f", "messages": "hi", "options": {"temperature": "' + CANARY + '"}}',
        '{"id": "g", "messages": {"role": "user"}}',
        '["not", "an", "object"]',
    ]
    with pytest.raises(ConfigError) as caught:
        parse_cases(lines, "cases.jsonl")
    paths = [path for path, _ in caught.value.problems]
    assert paths == [
        "cases.jsonl line 1",
        "cases.jsonl line 2: expct",
        "cases.jsonl line 3: messages[0].role",
        "cases.jsonl line 4: messages",
        "cases.jsonl line 5: expect.regex",
        "cases.jsonl line 6: expect.json_schema",
        "cases.jsonl line 7: id",
        "cases.jsonl line 8: options.temperature",
        "cases.jsonl line 9: messages",
        "cases.jsonl line 10",
    ]
    message = str(caught.value)
    assert message.startswith("cases.jsonl line 1: not valid JSON\n")
    assert "cases.jsonl line 10: expected a JSON object" in message
    assert "did you mean 'expect'?" in message
    assert "not a valid regular expression" in message and "invalid JSON schema" in message
    assert "duplicates the id of line 6" in message
    assert CANARY not in message


def test_an_empty_case_file_is_an_error() -> None:
    with pytest.raises(ConfigError, match="holds no cases"):
        parse_cases(["", "  "])


async def test_unknown_validators_and_routes_fail_before_any_request() -> None:
    client = ScriptedChatClient(reply(GOOD))
    with pytest.raises(ConfigError) as caught:
        await run_eval(
            {"r": client}, invoice_cases(1), validators={"Invoce": Invoice, "Other": Invoice}
        )
    assert "unknown validator 'Invoice'; did you mean 'Invoce'?" in str(caught.value)
    with pytest.raises(ConfigError, match="did you mean 'r'"):
        await run_eval(
            {"r": client}, invoice_cases(1), routes=["rr"], validators={"Invoice": Invoice}
        )
    assert client.call_count == 0


async def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        await run_eval({}, invoice_cases(1), concurrency=0)
    with pytest.raises(ValueError, match="request_timeout"):
        await run_eval({}, invoice_cases(1), request_timeout=-1)
    duplicated = [EvalCase("a", [ChatMessage.user("x")])] * 2
    with pytest.raises(ConfigError, match="unique"):
        await run_eval({"r": ScriptedChatClient()}, duplicated)
    one = [EvalCase("a", [ChatMessage.user("x")])]
    with pytest.raises(ConfigError, match="none to evaluate"):
        await run_eval({}, one)
    with pytest.raises(ConfigError, match="listed more than once: r"):
        await run_eval({"r": ScriptedChatClient()}, one, routes=["r", "r"])
    with pytest.raises(TypeError, match="one string"):
        await run_eval({"r": ScriptedChatClient()}, one, routes="r")


# -- hostile inputs ------------------------------------------------------------------------


def test_a_flood_of_bad_lines_gives_a_bounded_message() -> None:
    lines = ["x" * 30] * 200_000
    with pytest.raises(ConfigError) as caught:
        parse_cases(lines, "cases.jsonl")
    problems = caught.value.problems
    assert len(problems) == MAX_REPORTED_PROBLEMS + 1
    assert [path for path, _ in problems[:3]] == [
        "cases.jsonl line 1",
        "cases.jsonl line 2",
        "cases.jsonl line 3",
    ]
    assert problems[-1] == (
        "cases.jsonl",
        f"... and {200_000 - MAX_REPORTED_PROBLEMS:,} more problems (the first "
        f"{MAX_REPORTED_PROBLEMS} are listed)",
    )
    assert len(str(caught.value)) < 4_000


async def test_a_flood_of_unknown_validators_gives_a_bounded_message() -> None:
    cases = [
        EvalCase(f"c{i}", [ChatMessage.user("x")], expect=Expectation("Nope")) for i in range(5_000)
    ]
    client = ScriptedChatClient(reply(GOOD))
    with pytest.raises(ConfigError) as caught:
        await run_eval({"r": client}, cases)
    assert len(caught.value.problems) == MAX_REPORTED_PROBLEMS + 1
    assert caught.value.problems[-1][1].startswith("... and 4,980 more problems")
    assert client.call_count == 0


@pytest.mark.timeout(60)
async def test_a_catastrophic_regex_is_cut_at_the_request_timeout() -> None:
    # ^(a+)+$ against "aaaa...b" backtracks exponentially: years for 64 letters.
    route = ScriptedChatClient(reply("a" * 64 + "b"), name="r")
    cases = [
        EvalCase("hang", [ChatMessage.user("x")], expect=Expectation(regex="^(a+)+$")),
        EvalCase("fine", [ChatMessage.user("x")], expect=Expectation(regex="a+b$")),
        EvalCase("miss", [ChatMessage.user("x")], expect=Expectation(regex="^b")),
    ]
    report = await run_eval({"r": route}, cases, request_timeout=1.0, concurrency=1)
    outcome = {r.case_id: (r.passed, r.failure, r.reason) for r in report.results}
    assert outcome == {
        "hang": (False, "expectation", "the expected regex did not finish within 1 s"),
        "fine": (True, None, None),
        "miss": (False, "expectation", "does not match the expected regex"),
    }


def test_an_endless_line_is_a_bounded_error() -> None:
    with pytest.raises(ConfigError) as caught:
        load_cases("/dev/zero")
    assert str(caught.value) == (
        f"zero line 1: longer than {MAX_LINE_BYTES // (1024 * 1024)} MiB (the limit of a case line)"
    )


def test_a_case_file_over_the_size_limit_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.evals

    monkeypatch.setattr(pipeline.evals, "MAX_CASES_BYTES", 1000)
    path = tmp_path / "cases.jsonl"
    path.write_text('{"id": "a", "messages": "hi"}\n' * 100)
    with pytest.raises(ConfigError) as caught:
        load_cases(path)
    assert str(caught.value) == "cases.jsonl: larger than 1000 bytes (the limit of a case file)"
    path.write_text('{"id": "a", "messages": "hi"}\n')
    assert [case.id for case in load_cases(path)] == ["a"]


def test_a_case_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "cases.jsonl"
    path.write_bytes(b'{"id": "a", "messages": "hi"}\n{"id": "b", "messages": "\xff"}\n')
    with pytest.raises(ConfigError) as caught:
        load_cases(path)
    assert str(caught.value) == "cases.jsonl line 2: not UTF-8 text (byte 25)"


# -- from configuration, over real HTTP ----------------------------------------------------


async def test_routes_from_config_over_the_fake_http_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EVAL_TEST_KEY", "sk-eval-test")
    async with (
        FakeOpenAIServer(default=FakeResponse(text=GOOD)) as good,
        FakeOpenAIServer() as flaky,
    ):
        flaky.script(*[FakeResponse(text=GOOD), FakeResponse(text=BAD)] * 2)
        config = tmp_path / "pipeline.toml"
        config.write_text(
            textwrap.dedent(
                f"""
                [routes.good]
                provider = "openai"
                model = "good-model"
                base_url = "{good.base_url}"
                api_key_env = "EVAL_TEST_KEY"
                price = {{ input_per_million = 1.0, output_per_million = 2.0 }}

                [routes.flaky]
                provider = "openai"
                model = "flaky-model"
                base_url = "{flaky.base_url}"
                api_key_env = "EVAL_TEST_KEY"

                [router]
                kind = "ordered"
                order = ["good", "flaky"]
                """
            )
        )
        report = await run_eval(
            config, invoice_cases(), validators={"Invoice": Invoice}, concurrency=3
        )
        assert (good.count(), flaky.count()) == (4, 4)
    summaries = report.routes
    assert (summaries["good"].passed, summaries["flaky"].passed) == (4, 2)
    assert summaries["good"].pass_rate == 1.0 and summaries["flaky"].pass_rate == 0.5
    # The fake server reports 5 prompt and 7 completion tokens per request.
    assert (summaries["good"].input_tokens, summaries["good"].output_tokens) == (20, 28)
    assert summaries["good"].cost == pytest.approx(4 * (5 * 1.0 + 7 * 2.0) / 1_000_000)
    assert summaries["flaky"].cost is None
    for summary in summaries.values():
        assert summary.latency_p50 is not None and summary.first_update_p50 is not None
        assert summary.first_update_p50 <= summary.latency_p95  # type: ignore[operator]
    assert report.below(0.9) == ["flaky"]
    assert CANARY not in json.dumps(report.to_json())


# -- the command ---------------------------------------------------------------------------


def write_config(path: Path) -> Path:
    path.write_text(
        textwrap.dedent(
            """
            [routes.json]
            provider = "scripted"
            reply = '{"number": "A-1", "total": 3}'

            [routes.prose]
            provider = "scripted"
            reply = 'Sure! The total is 3.'

            [router]
            kind = "ordered"
            order = ["json", "prose"]
            """
        )
    )
    return path


def write_cases(path: Path) -> Path:
    lines = [
        {"id": "model", "messages": "the invoice", "expect": {"validator": "Invoice"}},
        {"id": "total", "messages": "the total", "expect": {"regex": "3"}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "eval_models.py").write_text(
        "import pydantic\n\n"
        "class Invoice(pydantic.BaseModel):\n"
        "    number: str\n"
        "    total: float\n\n"
        "MODELS = [Invoice]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_config(tmp_path / "pipeline.toml")
    write_cases(tmp_path / "cases.jsonl")
    return tmp_path


def run(*argv: str) -> int:
    return main(["eval", "--config", "pipeline.toml", "--cases", "cases.jsonl", *argv])


def test_the_command_prints_the_table_and_writes_json(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("--validators", "eval_models:MODELS", "--json", "out.json") == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:5] for line in out.splitlines()[1:3]}
    assert rows == {"json": ["2", "2", "100.0%", "0"], "prose": ["2", "1", "50.0%", "0"]}
    assert "prose  model: validator Invoice: response is not a valid Invoice" in out
    written = json.loads((project / "out.json").read_text())
    assert [r["route"] for r in written["routes"]] == ["json", "prose"]
    assert [(c["route"], c["case"], c["passed"]) for c in written["cases"]] == [
        ("json", "model", True),
        ("json", "total", True),
        ("prose", "model", False),
        ("prose", "total", True),
    ]
    assert all("text" not in c for c in written["cases"])
    assert run("--validators", "eval_models:MODELS", "--json", "out.json", "--include-text") == 0
    written = json.loads((project / "out.json").read_text())
    assert [c["text"] for c in written["cases"]][2:] == ["Sure! The total is 3."] * 2


def test_the_command_exits_1_below_the_minimum_pass_rate(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("--validators", "eval_models:MODELS", "--min-pass-rate", "0.75") == 1
    assert "below the minimum pass rate 75.0%: prose" in capsys.readouterr().err
    assert run("--validators", "eval_models:MODELS", "--min-pass-rate", "0.5") == 0
    assert (
        run("--validators", "eval_models:MODELS", "--routes", "json", "--min-pass-rate", "1") == 0
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--routes", "jsn"), "routes.jsn: is not defined; did you mean 'json'?"),
        ((), "unknown validator 'Invoice'"),
        (("--validators", "eval_models"), "expected module:attribute"),
        (("--validators", "no_such_module:X"), "cannot import 'no_such_module'"),
        (("--validators", "eval_models:NOPE"), "has no 'NOPE'"),
    ],
)
def test_the_command_exits_2_on_configuration_errors(
    project: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("configuration error: ") and message in err


def test_the_command_exits_2_on_a_missing_cases_file(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "--config", "pipeline.toml", "--cases", "missing.jsonl"]) == 2
    assert "cannot read missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ("--min-pass-rate", "2"),
        ("--min-pass-rate", "most"),
        ("--concurrency", "0"),
        ("--timeout", "-1"),
    ],
)
def test_the_command_exits_2_on_bad_arguments(project: Path, argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as caught:
        run(*argv)
    assert caught.value.code == 2


def test_progress_is_shown_on_a_terminal_only(
    project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    assert run("--validators", "eval_models:MODELS") == 0
    assert "eval:" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert run("--validators", "eval_models:MODELS") == 0
    err = capsys.readouterr().err
    assert err.count("\reval: ") == 4 and err.endswith("\reval: 4/4 requests\n")


def test_an_unwritable_json_path_is_refused_before_any_case_runs(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "out.json").write_text("previous results\n")
    for target in ("no-such-folder/out.json", "cases.jsonl/out.json", "."):
        assert run("--validators", "eval_models:MODELS", "--json", target) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no case ran: the table is printed after the last one
        assert captured.err.startswith(f"cannot write {target}: ")
    # A run that fails leaves the previous results in place, and no file it created.
    assert run("--json", "out.json") == 2
    assert (project / "out.json").read_text() == "previous results\n"
    assert run("--json", "new.json") == 2
    assert not (project / "new.json").exists()
    assert run("--validators", "eval_models:MODELS", "--json", "out.json") == 0
    assert [r["route"] for r in json.loads((project / "out.json").read_text())["routes"]] == [
        "json",
        "prose",
    ]


def test_the_command_refuses_an_endless_case_file(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "--config", "pipeline.toml", "--cases", "/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "configuration error: zero line 1: longer than 4 MiB (the limit of a case line)\n"
    )
