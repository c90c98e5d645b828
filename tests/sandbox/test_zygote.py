"""The sandbox's fork server (consequence/sandbox/zygote.py): its children are confined exactly
like fresh interpreters, inherit nothing from the zygote, and the server survives its own death."""

import pytest

from consequence.envs.repair.problems import TestCase, TestProgram
from consequence.sandbox import judge, sandbox
from consequence.sandbox.hardening import available_layers

ADD = "def add(a, b):\n    return a + b\n"
TESTS = [TestCase("add(1, 2)", "3"), TestCase("add(2, 2)", "4")]

# Each probe returns a short text of what the child could do; both start modes must agree.
PROBES = r"""
import os, resource
def probe(kind):
    try:
        if kind == "fds":  # descriptors beyond stdin / stdout / stderr (the zygote's socket, a ruleset)
            return [fd for fd in range(3, 256) if _open(fd)]
        if kind == "cpu_clock":  # the CPU limit counts from this child's start, not the zygote's
            r = resource.getrusage(resource.RUSAGE_SELF)
            return "fresh" if r.ru_utime + r.ru_stime < 1.0 else "inherited"
        if kind == "session":
            return "leader" if os.getsid(0) == os.getpid() else "not leader"
        if kind == "fork":
            os.fork()
        if kind == "read_outside":
            open("/etc/hostname").read()
        if kind == "write_cwd":
            open("x", "w").write("x")
        if kind == "env":
            return sorted(set(os.environ) - {"LC_CTYPE"})
        if kind == "limits":
            return [resource.getrlimit(getattr(resource, n)) for n in ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_FSIZE")]
        return "allowed"
    except BaseException as e:
        return "denied " + type(e).__name__
def _open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
"""
KINDS = ["fds", "cpu_clock", "session", "fork", "read_outside", "write_cwd", "env", "limits"]


def _probe_all() -> dict[str, str]:
    out = {}
    for kind in KINDS:
        r = sandbox.run_tests(PROBES, [TestCase(f"probe({kind!r})", "'never'")], cache=False)
        assert r.status == "ok", r
        out[kind] = r.messages[0].split(" returned ", 1)[1]
    return out


@pytest.mark.slow
def test_children_are_confined_like_fresh_interpreters(monkeypatch):
    monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", "fresh")
    fresh = _probe_all()
    monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", "fork-server")
    forked = _probe_all()
    assert forked == fresh
    assert forked["fds"].startswith("[]")  # no descriptor of the zygote reached the child
    assert forked["cpu_clock"].startswith("'fresh'") and forked["session"].startswith("'leader'")
    assert forked["env"].startswith("[]")
    # reading limits is prlimit64, which seccomp denies; without seccomp they are the prelude's
    assert forked["limits"].startswith(
        "'denied PermissionError'" if available_layers()["seccomp"] else "[(16, 16), (0, 0), (65536, 65536)]"
    )
    layers = available_layers()
    if layers["seccomp"]:
        assert forked["fork"].startswith("'denied PermissionError'")
    if layers["landlock"]:
        assert forked["read_outside"].startswith("'denied PermissionError'")
        assert forked["write_cwd"].startswith("'denied PermissionError'")


@pytest.mark.slow
def test_both_modes_score_the_reward_path_alike(monkeypatch):
    prog = TestProgram(entry_point="add", setup="", check="def check(c):\n    assert c(1, 2) == 3\n")
    got = {}
    for mode in ("fresh", "fork-server"):
        monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", mode)
        got[mode] = [
            (r.status, r.passed, r.total, r.messages)
            for r in (
                judge.run_cases(ADD, TESTS, cache=False),
                judge.run_cases(ADD.replace("a + b", "a - b"), TESTS, cache=False),
                judge.run_cases("while True:\n    pass\n", TESTS, cache=False),
                judge.run_program(ADD, prog, cache=False),
                sandbox.run_tests("def add(a, b):\n    return a +", TESTS, cache=False),
            )
        ]
    assert got["fork-server"] == got["fresh"]
    assert got["fork-server"][0] == ("ok", 2, 2, [])
    assert got["fork-server"][1][:3] == ("ok", 0, 2)
    assert got["fork-server"][2][0] == "timeout"
    assert got["fork-server"][3] == ("ok", 1, 1, [])
    assert got["fork-server"][4][:3] == ("ok", 0, 2) and "SyntaxError" in got["fork-server"][4][3][0]


@pytest.mark.parametrize("mode", ["fresh", "fork-server"])
def test_a_candidate_ended_by_its_cpu_limit_is_a_timeout(monkeypatch, mode):
    """A loop that spins at full speed meets the CPU limit and the wall limit at about the same
    time; whichever ends it, the report is the same timeout (a fresh-clone run once scored the
    CPU-limit case "ok, no answer"). Here the CPU limit (1 s) always comes first (wall 20 s)."""
    monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", mode)
    lim = sandbox.SandboxLimits(wall_s=20.0, cpu_s=1)
    for spin in ("while True:\n    pass\n", "def add(a, b):\n    while True:\n        pass\n"):
        r = judge.run_cases(spin, TESTS, limits=lim, cache=False)
        assert (r.status, r.passed, r.total) == ("timeout", 0, 2), (spin, r)
        assert r.messages == ["timeout after 20 s"] * 2


def test_a_dead_fork_server_is_restarted(monkeypatch):
    monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", "fork-server")
    assert sandbox.run_tests(ADD, TESTS, cache=False).all_passed
    server = sandbox._fork_server()
    first = server._proc.pid
    server._proc.kill()
    server._proc.wait()
    assert sandbox.run_tests(ADD, TESTS, cache=False).all_passed
    assert server._proc.pid != first


def test_timeout_kills_the_child(monkeypatch):
    monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", "fork-server")
    server = sandbox._fork_server()
    r = sandbox.run_tests(
        "import time\ndef add(a, b):\n    time.sleep(30)\n", TESTS, sandbox.SandboxLimits(wall_s=0.5), cache=False
    )
    assert r.status == "timeout"
    assert not server._children  # every child was reaped and reported


def test_unknown_start_mode_is_refused(monkeypatch):
    monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", "threads")
    with pytest.raises(ValueError, match="CONSEQUENCE_SANDBOX_START='threads'"):
        sandbox.start_mode()


@pytest.mark.slow
def test_works_under_a_low_descriptor_limit():
    """`ulimit -n 1024` is a common default: the child's descriptor shuffling must stay below it."""
    import resource
    import subprocess
    import sys

    code = (
        "from consequence.sandbox.sandbox import run_tests\nfrom consequence.sandbox.judge import run_cases\n"
        "from consequence.envs.repair.problems import TestCase\nT = [TestCase('f()', '1')]\n"
        "print(run_tests('def f(): return 1', T, cache=False).status, run_cases('def f(): return 1', T, cache=False).status)"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "CONSEQUENCE_SANDBOX_START": "fork-server"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )
    assert out.stdout.split() == ["ok", "ok"], out.stderr[-2000:]


@pytest.mark.slow
def test_a_fork_server_dying_mid_run_is_a_sandbox_error_not_a_score(monkeypatch):
    import threading
    import time

    monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", "fork-server")
    slow = "import time\ndef add(a, b):\n    time.sleep(3)\n    return a + b\n"
    lim = sandbox.SandboxLimits(wall_s=6.0, cpu_s=4)
    assert sandbox.run_tests(ADD, TESTS, cache=False).all_passed  # the server is up
    got = {}
    threads = [
        threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f(slow, TESTS, lim, cache=False)))
        for k, f in (("run_tests", sandbox.run_tests), ("run_cases", judge.run_cases))
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    sandbox._fork_server()._proc.kill()
    for t in threads:
        t.join(30)
    assert {k: r.status for k, r in got.items()} == {"run_tests": "sandbox_error", "run_cases": "sandbox_error"}
    assert "fork server ended" in got["run_tests"].error  # retried by with_retries, never cached, never a 0
    assert sandbox.run_tests(ADD, TESTS, cache=False).all_passed  # and the next run restarts it


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has ended
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_no_sandbox_process_outlives_the_parent():
    """A sleeping candidate never reaches its CPU limit: the parent's exit must end it."""
    import subprocess
    import sys
    import time

    code = (
        "import os, threading, time\nfrom consequence.sandbox import sandbox, judge\n"
        "from consequence.envs.repair.problems import TestCase\n"
        "c = 'import time\\ndef f():\\n    time.sleep(10 ** 6)\\n'\n"
        "lim = sandbox.SandboxLimits(wall_s=60, cpu_s=30)\n"
        "for fn in (sandbox.run_tests, judge.run_cases):\n"
        "    threading.Thread(target=fn, args=(c, [TestCase('f()', '1')], lim), kwargs={'cache': False},"
        " daemon=True).start()\n"
        # poll, not a fixed sleep: under load the fork server and its three children come up late
        "s = sandbox._fork_server()\nt0 = time.monotonic()\n"
        "while len(s._children) < 3 and time.monotonic() - t0 < 45:\n    time.sleep(0.05)\n"
        "print(s._proc.pid, *s._children, flush=True)\nos._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "CONSEQUENCE_SANDBOX_START": "fork-server"},
    )
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 4, out.stderr[-2000:]  # the zygote, the runner, the candidate and the judge
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)


def test_an_unknown_start_mode_stops_a_run_before_its_folder_is_made(monkeypatch, tmp_path):
    from rich.console import Console

    from consequence.config import TrainConfig
    from consequence.loop.train import train

    monkeypatch.setenv("CONSEQUENCE_SANDBOX_START", "bogus")
    with pytest.raises(ValueError, match="CONSEQUENCE_SANDBOX_START='bogus'"):
        train(
            TrainConfig(run_dir=str(tmp_path / "run"), iterations=1, final_eval_episodes=0, eval_every=0),
            Console(quiet=True),
        )
    assert not (tmp_path / "run").exists()
