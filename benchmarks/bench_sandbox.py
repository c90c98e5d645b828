"""Sandbox throughput: runs per second of ``run_tests`` and of the judge, against the floor.

Rows (each run is sequential unless ``threads`` > 1; caches off, so every run starts fresh
interpreters):

- floor: ``python -I -S -c pass`` started with ``subprocess.run`` (no limits, no confinement);
- floor + netns: the same behind the sandbox's network-namespace prefix (``unshare``), when active;
- ``run_tests``: the visible-test runner (one hardened interpreter per run);
- judge ``run_cases`` / ``run_program``: the reward path (two hardened interpreters per run);
- pool: a pre-started pool of fresh, single-use interpreters for ``run_tests``. Each child
  is started with the sandbox's exact argv, empty environment, own session and temporary
  working directory, and hardens itself (rlimits, capabilities, Landlock, seccomp, network
  namespace) before it reads anything; it serves one run and is killed as a group. The pool
  only moves the start before the request. Before timing it, the script checks that a set
  of probe programs (fork, exec, socket, file read/write outside, chmod, signal to the
  parent, CPU and memory bombs) gets the same report from the pool as from ``run_tests``.

The pool is measured here and not shipped: its gain is latency (a start hidden behind other
work), not CPU; see the verdict the script prints.

Run: ``.venv/bin/python benchmarks/bench_sandbox.py [--runs 40]`` (about 30 s on 2 cores).
Writes ``benchmarks/results/sandbox.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from consequence.envs import judge, sandbox
from consequence.envs.hardening import child_config
from consequence.envs.sandbox import SandboxLimits, TestReport, isolation_report, network_isolation
from consequence.tasks.repair import TestCase, TestProgram

CODE = "def add(a, b):\n    return a + b\n"
TESTS = [TestCase("add(1, 2)", "3"), TestCase("add(-1, 1)", "0"), TestCase("add(2, 2)", "4")]
PROGRAM = TestProgram(entry_point="add", setup="",
                      check="def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n")

PROBE_CODE = r'''
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
'''
PROBES = ["fork", "exec", "socket", "read_outside", "write_cwd", "write_tmp", "chmod", "signal_parent",
          "env", "cwd", "memory"]


class PrestartedPool:
    """Fresh single-use sandbox interpreters started ahead of the request (prototype).

    ``size`` children wait, already hardened, blocked on reading stdin; ``run`` takes one,
    sends the request (new nonce), reads the capped reply until the wall limit counted
    from the request, kills the child's group and starts a replacement in the background.
    """

    def __init__(self, size: int, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits
        self.cfg = child_config(limits.cpu_s, limits.memory_mb, limits.max_output_bytes)
        self.ready: queue.Queue = queue.Queue()
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="pool-spawn")
        for _ in range(size):
            self.spawner.submit(self._spawn)

    def _spawn(self) -> None:
        work = tempfile.mkdtemp(prefix="sbx-")
        cwd = os.path.join(work, "cwd")
        os.mkdir(cwd)
        proc = subprocess.Popen([*network_isolation(), sys.executable, "-I", "-S", "-c", sandbox.RUNNER, self.cfg],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                cwd=cwd, env={}, start_new_session=True, close_fds=True)
        self.ready.put((proc, work))

    def run(self, code: str, tests: list[TestCase]) -> TestReport:
        proc, work = self.ready.get()
        self.spawner.submit(self._spawn)
        lim, n = self.limits, len(tests)
        nonce = "@@" + secrets.token_hex(16) + "@@"
        payload = json.dumps({"nonce": nonce, "code": code, "cap": lim.max_output_bytes,
                              "tests": [[t.call, t.expected] for t in tests]}).encode()
        try:
            raw, stop = sandbox._exchange(proc, payload, lim.max_output_bytes + 4096, time.monotonic() + lim.wall_s)
        finally:
            sandbox.kill_group(proc)
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()
            subprocess.run(["rm", "-rf", work])
        started, res = sandbox.tagged_messages(raw, nonce)
        if not started:
            return TestReport("sandbox_error", 0, n, [], "runner did not start")
        if stop == "timeout" or proc.returncode == -signal.SIGXCPU:  # as sandbox._run maps them
            return TestReport("timeout", 0, n, [], "timeout")
        if res is None or "results" not in res or proc.returncode != 0:
            return TestReport("crash", 0, n, [], f"exit {proc.returncode}")
        return TestReport("ok", sum(r is True for r in res["results"]), n, list(res.get("messages", [])),
                          res.get("error"))

    def close(self) -> None:
        self.spawner.shutdown(wait=True)
        while not self.ready.empty():
            proc, work = self.ready.get()
            sandbox.kill_group(proc)
            subprocess.run(["rm", "-rf", work])


def _rate(fn, runs: int, threads: int = 1) -> float:
    """Runs per second of ``fn()`` over ``runs`` calls on ``threads`` threads."""
    fn()  # warm: probes, imports
    t0 = time.perf_counter()
    if threads == 1:
        for _ in range(runs):
            fn()
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda _: fn(), range(runs)))
    return runs / (time.perf_counter() - t0)


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sandbox.json"))
    args = ap.parse_args()
    iso = isolation_report()
    net = network_isolation()
    rows: list[tuple[str, int, float]] = []

    def floor(prefix=()):
        subprocess.run([*prefix, sys.executable, "-I", "-S", "-c", "pass"], env={}, check=True)

    rows.append(("floor: python -I -S -c pass", 1, _rate(floor, args.runs)))
    if net:
        rows.append(("floor + network namespace (unshare)", 1, _rate(lambda: floor(net), args.runs)))
    for threads in (1, 2, 4):
        rows.append(("sandbox.run_tests", threads,
                     _rate(lambda: _check(sandbox.run_tests(CODE, TESTS, cache=False), 3), args.runs, threads)))
    for threads in (1, 2):
        rows.append(("judge.run_cases (reward path, repair tasks)", threads,
                     _rate(lambda: _check(judge.run_cases(CODE, TESTS, cache=False), 3), args.runs, threads)))
    rows.append(("judge.run_program (reward path, HumanEval)", 1,
                 _rate(lambda: _check(judge.run_program(CODE, PROGRAM, cache=False), 1), args.runs)))

    plain = probe_reports(lambda c, t: sandbox.run_tests(c, t, cache=False))
    pool = PrestartedPool(2)
    try:
        pooled = probe_reports(pool.run)
        same = {k: plain[k] == pooled[k] for k in plain}
        for threads in (1, 2):
            rows.append((f"pre-started pool (2 ready) for run_tests", threads,
                         _rate(lambda: _check(pool.run(CODE, TESTS), 3), args.runs, threads)))
    finally:
        pool.close()
    base = rows[0][2]
    print(f"isolation: {json.dumps(iso)}")
    print(f"host: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print("\n| what | threads | runs/s | × floor |\n|---|---|---|---|")
    for name, threads, rate in rows:
        print(f"| {name} | {threads} | {rate:.1f} | {rate / base:.2f} |")
    print("\nprobe programs, run_tests vs pool (identical report = same layers in force):")
    for k in plain:
        print(f"  {k:14s} {'same' if same[k] else 'DIFFERENT'}: {plain[k]}" + ("" if same[k] else f" / pool: {pooled[k]}"))
    def rate(prefix, threads):
        return next(r for n, t, r in rows if n.startswith(prefix) and t == threads)

    rt1, rt2, rt4 = rate("sandbox.run_tests", 1), rate("sandbox.run_tests", 2), rate("sandbox.run_tests", 4)
    p1, p2 = rate("pre-started", 1), rate("pre-started", 2)
    layers_kept = all(same.values())
    verdict = ("the pool keeps every layer (same argv, environment, session, working directory and "
               "hardening; each child serves one run; the probe programs get identical reports). " if layers_kept else
               "the pool did NOT give the same reports as run_tests, so it does not keep the layers and is not used. ")
    verdict += (f"One caller: {p1 / rt1:.2f}× run_tests (the next start overlaps the current run); two callers: "
                f"{p2 / rt2:.2f}× run_tests on 2 threads ({p2 / rt4:.2f}× run_tests on 4 threads). Starting a hardened "
                "interpreter costs the same CPU either way (the floor rows), so the pool saves no CPU; it hides a start "
                "behind the previous run. Not shipped: evaluation already runs sandbox calls on worker threads while "
                "the model samples, the reward path it waits on is the two-process judge (a pool there must pre-wire "
                "candidate/judge pairs), and idle pre-started children would sit beside every run, where the "
                "hostile-corpus checks expect no process to outlive a run.")
    print("\nverdict: " + verdict)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "meta": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "runs": args.runs, "isolation": iso, "load_avg_1min": os.getloadavg()[0]},
        "results": [{"what": n, "threads": t, "runs_per_s": round(r, 2), "x_floor": round(r / base, 3)}
                    for n, t, r in rows],
        "pool_probe_reports": {"run_tests": plain, "pool": pooled, "same": same},
        "pool_keeps_layers": layers_kept, "verdict": verdict}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
