"""Run untrusted model-written code against tests in a fresh, limited interpreter.

The child runs ``RUNNER`` (forked by the fork server of :mod:`consequence.sandbox.zygote`, or
``python -I -S -c RUNNER`` with ``CONSEQUENCE_SANDBOX_START=fresh``) with an empty
environment, a new session (killed on wall timeout), its own empty network namespace where
the host allows one, a fresh temporary cwd deleted afterwards, and resource
limits (CPU, address space, file size, open files, processes) plus the kernel confinement
of :mod:`consequence.sandbox.hardening` (no capabilities, Landlock, seccomp; whichever this
host supports), applied by the runner itself before any candidate code is read. Code and
tests arrive on stdin as JSON; the child prints one result line prefixed by a random
nonce; the parent takes the LAST nonce line and decides pass/fail from that plain data.
Candidate prints go to a capped buffer; the runner's stdout is a pipe the parent reads at
most ``max_output_bytes`` (+4 KiB) from, so output beyond that ends the run as a crash.

Limit: candidate and runner share one interpreter, so candidate code can read the
runner's frame (the tests, the nonce) and print a forged result line. Use
:func:`run_tests` for feedback the policy sees (visible tests); every reward or score
goes through :mod:`consequence.sandbox.judge` (``run_cases`` / ``run_program``), whose
verdict comes from a process the candidate cannot reach.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import secrets
import select
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import BinaryIO

from consequence.sandbox.cases import TestCase
from consequence.sandbox.hardening import PRELUDE, child_config, layers_report
from consequence.sandbox.zygote import Child, ForkServer

__all__ = ["SandboxLimits", "TestReport", "run_tests", "clear_cache", "RUNNER", "ENV_RETRIES", "with_retries"]

# A sandbox that cannot start is re-run up to this many more times (so at most 3 runs) before
# the episode becomes an env_error. A retry re-runs the same deterministic check on the same
# code; it never samples the policy again. Only ``sandbox_error`` is retried: a timeout or a
# crash is the candidate's own result and would repeat.
ENV_RETRIES = 2


@dataclass(frozen=True)
class SandboxLimits:
    """wall_s: wall-clock seconds for the whole run; cpu_s: CPU seconds; memory_mb:
    address-space limit in MiB; max_output_bytes: cap on bytes read back / written."""

    wall_s: float = 2.0
    cpu_s: int = 2
    memory_mb: int = 512
    max_output_bytes: int = 65536


@dataclass
class TestReport:
    """Outcome of one sandbox run.

    status: ``'ok'`` (runner finished; tests may still fail), ``'timeout'`` (wall or CPU
    limit hit: all tests failed), ``'crash'`` (child died or printed no result: all tests
    failed), ``'sandbox_error'`` (the sandbox itself failed: exclude, never score 0).
    messages: one line per failing test, in test order. error: load error / crash reason.
    attempts: sandbox runs this report took (> 1 only after :func:`with_retries` retried).
    """

    __test__ = False
    status: str
    passed: int
    total: int
    messages: list[str] = field(default_factory=list)
    error: str | None = None
    attempts: int = 1

    @property
    def all_passed(self) -> bool:
        return self.status == "ok" and self.total > 0 and self.passed == self.total


RUNNER = (
    PRELUDE
    + r"""
_w, _dumps, _exit, _repr, _type = os.write, json.dumps, os._exit, repr, type
def _main():
    data = json.loads(sys.stdin.read())
    nonce, code, tests, cap = data["nonce"], data["code"], data["tests"], data["cap"]
    del data
    def emit(obj):
        _w(1, ("\n" + nonce + _dumps(obj) + "\n").encode())
    emit({"stage": "loaded"})
    ok_types = (int, float, bool, str, list, tuple, dict, type(None))
    def plain(v, depth=0):
        t = _type(v)
        if depth > 20 or t not in ok_types:
            return False
        if t in (list, tuple):
            return all(plain(e, depth + 1) for e in v)
        if t is dict:
            return all(plain(k, depth + 1) and plain(e, depth + 1) for k, e in v.items())
        return True
    class Sink:
        n = 0
        def write(self, s):
            Sink.n += len(s)
            return len(s)
        def flush(self):
            pass
    sys.stdout = sys.stderr = Sink()
    def short(s):
        s = str(s)
        return s if len(s) <= 80 else s[:77] + "..."
    results, msgs, error = [], [], None
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), ns)
    except BaseException as e:
        error = _type(e).__name__ + ": " + short(e)
    for call, expected in tests:
        if error is not None:
            results.append(False); msgs.append(call + " not run: " + error); continue
        try:
            res = eval(call, ns)
            good = plain(res) and _repr(res) == expected
            if not good:
                try:
                    shown = short(_repr(res)) if plain(res) else "a " + short(_type(res).__name__)
                except BaseException:
                    shown = "an unprintable value"
                msgs.append(call + " returned " + shown + ", expected " + expected)
        except BaseException as e:
            good = False
            msgs.append(call + " raised " + _type(e).__name__ + ": " + short(e))
        results.append(bool(good))
    emit({"results": results, "messages": msgs[:64], "error": error})
    _exit(0)
if __name__ == "__main__":  # a fresh interpreter; the fork server calls _apply and _main itself
    _harden(json.loads(sys.argv[1]))
    _main()
"""
)


class ReportCache:
    """Thread-safe LRU of reports keyed by the sha256 of their inputs (code, tests, limits).

    A ``sandbox_error`` is never stored: it says nothing about the code and is retried.
    Hits and stored entries are copies, so a caller may edit the report it gets.
    """

    def __init__(self, max_entries: int = 4096):
        self._entries: OrderedDict[str, TestReport] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def run(self, key_parts: list, run: Callable[[], TestReport], use: bool = True) -> TestReport:
        """The cached report for ``key_parts`` (JSON-serialisable), else ``run()``, stored."""
        if not use:
            return run()
        key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return _copy(hit)
        report = run()
        if report.status != "sandbox_error":
            with self._lock:
                self._entries[key] = _copy(report)
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
        return report


def _copy(r: TestReport) -> TestReport:
    return TestReport(r.status, r.passed, r.total, list(r.messages), r.error)


_CACHE = ReportCache()


def clear_cache() -> None:
    """Forget all cached reports."""
    _CACHE.clear()


def kill_group(proc: subprocess.Popen | Child | None) -> None:
    """SIGKILL a child's whole process group (it runs in its own session) and reap it."""
    if proc is None:
        return
    if isinstance(proc, Child):
        proc.kill()
        proc.wait()
        proc.close()
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start_mode() -> str:
    """How sandbox children start: ``"fork-server"`` (default; :mod:`consequence.sandbox.zygote`)
    or ``"fresh"`` (a new ``python -I -S`` per child, as before the fork server; set
    ``CONSEQUENCE_SANDBOX_START=fresh``). Both apply the same confinement layers.

    Raises:
        ValueError: any other value of ``CONSEQUENCE_SANDBOX_START``.
    """
    mode = os.environ.get("CONSEQUENCE_SANDBOX_START", "fork-server")
    if mode not in ("fork-server", "fresh"):
        raise ValueError(f"CONSEQUENCE_SANDBOX_START={mode!r}: use 'fork-server' (default) or 'fresh'")
    return mode


_SERVER: list[ForkServer] = []
_SERVER_LOCK = threading.Lock()


def _sources() -> dict[str, str]:
    """Source text of each kind of sandbox child (the judge's two live in judge_children)."""
    from consequence.sandbox.judge_children import CANDIDATE, JUDGE

    return {"runner": RUNNER, "candidate": CANDIDATE, "judge": JUDGE}


def _fork_server() -> ForkServer:
    """The process's one fork server (made under a lock: tool threads ask for it at once)."""
    with _SERVER_LOCK:
        if not _SERVER:
            net = network_isolation()
            _SERVER.append(ForkServer(_sources(), "" if not net else "user" if "--user" in net else "net"))
        return _SERVER[0]


def spawn_child(
    kind: str, cfg: str, cwd: str, stdin: int, stdout: int, extra: Sequence[int] = (), argv: Sequence[str] = ()
) -> tuple[subprocess.Popen | Child, list[int]]:
    """Start one confined sandbox child of ``kind`` (``runner``, ``candidate``, ``judge``).

    ``stdin`` / ``stdout`` / ``extra`` are descriptors the child gets (stderr is
    /dev/null); the caller closes its own copies afterwards. Every child gets its own
    empty network namespace where the host allows one (:func:`network_isolation`).

    Returns:
        (the child: ``pid``, ``wait``, ``returncode``; end it with :func:`kill_group`,
        the numbers ``extra`` have inside the child).

    Raises:
        OSError: the child could not be started (report ``sandbox_error``).
    """
    if start_mode() == "fresh":
        proc = subprocess.Popen(
            [*network_isolation(), sys.executable, "-I", "-S", "-c", _sources()[kind], cfg, *argv],
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.DEVNULL,
            cwd=cwd,
            env={},
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(extra),
        )
        return proc, list(extra)
    server = _fork_server()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        targets = list(range(3, 3 + len(extra)))
        child = server.spawn(kind, cfg, cwd, [stdin, stdout, devnull, *extra], [0, 1, 2, *targets], argv)
    finally:
        os.close(devnull)
    return child, targets


def tagged_messages(raw: bytes, nonce: str) -> tuple[bool, dict | None]:
    """(child started, its last non-start message or None) from a child's stdout bytes.

    Only lines that begin with the per-run ``nonce`` and carry a JSON object count; the
    child reports ``{"stage": "loaded"}`` once its runner is up. Shared by the sandbox
    runner and the judge, which speak the same tagged-line protocol.
    """
    started, last = False, None
    for line in raw.decode("utf-8", "replace").split("\n"):
        if not line.startswith(nonce):
            continue
        try:
            obj = json.loads(line[len(nonce) :])
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("stage") == "loaded":
            started = True
        else:
            last = obj
    return started, last


def exchange(
    proc: subprocess.Popen | Child,
    stdin: BinaryIO,
    stdout: BinaryIO | None,
    payload: bytes,
    cap: int,
    deadline: float,
) -> tuple[bytes, str | None]:
    """Write ``payload`` to the child's stdin while reading at most ``cap`` bytes of its
    stdout, until it exits or ``deadline`` (``time.monotonic()``) passes.

    Returns (bytes read, None | ``"timeout"`` | ``"overflow"``). A pipe, not a file: the
    candidate shares the runner's stdout and could truncate or rewrite a file (erasing the
    runner's start line, which turned its run into a sandbox_error); bytes in a pipe are
    the parent's once written, and the parent never holds more than ``cap`` of them.
    """
    out = bytearray()
    todo = memoryview(payload)
    sel = selectors.DefaultSelector()
    if stdout is not None:
        sel.register(stdout, selectors.EVENT_READ)
    sel.register(stdin, selectors.EVENT_WRITE)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), "timeout"
            for key, _ in sel.select(left):
                if key.fileobj is stdin:
                    try:  # PIPE_BUF bytes never block once the pipe is writable
                        todo = todo[os.write(stdin.fileno(), todo[: select.PIPE_BUF]) :]
                    except OSError:  # the child closed stdin or died; judged from its output
                        todo = todo[:0]
                    if not todo:
                        sel.unregister(stdin)
                        stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)  # the other key is stdout's
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                out += chunk
                if len(out) > cap:
                    return bytes(out[:cap]), "overflow"
    finally:
        sel.close()
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # stdout closed but still running
        return bytes(out), "timeout"
    return bytes(out), None


def _run(code: str, tests: Sequence[TestCase], lim: SandboxLimits) -> TestReport:
    n = len(tests)
    nonce = "@@" + secrets.token_hex(16) + "@@"
    payload = json.dumps(
        {"nonce": nonce, "code": code, "cap": lim.max_output_bytes, "tests": [[t.call, t.expected] for t in tests]}
    ).encode()
    limits = child_config(lim.cpu_s, lim.memory_mb, lim.max_output_bytes)
    cap = lim.max_output_bytes + 4096  # room for the runner's own lines
    with tempfile.TemporaryDirectory(prefix="sbx-") as work:
        cwd = os.path.join(work, "cwd")
        os.mkdir(cwd)
        deadline = time.monotonic() + lim.wall_s
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        stdin, stdout = os.fdopen(in_w, "wb", buffering=0), os.fdopen(out_r, "rb", buffering=0)
        try:
            try:
                proc, _ = spawn_child("runner", limits, cwd, in_r, out_w)
            except OSError as e:
                return TestReport("sandbox_error", 0, n, [], f"cannot spawn: {e}")
            finally:
                os.close(in_r)
                os.close(out_w)  # only the child holds the write end now (EOF when it dies)
            try:
                raw, stop = exchange(proc, stdin, stdout, payload, cap, deadline)
            finally:
                kill_group(proc)
        finally:
            for pipe in (stdin, stdout):
                pipe.close()
    timed_out = stop == "timeout"
    started, res = tagged_messages(raw, nonce)
    if proc.returncode is None:  # the fork server died with the child: its end is unknown, not the code's fault
        return TestReport("sandbox_error", 0, n, [], "the sandbox fork server ended during the run")
    res = res if res is not None and "results" in res else None
    if not started:
        return TestReport(
            "sandbox_error",
            0,
            n,
            [],
            "runner did not start" + (" within the wall limit" if timed_out else f" (exit code {proc.returncode})"),
        )
    if timed_out or proc.returncode == -signal.SIGXCPU:
        return TestReport("timeout", 0, n, [f"timeout after {lim.wall_s:g} s"] * n, f"timeout after {lim.wall_s:g} s")
    if not (
        res is not None
        and proc.returncode == 0
        and isinstance(res.get("results"), list)
        and len(res["results"]) == n
        and stop is None
    ):
        why = (
            f"output exceeded {cap} bytes"
            if stop == "overflow"
            else f"process exited with code {proc.returncode} before reporting"
        )
        return TestReport("crash", 0, n, [why] * n, why)
    passed = sum(1 for r in res["results"] if r is True)
    msgs = [str(m) for m in res.get("messages", [])][: n - passed]
    err = res.get("error")
    return TestReport("ok", passed, n, msgs, str(err) if err is not None else None)


def run_tests(
    code: str, tests: Sequence[TestCase], limits: SandboxLimits = SandboxLimits(), cache: bool = True
) -> TestReport:
    """Run ``tests`` against ``code`` in a fresh sandboxed interpreter.

    Each test passes iff the call's result has a plain type (int, float, bool, str, None,
    or list/tuple/dict of those) and its ``repr`` equals ``expected``. Never raises for bad
    candidate code; a failure of the sandbox itself yields status ``'sandbox_error'``.
    Results are cached (LRU, keyed by code, tests and limits) when ``cache`` is true;
    sandbox errors are never cached. Typical cost: one fork of the fork server and its
    confinement, ~5 ms of CPU (~25 ms with fresh interpreters; benchmarks/bench_sandbox.py).
    """
    key = [code, [[t.call, t.expected] for t in tests], list(vars(limits).values())]
    return _CACHE.run(key, lambda: _run(code, list(tests), limits), cache)


def with_retries(run: Callable[[], TestReport], retries: int = ENV_RETRIES) -> TestReport:
    """Call ``run()`` until its status is not ``'sandbox_error'``, at most ``1 + retries`` times.

    ``run`` must re-run the same check (same code, tests and limits): a retry repeats a
    deterministic verification and never samples the policy again. Returns the last report
    with ``attempts`` = the number of calls made; when every call failed its ``error``
    says how many attempts were made. Raises ValueError for ``retries < 0``.

    >>> flaky = iter([TestReport("sandbox_error", 0, 1, [], "spawn failed"), TestReport("ok", 1, 1)])
    >>> r = with_retries(lambda: next(flaky))
    >>> (r.status, r.attempts)
    ('ok', 2)
    """
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    for attempt in range(1, retries + 2):
        report = run()
        if report.status != "sandbox_error":
            return replace(report, attempts=attempt)
    n = retries + 1
    return replace(report, attempts=n, error=f"{report.error}; gave up after {n} attempt{'s' if n > 1 else ''}")


@functools.lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...]:
    """Command prefix that gives the child an empty network namespace, if this host allows it.

    Probed once at start-up: ``unshare --net`` (root), else ``unshare --user
    --map-root-user --net`` (unprivileged user namespaces). An empty tuple means no
    network isolation is active here; ``isolation_report()`` says which layer is in force.
    """
    import shutil

    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for flags in (("--net",), ("--user", "--map-root-user", "--net")):
        try:
            ok = (
                subprocess.run(
                    [exe, *flags, sys.executable, "-I", "-S", "-c", "pass"], capture_output=True, timeout=10
                ).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return (exe, *flags)
    return ()


def isolation_report() -> dict[str, str]:
    """Which isolation layers are active for model-written code on this host."""
    net = network_isolation()
    process = (
        "forked per run by a clean fork server (python -I -S, never runs model code)"
        if start_mode() == "fork-server"
        else "fresh interpreter (-I -S) per run"
    )
    return {
        "process": process + ", own session, killed on timeout",
        "limits": "RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC, RLIMIT_CORE",
        "filesystem": "empty temporary working directory (read-only under Landlock), empty environment",
        "confinement": layers_report(),
        "network": " ".join(net[1:]) + " (empty network namespace)" if net else "none (unshare unavailable)",
    }
