"""Sandbox throughput and CPU per run: fresh interpreters against the fork server.

Rows (each run is sequential unless ``threads`` > 1; caches off, so every run starts new
sandbox children), for both ways children start (``CONSEQUENCE_SANDBOX_START``):

- floor: ``python -I -S -c pass`` started with ``subprocess.run`` (no limits, no confinement);
- floor + netns: the same behind the sandbox's network-namespace prefix (``unshare``), when active;
- ``run_tests``: the visible-test runner (one confined child per run);
- judge ``run_cases`` / ``run_program``: the reward path (two confined children per run);

in ``fresh`` mode (a new ``python -I -S`` per child, the sandbox before the fork server) and
``fork-server`` mode (:mod:`consequence.sandbox.zygote`: one clean interpreter forks each child,
which confines itself before it reads anything). CPU ms per run counts this process, its
reaped children and, in fork-server mode, the zygote and the children it reaped
(``/proc/PID/stat``). Before timing, a set of probe programs (fork, exec, socket, file
read / write outside, chmod, signal to the parent, environment, working directory, CPU and
memory bombs) must get identical reports in both modes: the same layers in force.

Run: ``.venv/bin/python benchmarks/bench_sandbox.py [--runs 40]`` (about 40 s on 2 cores).
Writes ``benchmarks/results/sandbox.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from consequence.envs.repair.problems import TestCase, TestProgram
from consequence.sandbox import judge, sandbox
from consequence.sandbox.sandbox import TestReport, isolation_report, network_isolation

CODE = "def add(a, b):\n    return a + b\n"
TESTS = [TestCase("add(1, 2)", "3"), TestCase("add(-1, 1)", "0"), TestCase("add(2, 2)", "4")]
PROGRAM = TestProgram(
    entry_point="add",
    setup="",
    check="def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n",
)

PROBE_CODE = r"""
import os
def probe(kind):
    try:
        if kind == "fork":
            pid = os.fork()
            if pid == 0:
                os._exit(0)
        elif kind == "exec":
            os.execv("/bin/true", ["true"])
        elif kind == "socket":
            import socket
            socket.socket()
        elif kind == "read_outside":
            open("/etc/hostname").read()
        elif kind == "write_cwd":
            open("x", "w").write("x")
        elif kind == "write_tmp":
            open("/tmp/sbx-pool-probe", "w").write("x")
        elif kind == "chmod":
            os.chmod(".", 0o777)
        elif kind == "signal_parent":
            os.kill(os.getppid(), 0)
        elif kind == "env":
            return "env " + str(len(os.environ))
        elif kind == "cwd":
            return "cwd files " + str(len(os.listdir(".")))
        elif kind == "memory":
            x = bytearray(1 << 30)
        elif kind == "cpu":
            while True:
                pass
        return "allowed"
    except BaseException as e:
        return "denied " + type(e).__name__
"""
PROBES = [
    "fork",
    "exec",
    "socket",
    "read_outside",
    "write_cwd",
    "write_tmp",
    "chmod",
    "signal_parent",
    "env",
    "cwd",
    "memory",
]


def _check(report: TestReport, passed: int) -> TestReport:
    if report.status != "ok" or report.passed != passed:
        raise SystemExit(f"benchmark run failed: {report}")
    return report


def probe_reports(run) -> dict[str, str]:
    """What each probe program got: the test's message (or the run's status)."""
    out = {}
    for kind in PROBES + ["cpu"]:
        r = run(PROBE_CODE, [TestCase(f"probe({kind!r})", "'never'")])
        out[kind] = r.messages[0] if r.status == "ok" and r.messages else r.status
    return out


def _cpu_s() -> float:
    """CPU seconds of this process, its reaped children, and the fork server with its reaped children."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    proc = sandbox._fork_server()._proc
    if proc is not None and proc.poll() is None:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return total


def _measure(fn, runs: int, threads: int = 1) -> tuple[float, float]:
    """(runs per second, CPU ms per run) of ``fn()`` over ``runs`` calls on ``threads`` threads."""
    fn()  # warm: probes, imports, the fork server
    c0, t0 = _cpu_s(), time.perf_counter()
    if threads == 1:
        for _ in range(runs):
            fn()
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda _: fn(), range(runs)))
    wall = time.perf_counter() - t0
    return runs / wall, (_cpu_s() - c0) / runs * 1000


def _set_mode(mode: str) -> None:
    os.environ["CONSEQUENCE_SANDBOX_START"] = mode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sandbox.json"))
    args = ap.parse_args()
    iso = isolation_report()
    net = network_isolation()
    rows: list[tuple[str, str, int, float, float]] = []

    def floor(prefix=()):
        subprocess.run([*prefix, sys.executable, "-I", "-S", "-c", "pass"], env={}, check=True)

    rows.append(("floor: python -I -S -c pass", "-", 1, *_measure(floor, args.runs)))
    if net:
        rows.append(("floor + network namespace (unshare)", "-", 1, *_measure(lambda: floor(net), args.runs)))
    reports = {}
    for mode in ("fresh", "fork-server"):
        _set_mode(mode)
        reports[mode] = probe_reports(lambda c, t: sandbox.run_tests(c, t, cache=False))
        for threads in (1, 2):
            rows.append(
                (
                    "sandbox.run_tests",
                    mode,
                    threads,
                    *_measure(lambda: _check(sandbox.run_tests(CODE, TESTS, cache=False), 3), args.runs, threads),
                )
            )
        for threads in (1, 2):
            rows.append(
                (
                    "judge.run_cases (reward path, repair tasks)",
                    mode,
                    threads,
                    *_measure(lambda: _check(judge.run_cases(CODE, TESTS, cache=False), 3), args.runs, threads),
                )
            )
        rows.append(
            (
                "judge.run_program (reward path, HumanEval)",
                mode,
                1,
                *_measure(lambda: _check(judge.run_program(CODE, PROGRAM, cache=False), 1), args.runs),
            )
        )
    _set_mode("fork-server")
    same = {k: reports["fresh"][k] == reports["fork-server"][k] for k in reports["fresh"]}
    base = rows[0][3]
    print(f"isolation: {json.dumps(iso)}")
    print(f"host: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print("\n| what | children start | threads | runs/s | × floor | CPU ms / run |\n|---|---|---|---|---|---|")
    for name, mode, threads, rate, cpu in rows:
        print(f"| {name} | {mode} | {threads} | {rate:.1f} | {rate / base:.2f} | {cpu:.1f} |")
    print("\nprobe programs, fresh vs fork server (identical report = same layers in force):")
    for k in same:
        print(
            f"  {k:14s} {'same' if same[k] else 'DIFFERENT'}: {reports['fresh'][k]}"
            + ("" if same[k] else f" / fork server: {reports['fork-server'][k]}")
        )
    speed: dict[str, dict[str, tuple[float, float]]] = {}
    for name, mode, threads, rate, cpu in rows:
        if mode != "-":
            speed.setdefault(f"{name}, {threads} thread(s)", {})[mode] = (rate, cpu)
    ratios = {
        k: {"runs_per_s": v["fork-server"][0] / v["fresh"][0], "cpu_per_run": v["fresh"][1] / v["fork-server"][1]}
        for k, v in speed.items()
    }
    print(
        "\nfork server vs fresh: "
        + "; ".join(f"{k}: {r['runs_per_s']:.2f}× runs/s, {r['cpu_per_run']:.2f}× less CPU" for k, r in ratios.items())
    )
    if not all(same.values()):
        raise SystemExit("the fork server's children did not get the same probe reports as fresh interpreters")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "meta": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "runs": args.runs,
                    "isolation": iso,
                    "load_avg_1min": os.getloadavg()[0],
                },
                "results": [
                    {
                        "what": n,
                        "children_start": m,
                        "threads": t,
                        "runs_per_s": round(r, 2),
                        "x_floor": round(r / base, 3),
                        "cpu_ms_per_run": round(c, 2),
                    }
                    for n, m, t, r, c in rows
                ],
                "fork_server_vs_fresh": ratios,
                "probe_reports": reports,
                "probe_reports_same": same,
            },
            indent=1,
        )
    )
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
