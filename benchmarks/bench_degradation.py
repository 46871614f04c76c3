"""Partial degradation: routers against a fleet that degrades, and against an oracle.

A fleet of three fake deployments of one model (`pipeline.testing.FakeFleet`, served by
``chat-pipeline fake-fleet`` in a process of its own) and five scenarios in which deployment
``a`` degrades (see `_degradation_scenarios.py`): 30% of its calls answer 429 with
Retry-After 1 s; its latency triples; it hangs for 15 s then recovers; a heavy latency tail
with no fault; it cuts 10% of its answers after output. Each contender (see
`_degradation_contenders.py`: chat-pipeline's configurations, LiteLLM's Router with its
latency-based and simple-shuffle strategies, and an oracle that picks at random among the
deployments the schedule leaves healthy) runs in a process of its own against a fresh fleet,
with the same open-loop arrivals: seeded exponential gaps at ``--rate`` requests/s for
``--duration`` seconds, 80% of them streamed. A request's latency draws on a deployment
depend on the request and the deployment only, so every contender meets the same fates
wherever it sends each request.

Measured per scenario and contender: success (the whole answer, right), visible failures
after output, end-to-end p50/p99 (from the time the request was due, so a client that
falls behind pays for it) over the run and over the steady state of the fault (from 2 s
after it starts to its end), time to first token of streamed requests, upstream calls per
request and a's share of the calls during the fault, requests slower than 1.15x the
oracle's p99, time to leave and to come back to a deployment (hang), client CPU per
request, and the launch lag p99 (how late the client's own event loop started requests: a
client short of CPU falls behind the arrivals, and its latency shows it). The targets
(below, `checks`) are checked against the oracle of the same run and printed PASS/MISS:
in the 429, brownout, hang and cut scenarios, steady-state p99 within 1.15x the oracle's,
at most 15 more requests than the oracle slower than 1.15x its p99, every request
answered (cuts: at most 2% visible failures), at most 1.05 upstream calls per request;
off a hung deployment within 1.5 s and back within 10 s of its recovery; with hedging, a
heavy-tail p99 at most 0.65x the oracle's for at most 1.12 calls per request; a p99 below
LiteLLM's in every scenario; CPU per request within 1.2x of today's router.

    python benchmarks/bench_degradation.py                      # everything, 60 s a run
    python benchmarks/bench_degradation.py --quick               # 20 s a run
    python benchmarks/bench_degradation.py --scenarios hang \
        --contenders oracle,chat-pipeline-ordered

The oracle always runs (the targets are relative to it). Contenders whose router or library
is missing are skipped, saying so. With ``--pin`` (two cores or more) the fleet runs on one
core and the contender on another; by default they run on any core, which a busy machine
serves better.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _degradation_contenders import BASELINE, CONTENDERS, Outcome, Unavailable, make_runner
from _degradation_scenarios import CHUNKS, DEGRADED, DEPLOYMENTS, Scenario, scenarios
from bench_peers import Child, child_env, percentile, pin

STREAMING_SHARE = 0.8
STARTUP_TIMEOUT = 300.0  # LiteLLM takes tens of seconds to import on a busy 2-core machine
REQUEST_BOUND = 30.0  # no request of any contender is waited for longer
EXPECTED = " ".join(f"w{index:02d}" for index in range(CHUNKS))
SLOW_FACTOR = 1.15  # "slower than 1.15x the oracle's p99"
LEAVE_GAP = 1.0  # a deployment is left once it goes this long without a call


def arrivals(seed: int, rate: float, duration: float) -> list[tuple[float, bool]]:
    """Open-loop arrivals: (seconds into the run, streamed?), exponential gaps at `rate`."""
    rng = random.Random(f"{seed}:arrivals")
    out: list[tuple[float, bool]] = []
    at = rng.expovariate(rate)
    for _ in range(int(rate * duration * 3) + 100):  # bounded: far more than ever needed
        if at >= duration:
            break
        out.append((at, rng.random() < STREAMING_SHARE))
        at += rng.expovariate(rate)
    return out


# -- a contender's process ------------------------------------------------------------------


async def _warm_up(runner: Any) -> None:
    """A few untagged requests before the schedule starts: imports, connections."""
    import asyncio

    for index in range(6):
        await runner.call(10_000_000 + index, index % 2 == 0, 0.0, time.monotonic())
    await asyncio.sleep(0)


async def _drive(runner: Any, plan: list[tuple[float, bool]], t0: float) -> dict[str, Any]:
    import asyncio

    rows: list[dict[str, Any]] = []

    async def one(request: int, at: float, streaming: bool) -> None:
        scheduled = t0 + at
        late = time.monotonic() - scheduled
        try:
            async with asyncio.timeout(REQUEST_BOUND):
                outcome = await runner.call(request, streaming, at, scheduled)
        except TimeoutError:
            outcome = Outcome(error="BenchmarkBound")
        e2e = time.monotonic() - scheduled
        if outcome.error is None and outcome.text != EXPECTED:
            outcome.error = "WrongAnswer"  # a cut the library did not report
            outcome.output_before_error = outcome.first_token is not None or bool(outcome.text)
        rows.append(
            {
                "request": request,
                "at": at,
                "streaming": streaming,
                "late": late,
                "first_token": outcome.first_token,
                "e2e": e2e,
                "ok": outcome.error is None,
                "error": outcome.error,
                "after_output": outcome.output_before_error,
            }
        )

    cpu = time.process_time()
    tasks = []
    for request, (at, streaming) in enumerate(plan):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request, at, streaming)))
    if tasks:
        await asyncio.wait(tasks)  # each is bounded by REQUEST_BOUND
    return {"rows": rows, "cpu": time.process_time() - cpu}


def contender_main(name: str, job_path: str, cpu: int | None) -> None:
    """A contender's process: build, warm up, say ready, run when told, answer the rows."""
    import asyncio

    pin(cpu)
    # Results go to a private copy of stdout; anything the libraries print goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    job = json.loads(Path(job_path).read_text())

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")

    with asyncio.Runner() as loop:
        try:
            runner = make_runner(name, job["urls"], job["scenario"], job["seed"])
        except Unavailable as exc:
            answer({"skip": str(exc)})
            return
        try:
            loop.run(_warm_up(runner))
            answer({"ready": True, "version": runner.version})
            command = json.loads(sys.stdin.readline() or "{}")
            if "start" in command:
                plan = arrivals(job["seed"], job["rate"], job["duration"])
                answer(loop.run(_drive(runner, plan, command["start"])))
        finally:
            loop.run(runner.aclose())


# -- the parent: one fleet and one contender at a time ------------------------------------


def _pin_child(child: Child, cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(child.process.pid, {cpu})


def _command(fleet: Child, line: str, timeout: float) -> str:
    assert fleet.process.stdin is not None
    fleet.process.stdin.write((line + "\n").encode())
    fleet.process.stdin.flush()
    return fleet.line(timeout)


def run_one(
    scenario: Scenario, name: str, args: argparse.Namespace, cpus: tuple[int | None, int | None]
) -> dict[str, Any]:
    """One contender against a fresh fleet: its rows, CPU and the fleet's call log."""
    env = child_env()
    fleet_cpu, client_cpu = cpus
    spec = scenario.fleet(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        scenario_path = Path(folder, "fleet.json")
        scenario_path.write_text(json.dumps(spec))
        fleet = Child(
            [sys.executable, "-m", "pipeline", "fake-fleet", "--scenario", str(scenario_path),
             "--manual-start"], env,
        )  # fmt: skip
        _pin_child(fleet, fleet_cpu)
        contender: Child | None = None
        try:
            urls = {}
            for _ in DEPLOYMENTS:
                _, deployment, url = fleet.line(60).split()
                urls[deployment] = url
            if fleet.line(60) != "ready":
                raise RuntimeError("the fleet did not start")
            job_path = Path(folder, "job.json")
            job = {"urls": urls, "scenario": spec, "seed": args.seed, "rate": args.rate,
                   "duration": args.duration}  # fmt: skip
            job_path.write_text(json.dumps(job))
            argv = [sys.executable, os.path.abspath(__file__), "--contender", name,
                    "--job", str(job_path)]  # fmt: skip
            if client_cpu is not None:
                argv += ["--cpu", str(client_cpu)]
            contender = Child(argv, env)
            first = json.loads(contender.line(STARTUP_TIMEOUT))
            if "skip" in first:
                return {"skip": first["skip"]}
            t0 = time.monotonic() + 1.0
            if _command(fleet, f"start {t0!r}", 30) != "started":
                raise RuntimeError("the fleet did not start its schedule")
            result = contender.ask({"start": t0}, args.duration + REQUEST_BOUND + 60)
            calls = json.loads(_command(fleet, "calls", 60))
            return {"version": first["version"], "calls": calls, **result}
        finally:
            if contender is not None:
                contender.stop()
            with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                _command(fleet, "stop", 30)
            try:
                fleet.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                fleet.process.kill()
                fleet.process.wait(timeout=10)


# -- figures ------------------------------------------------------------------------------


def _within(at: float | None, window: tuple[float, float]) -> bool:
    return at is not None and window[0] <= at < window[1]


def analyze(scenario: Scenario, result: dict[str, Any]) -> dict[str, Any]:
    rows, calls = result["rows"], result["calls"]
    requests = len(rows)
    ok = [r for r in rows if r["ok"]]
    e2e = [r["e2e"] for r in ok]
    steady = [r["e2e"] for r in ok if _within(r["at"], scenario.steady)]
    first = [r["first_token"] for r in ok if r["streaming"] and r["first_token"] is not None]
    tagged = [c for c in calls if c["request"] is not None and c["request"] < requests]
    per_deployment = {
        name: sum(1 for c in tagged if c["deployment"] == name) for name in DEPLOYMENTS
    }
    in_fault = [c for c in tagged if _within(c["at"], scenario.window)]
    figures: dict[str, Any] = {
        "requests": requests,
        "success": len(ok) / requests if requests else 0.0,
        "failed": requests - len(ok),
        "failed_after_output": sum(1 for r in rows if not r["ok"] and r["after_output"]),
        "errors": sorted({r["error"] for r in rows if r["error"]}),
        "p50": percentile(e2e, 0.50) if e2e else None,
        "p99": percentile(e2e, 0.99) if e2e else None,
        "steady_p99": percentile(steady, 0.99) if steady else None,
        "first_token_p50": percentile(first, 0.50) if first else None,
        "first_token_p99": percentile(first, 0.99) if first else None,
        "calls_per_request": len(tagged) / requests if requests else 0.0,
        "calls": per_deployment,
        "degraded_share_in_fault": (
            sum(1 for c in in_fault if c["deployment"] == DEGRADED) / len(in_fault)
            if in_fault
            else None
        ),
        "outcomes": {
            kind: sum(1 for c in tagged if c["outcome"] == kind)
            for kind in ("rate_limited", "hung", "cut", "down")
        },
        "cpu_ms_per_request": result["cpu"] / requests * 1000 if requests else 0.0,
        "late_p99": percentile([r["late"] for r in rows], 0.99) if rows else None,
        "version": result.get("version", ""),
    }
    if scenario.name == "hang":
        start, end = scenario.window
        on_degraded = sorted(c["at"] for c in tagged if c["deployment"] == DEGRADED)
        left = start
        for at in (at for at in on_degraded if start <= at < end):
            if at - left > LEAVE_GAP:
                break
            left = at
        back = next((at for at in on_degraded if at >= end), None)
        figures["left_after"] = left - start
        figures["back_after"] = None if back is None else back - end
        # Calls still sent to a once it should have been left (probes, cooldowns ending).
        figures["late_on_degraded"] = sum(1 for at in on_degraded if start + 1.5 <= at < end)
    return figures


def slow_requests(result: dict[str, Any], threshold: float) -> int:
    """Requests that failed or took longer than `threshold` seconds."""
    return sum(1 for r in result["rows"] if not r["ok"] or r["e2e"] > threshold)


def checks(
    scenario: Scenario,
    name: str,
    figures: dict[str, Any],
    oracle: dict[str, Any] | None,
    slow: int | None,
    oracle_slow: int | None,
    litellm_p99: float | None,
    baseline_cpu: float | None,
) -> list[tuple[str, str, bool]]:
    """The issue's targets for this contender in this scenario: (target, value, met)."""
    found: list[tuple[str, str, bool]] = []
    contender = CONTENDERS[name]
    p99 = figures["p99"]
    if oracle is not None and scenario.faults:
        steady, reference = figures["steady_p99"], oracle["steady_p99"]
        if steady is not None and reference:
            ratio = steady / reference
            found.append(("steady p99 <= 1.15x oracle", f"{ratio:.2f}x", ratio <= 1.15))
        if slow is not None and oracle_slow is not None:
            extra = slow - oracle_slow
            found.append(("<= 15 more slow than oracle", f"{extra:+d}", extra <= 15))
    if scenario.name == "cuts":
        share = figures["failed"] / figures["requests"]
        found.append(("visible failures <= 2%", f"{share:.1%}", share <= 0.02))
    else:
        found.append(("success 100%", f"{figures['success']:.1%}", figures["failed"] == 0))
    if scenario.faults:
        cpr = figures["calls_per_request"]
        found.append(("<= 1.05 calls/request", f"{cpr:.2f}", cpr <= 1.05))
    if scenario.name == "hang":
        left, back = figures["left_after"], figures["back_after"]
        found.append(("off a within 1.5 s", f"{left:.1f} s", left <= 1.5))
        found.append(
            ("back on a within 10 s", "never" if back is None else f"{back:.1f} s",
             back is not None and back <= 10),
        )  # fmt: skip
    if scenario.heavy_tail and contender.hedges and oracle is not None and oracle["p99"]:
        ratio = p99 / oracle["p99"] if p99 is not None else float("inf")
        found.append(("p99 <= 0.65x oracle", f"{ratio:.2f}x", ratio <= 0.65))
        cpr = figures["calls_per_request"]
        found.append(("<= 1.12 calls/request", f"{cpr:.2f}", cpr <= 1.12))
    if contender.family == "chat-pipeline" and litellm_p99 is not None and p99 is not None:
        found.append(("p99 better than LiteLLM", f"{p99:.2f} vs {litellm_p99:.2f} s",
                      p99 < litellm_p99))  # fmt: skip
    if contender.family == "chat-pipeline" and name != BASELINE and baseline_cpu:
        ratio = figures["cpu_ms_per_request"] / baseline_cpu
        found.append(("CPU <= 1.2x today's", f"{ratio:.2f}x", ratio <= 1.2))
    return found


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_scenario(
    scenario: Scenario, names: list[str], figures: dict[str, dict[str, Any]],
    slow: dict[str, int], oracle_slow: int | None,
) -> None:  # fmt: skip
    hang = scenario.name == "hang"
    oracle = figures.get("oracle")
    print(f"\n#### {scenario.title}\n")
    head = ("| contender | success | failed after output | p50 / p99 s | steady p99 s "
            "| TTFT p50 / p99 s | calls/request | a's share in fault | slower than "
            "1.15x oracle p99 | CPU ms/request | launch lag p99 s |")  # fmt: skip
    if hang:
        head += " hung on a | off a after | calls on a from 1.5 s in | back on a after |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for name in names:
        f = figures[name]
        steady = _s(f["steady_p99"])
        if oracle and oracle["steady_p99"] and f["steady_p99"] and name != "oracle":
            steady += f" ({f['steady_p99'] / oracle['steady_p99']:.2f}x)"
        share = f["degraded_share_in_fault"]
        extra = (
            "" if oracle_slow is None or name == "oracle" else f" ({slow[name] - oracle_slow:+d})"
        )
        row = (
            f"| {CONTENDERS[name].label} | {f['success']:.1%} | {f['failed_after_output']} "
            f"| {_s(f['p50'])} / {_s(f['p99'])} | {steady} "
            f"| {_s(f['first_token_p50'])} / {_s(f['first_token_p99'])} "
            f"| {f['calls_per_request']:.2f} | {'-' if share is None else f'{share:.0%}'} "
            f"| {slow.get(name, '-')}{extra} | {f['cpu_ms_per_request']:.2f} "
            f"| {_s(f['late_p99'])} |"
        )
        if hang:
            back = f["back_after"]
            row += (f" {f['outcomes']['hung']} | {f['left_after']:.1f} s | {f['late_on_degraded']} "
                    f"| {'never' if back is None else f'{back:.1f} s'} |")  # fmt: skip
        print(row)


def print_summary(reports: dict[str, dict[str, Any]]) -> None:
    """One table of every scenario and contender (the README's)."""
    print(
        "\n#### Summary\n\n| scenario | contender | success (failed after output) | p50 / p99 s "
        "| steady p99 s | TTFT p99 s | calls/request | a's share in fault | CPU ms/request "
        "| launch lag p99 s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for key, report in reports.items():
        figures = report["figures"]
        oracle = figures.get("oracle")
        for name, f in figures.items():
            steady = _s(f["steady_p99"])
            if name != "oracle" and oracle and oracle["steady_p99"] and f["steady_p99"]:
                steady += f" ({f['steady_p99'] / oracle['steady_p99']:.2f}x)"
            share = f["degraded_share_in_fault"]
            print(
                f"| {key} | {CONTENDERS[name].label} | {f['success']:.1%} "
                f"({f['failed_after_output']}) | {_s(f['p50'])} / {_s(f['p99'])} | {steady} "
                f"| {_s(f['first_token_p99'])} | {f['calls_per_request']:.2f} "
                f"| {'-' if share is None else f'{share:.0%}'} "
                f"| {f['cpu_ms_per_request']:.1f} | {_s(f['late_p99'])} |"
            )


def main(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so the fleet's and the contender's processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    two_cores = args.pin and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2
    cpus: tuple[int | None, int | None] = (1, 0) if two_cores else (None, None)
    selected = scenarios(args.duration)
    names = ["oracle"] + [n for n in args.contenders if n != "oracle"]
    plan = arrivals(args.seed, args.rate, args.duration)
    print(f"bench_degradation: {len(plan)} requests over {args.duration:g} s "
          f"({args.rate:g}/s open loop, {STREAMING_SHARE:.0%} streamed, seed {args.seed}); "
          f"Python {platform.python_version()}"
          + ("; fleet on CPU 1, each contender on CPU 0" if two_cores else "; not pinned"),
          flush=True)  # fmt: skip
    report: dict[str, Any] = {"args": vars(args), "scenarios": {}}
    all_checks: list[tuple[str, str, list[tuple[str, str, bool]]]] = []
    for key in args.scenarios:
        scenario = selected[key]
        results: dict[str, dict[str, Any]] = {}
        figures: dict[str, dict[str, Any]] = {}
        for name in names:
            started = time.monotonic()
            result = run_one(scenario, name, args, cpus)
            if "skip" in result:
                print(f"  {scenario.name}: {CONTENDERS[name].label}: skipped ({result['skip']})")
                continue
            results[name] = result
            figures[name] = analyze(scenario, result)
            f = figures[name]
            f["load"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            print(f"  {scenario.name}: {CONTENDERS[name].label} ({f['version']}): "
                  f"{f['success']:.1%} ok, p99 {_s(f['p99'])} s, "
                  f"{f['calls_per_request']:.2f} calls/request "
                  f"[{time.monotonic() - started:.0f} s, load average {_s(f['load'])}]",
                  flush=True)  # fmt: skip
        ran = [n for n in names if n in figures]
        oracle = figures.get("oracle")
        threshold = SLOW_FACTOR * oracle["p99"] if oracle and oracle["p99"] else None
        slow = {n: slow_requests(results[n], threshold) for n in ran} if threshold else {}
        oracle_slow = slow.get("oracle")
        litellm = [
            figures[n]["p99"]
            for n in ran
            if CONTENDERS[n].family == "litellm" and figures[n]["p99"] is not None
        ]
        baseline_cpu = figures[BASELINE]["cpu_ms_per_request"] if BASELINE in figures else None
        print_scenario(scenario, ran, figures, slow, oracle_slow)
        for name in ran:
            if name == "oracle":
                continue
            found = checks(scenario, name, figures[name], oracle, slow.get(name), oracle_slow,
                           min(litellm) if litellm else None, baseline_cpu)  # fmt: skip
            all_checks.append((scenario.name, name, found))
        report["scenarios"][key] = {
            "title": scenario.title,
            "window": scenario.window,
            "figures": figures,
            "slow": slow,
        }
    print_summary(report["scenarios"])
    print("\n#### Targets (against the oracle of the same run)\n")
    print("| scenario | contender | checks |\n|---|---|---|")
    for scenario_name, name, found in all_checks:
        text = "; ".join(f"{target}: {value} {'PASS' if met else 'MISS'}"
                         for target, value, met in found)  # fmt: skip
        print(f"| {scenario_name} | {CONTENDERS[name].label} | {text} |")
    if args.json:
        report["checks"] = [
            {"scenario": s, "contender": n, "checks": [list(c) for c in found]}
            for s, n, found in all_checks
        ]
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")
    return 0


def _names(text: str, known: list[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what}: {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}"
        )
    return names


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    scenario_names = list(scenarios(60.0))
    default_contenders = ["chat-pipeline-ordered", "chat-pipeline-balanced",
                          "chat-pipeline-hedged", "litellm-latency", "litellm-shuffle"]  # fmt: skip
    parser.add_argument(
        "--scenarios",
        default=",".join(scenario_names),
        type=lambda t: _names(t, scenario_names, "scenario"),
        help=f"comma-separated (default: all: {','.join(scenario_names)})",
    )
    parser.add_argument(
        "--contenders",
        default=",".join(default_contenders),
        type=lambda t: _names(t, list(CONTENDERS), "contender"),
        help=f"comma-separated (default: all but the oracle, which always runs; "
        f"known: {','.join(CONTENDERS)})",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds a run (60)")
    parser.add_argument("--rate", type=float, default=30.0, help="requests/s (30)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="20 s a run")
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON to OUT")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the fleet on core 1, the contender on core 0 (default: any core; on a busy "
        "machine a pinned contender falls behind sooner)",
    )
    parser.add_argument(
        "--summary", metavar="JSON", help="print the summary table of an earlier --json run"
    )
    parser.add_argument("--contender", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.contender is not None:
        contender_main(parsed.contender, parsed.job, parsed.cpu)
        sys.exit(0)
    if parsed.summary is not None:
        print_summary(json.loads(Path(parsed.summary).read_text())["scenarios"])
        sys.exit(0)
    if parsed.quick:
        parsed.duration = 20.0
    if not (4 <= parsed.duration <= 3600) or not (0 < parsed.rate <= 500):
        parser.error("--duration must be 4..3600 seconds and --rate 0..500 requests/s")
    sys.exit(main(parsed))
