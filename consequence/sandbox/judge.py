"""Run a test PROGRAM (``check(candidate)``, HumanEval style) against untrusted code.

Two confined processes (see :mod:`consequence.sandbox.hardening`, :mod:`consequence.sandbox.zygote`), never one:

- the CANDIDATE process executes the model's code and serves calls of its entry point:
  it reads ``{"a": args, "k": kwargs}`` frames on stdin, answers ``{"r": result}`` or
  ``{"x": "ExcType: message"}`` on stdout, one JSON line each;
- the JUDGE process executes the trusted ``setup`` and ``check`` sources and calls
  ``check(candidate)`` where ``candidate`` is a proxy that sends the arguments to the
  candidate process and DECODES the answer into fresh built-in values (int, float, bool,
  str, bytes, None, complex, list, tuple, dict, set, frozenset). It prints one verdict
  line prefixed by a random nonce that only the parent and the judge know.

So the candidate cannot return an object whose ``__eq__`` lies (it can only send data),
cannot see the tests or the nonce (another process; Landlock scopes signals, seccomp
blocks ptrace), and cannot write the verdict (the judge's stdout is a file it has no
descriptor for). Anything unexpected from the candidate (exit, garbage, an oversize
frame, a non-plain value) fails the check even if ``check`` swallows the exception.
The parent decides from the judge's exit status and its last nonce line only.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence

from consequence.sandbox.cases import TestCase, TestProgram
from consequence.sandbox.hardening import child_config
from consequence.sandbox.judge_children import CANDIDATE, CODEC, JUDGE
from consequence.sandbox.sandbox import (
    ReportCache,
    SandboxLimits,
    TestReport,
    exchange,
    kill_group,
    spawn_child,
    tagged_messages,
)

__all__ = ["PROGRAM_LIMITS", "run_program", "run_cases", "clear_cache", "CODEC", "CANDIDATE", "JUDGE"]

# HumanEval's own harness allows 3 s per problem; a few official checks make ~100 calls,
# each one round trip between the two processes (~50 us), so 6 s wall is generous.
PROGRAM_LIMITS = SandboxLimits(wall_s=6.0, cpu_s=4, memory_mb=512)
MAX_FRAME_BYTES = 4 << 20  # one answer of the candidate; larger is a hard failure

_CACHE = ReportCache()


def clear_cache() -> None:
    """Forget all cached reports."""
    _CACHE.clear()


def _spawn(code: str, job: dict, lim: SandboxLimits, work: str, out, nonce: str):
    """Start candidate and judge wired by two pipes; returns (candidate, judge, judge's
    stdin, payload)."""
    req_r, req_w = os.pipe()  # judge -> candidate
    resp_r, resp_w = os.pipe()  # candidate -> judge
    in_r, in_w = os.pipe()  # parent -> judge
    cfg = child_config(lim.cpu_s, lim.memory_mb, lim.max_output_bytes)
    cand = judge = None
    try:
        for d in ("candidate", "judge"):
            os.mkdir(os.path.join(work, d))
        cand, _ = spawn_child(
            "candidate", cfg, os.path.join(work, "candidate"), req_r, resp_w, argv=[str(MAX_FRAME_BYTES)]
        )
        judge, (req_fd, resp_fd) = spawn_child(
            "judge", cfg, os.path.join(work, "judge"), in_r, out.fileno(), extra=[req_w, resp_r]
        )
    except OSError:
        kill_group(cand)
        os.close(in_w)
        raise
    finally:
        for fd in (req_r, req_w, resp_r, resp_w, in_r):
            os.close(fd)  # only the children hold the pipe ends now (EOF when one dies)
    payload = json.dumps(
        {**job, "nonce": nonce, "code": code, "req_fd": req_fd, "resp_fd": resp_fd, "cap": MAX_FRAME_BYTES}
    ).encode()
    return cand, judge, os.fdopen(in_w, "wb", buffering=0), payload


def _run(code: str, job: dict, n: int, lim: SandboxLimits) -> TestReport:
    """One judged run; ``n`` = number of tests reported (1 for a program)."""
    nonce = "@@" + secrets.token_hex(16) + "@@"
    with tempfile.TemporaryDirectory(prefix="judge-") as work, tempfile.TemporaryFile() as out:
        try:
            cand, judge, stdin, payload = _spawn(code, job, lim, work, out, nonce)
        except OSError as e:
            return TestReport("sandbox_error", 0, n, [], f"cannot spawn: {e}")
        try:
            _, stop = exchange(judge, stdin, None, payload, 0, time.monotonic() + lim.wall_s)
            cpu_out = stop != "timeout" and _cpu_limit_ended(cand)
        finally:
            stdin.close()
            kill_group(judge)
            kill_group(cand)
        out.seek(0)
        raw = out.read(MAX_FRAME_BYTES)
    return _report(*tagged_messages(raw, nonce), stop == "timeout" or cpu_out, judge.returncode, n, lim)


def _cpu_limit_ended(cand) -> bool:
    """Whether the kernel ended the candidate at its CPU limit (SIGXCPU at the soft limit, SIGKILL
    at the hard one) before the judge finished: the judge then saw "no answer", but the code ran
    out of time, as when the wall clock ends it first (which of the two comes first is a race
    for a loop that spins at full speed). The judge has exited, so a live candidate gets EOF and
    exits at once; the short wait only lets its exit be reaped."""
    try:
        code = cand.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return False
    return code in (-signal.SIGXCPU, -signal.SIGKILL)


def _report(
    started: bool, verdict: dict | None, timed_out: bool, rc: int | None, n: int, lim: SandboxLimits
) -> TestReport:
    if rc is None:  # the fork server died with the judge: its end is unknown, not the code's fault
        return TestReport("sandbox_error", 0, n, [], "the sandbox fork server ended during the run")
    if not started:
        return TestReport(
            "sandbox_error",
            0,
            n,
            [],
            "judge did not start" + (" within the wall limit" if timed_out else f" (exit code {rc})"),
        )
    if verdict is not None and "judge_error" in verdict:
        return TestReport("sandbox_error", 0, n, [], str(verdict["judge_error"]))
    if timed_out:
        why = f"timeout after {lim.wall_s:g} s"
        return TestReport("timeout", 0, n, [why] * n, why)
    if verdict is not None and "results" in verdict:  # test-case mode
        res = verdict["results"]
        if rc != 0 or not isinstance(res, list) or len(res) != n:
            why = f"judge exited with code {rc} without a verdict"
            return TestReport("crash", 0, n, [why] * n, why)
        passed = sum(1 for r in res if r is True)
        msgs = [str(m) for m in verdict.get("messages", [])][: n - passed]
        err = verdict.get("error")
        return TestReport("ok", passed, n, msgs, str(err) if err is not None else None)
    if verdict is None or rc != 0 or type(verdict.get("passed")) is not bool:
        why = f"judge exited with code {rc} without a verdict"
        return TestReport("crash", 0, n, [why] * n, why)
    if verdict["passed"]:
        return TestReport("ok", 1, 1, [], None)
    return TestReport("ok", 0, 1, [str(verdict.get("message"))], None)


def _cached_run(key_parts: list, code: str, job: dict, n: int, lim: SandboxLimits, cache: bool) -> TestReport:
    return _CACHE.run([code, key_parts, list(vars(lim).values())], lambda: _run(code, job, n, lim), cache)


def run_program(
    code: str, program: TestProgram, limits: SandboxLimits = PROGRAM_LIMITS, cache: bool = True
) -> TestReport:
    """Score ``code`` with ``program.check`` (see module docstring for the two processes).

    Returns a :class:`TestReport` with ``total == 1``: ``passed == 1`` iff ``check``
    returned normally and the candidate never misbehaved. ``status``: ``'ok'``,
    ``'timeout'`` (wall or CPU limit; candidate or check too slow), ``'crash'`` (the judge died
    without a verdict), ``'sandbox_error'`` (cannot spawn, or the TEST program itself
    failed to load or passed an argument that is not plain data: exclude, never score).
    Never raises for bad candidate code. Cached like :func:`sandbox.run_tests`.
    Typical cost: two forks of the fork server, ~10 ms of CPU (~55 ms with fresh
    interpreters), plus the check's calls.
    """
    job = {"mode": "program", "entry": program.entry_point, "setup": program.setup, "check": program.check}
    return _cached_run(["program", program.check, program.setup, program.entry_point], code, job, 1, limits, cache)


def _called_names(calls: Sequence[str]) -> list[str]:
    """Names the test calls load that are not builtins: served by the candidate."""
    import builtins

    names: dict[str, None] = {}
    for call in calls:
        try:
            tree = ast.parse(call, mode="eval")
        except SyntaxError:
            continue  # the judge reports the SyntaxError for this test
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and not hasattr(builtins, node.id):
                names[node.id] = None
    return list(names)


def run_cases(
    code: str, tests: Sequence[TestCase], limits: SandboxLimits = SandboxLimits(), cache: bool = True
) -> TestReport:
    """Score ``code`` on ``TestCase`` tests with the two-process judge.

    Same semantics and report shape as :func:`consequence.sandbox.sandbox.run_tests` (a test
    passes iff the ``repr`` of the call's plain result equals ``expected``), but the call
    is evaluated in the judge with every non-builtin name it uses proxied to the candidate
    process, so the verdict cannot be forged from inside the candidate. Use this (not
    ``run_tests``) for anything that becomes a reward or a score.
    """
    job = {
        "mode": "cases",
        "cases": [[t.call, t.expected] for t in tests],
        "names": _called_names([t.call for t in tests]),
    }
    return _cached_run(["cases", job["cases"]], code, job, len(tests), limits, cache)
