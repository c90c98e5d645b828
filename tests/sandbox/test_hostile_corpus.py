"""The hostile-program corpus (consequence.envs.repair.hostile) through the real sandbox.

For each program: reward 0 through ``RepairEnv`` ``finish`` (never an env_error), the
visible-test feedback not passed (except the documented single-process forgeries),
nothing outside the work directory changed, no process left, nobody reached the host's
loopback, this process's memory did not take the output. Negative controls: the
harness's own checkers catch a planted daemon and a changed file, and the attacks that
are safe to run unconfined do score without the sandbox.
"""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from consequence.envs.repair import hostile
from consequence.envs.repair.hostile import CASES, CONTROLS, HIDDEN, host_guards, prepare_outside, render, run_case
from consequence.sandbox.sandbox import SandboxLimits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and prctl")
BY_NAME = {c.name: c for c in CASES + CONTROLS}
WALL = SandboxLimits().wall_s


@pytest.fixture(scope="module")
def guards():
    return host_guards()


def test_corpus_covers_the_issue_list():
    assert len(CASES) == 27 and len(BY_NAME) == len(CASES) + len(CONTROLS)
    for must in (
        "infinite_loop",
        "fork_bomb",
        "unbounded_allocation",
        "gigabytes_of_output",
        "fill_the_disk",
        "write_outside",
        "read_hidden_tests",
        "read_verifier",
        "read_answer",
        "open_socket",
        "unix_socket",
        "os_exit_before_tests",
        "sys_exit_before_tests",
        "replace_assert",
        "replace_builtins",
        "replace_test_runner",
        "fake_success_line",
        "erase_own_output",
        "always_equal_object",
        "walk_stack_frames",
        "delete_files",
        "ignore_signals",
        "daemon_fork",
    ):
        assert must in BY_NAME, must


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES + CONTROLS])
def test_case_is_contained(name, tmp_path, guards):
    case = BY_NAME[name]
    if case.needs and not guards[case.needs]:
        pytest.skip(f"{name} is not safe to run on this host ({case.needs} is false)")
    r = run_case(case, tmp_path / "outside", guards=guards)
    want = 1.0 if name == "control_correct" else 0.0
    assert (r.reward, r.env_error) == (want, None), r
    assert "sandbox_error" not in r.feedback, r  # no candidate may get itself excluded
    # run_tests is one process: candidates that reach its frame or builtins can forge the
    # visible-test feedback (documented in sandbox.py); the reward above comes from the judge
    assert r.feedback_passed == (case.feedback_forgeable or name == "control_correct"), r
    assert r.survivors == [] and r.outside_changed == [] and r.connections == 0, r
    assert r.rss_growth_mb < 64, r  # the parent read at most max_output_bytes of the output
    assert r.wall_s < 2 * WALL + 3.0, r  # two sandbox runs, each killed at the wall limit


# ---- negative controls of the harness's own checkers -------------------------------------


def test_process_checker_finds_an_orphan_and_kills_it():
    before = set(hostile._children())
    hostile._set_subreaper(True)
    try:
        # the shell exits at once; its background sleep is orphaned and re-parented to us
        subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 &"], check=True)
        left = hostile._leftovers(before)
    finally:
        hostile._set_subreaper(False)
    assert len(left) == 1 and not os.path.exists(f"/proc/{left[0]}")  # killed and reaped
    assert hostile._leftovers(before) == []


def test_file_checker_sees_a_changed_or_deleted_file(tmp_path):
    out = tmp_path / "outside"
    prepare_outside(out)
    before = hostile._snapshot(out, "consequence-hostile-checker")
    (out / "sentinel.txt").write_text("pwned")
    (out / "answer.py").unlink()
    assert hostile._changed(before, hostile._snapshot(out, "consequence-hostile-checker")) == [
        str(out / "answer.py"),
        str(out / "sentinel.txt"),
    ]


UNCONFINED = (
    "write_outside",
    "read_hidden_tests",
    "read_answer",
    "read_verifier",
    "read_trainer_memory",
    "open_socket",
    "unix_socket",
    "delete_files",
)


@pytest.mark.parametrize("name", UNCONFINED)
def test_attack_scores_without_the_sandbox(name, tmp_path):
    """The attack is real: in a plain interpreter (no sandbox) it answers every hidden test."""
    out, cwd = tmp_path / "outside", tmp_path / "a" / "b"
    prepare_outside(out)
    cwd.mkdir(parents=True)
    marker = f"consequence-hostile-control-{os.getpid()}-{name}"
    srv, usrv = socket.socket(), socket.socket(socket.AF_UNIX)
    srv.bind(("127.0.0.1", 0))
    usrv.bind(str(hostile.unix_socket_path(out)))
    for server in (srv, usrv):
        server.listen(16)  # every hidden test connects once; nobody accepts
    code = render(BY_NAME[name].code, out, srv.getsockname()[1], marker)
    calls = "[" + ", ".join(t.call for t in HIDDEN) + "]"
    try:
        got = subprocess.run(
            [sys.executable, "-I", "-c", code + f"\nprint(repr({calls}))"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        srv.close()
        usrv.close()
        if os.path.exists("/tmp/" + marker):
            os.remove("/tmp/" + marker)
    assert got.stdout.strip() == "[" + ", ".join(t.expected for t in HIDDEN) + "]", got.stderr


def test_heap_walk_finds_tests_that_share_its_process():
    """walk_stack_frames scores 0 in the judge because the tests are not in its process;
    put them in the same process and the same walk answers correctly."""
    code = render(BY_NAME["walk_stack_frames"].code, Path("/nonexistent"), 0, "x")
    prog = (
        "tests = [[c, e] for c, e in "
        + repr([(t.call, t.expected) for t in HIDDEN])
        + "]\n"
        + code
        + "\nprint(add(2, 3))"
    )
    got = subprocess.run([sys.executable, "-I", "-c", prog], capture_output=True, text=True, timeout=30)
    assert got.stdout.strip() == "5", got.stderr


@pytest.mark.slow
def test_ignored_sigterm_still_dies_with_the_group(tmp_path):
    """The sandbox kills with SIGKILL to the whole group: SIG_IGN on SIGTERM does not help."""
    r = run_case(BY_NAME["ignore_signals"], tmp_path / "o", SandboxLimits(wall_s=1.0, cpu_s=1), guards={})
    assert r.reward == 0.0 and r.reward_status == "timeout" and r.survivors == []
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # ours untouched


@pytest.mark.slow
def test_without_seccomp_a_root_daemon_escapes_the_group(tmp_path, monkeypatch):
    """The gap README states: RLIMIT_NPROC does not apply to uid 0, so on a root host
    without seccomp a double-forked ``setsid`` daemon leaves the process group the sandbox
    kills. The harness sees both daemons (one per sandbox run) and kills them; this is
    also the process checker's negative control on a real escape."""
    from consequence.sandbox import hardening, judge, sandbox

    if os.geteuid() != 0:
        pytest.skip("not root: RLIMIT_NPROC = 0 stops the fork even without seccomp")
    layers = {**hardening.available_layers(), "seccomp": False}

    def no_seccomp(cpu_s, memory_mb, fsize_bytes):
        return hardening.child_config(cpu_s, memory_mb, fsize_bytes, layers)

    monkeypatch.setattr(sandbox, "child_config", no_seccomp)
    monkeypatch.setattr(judge, "child_config", no_seccomp)
    r = run_case(BY_NAME["daemon_fork"], tmp_path / "o", guards={"fork_contained": True})
    assert len(r.survivors) == 2 and r.reward == 1.0, r  # the spawn worked, so add() answers
    assert all(not os.path.exists(f"/proc/{p}") for p in r.survivors)  # killed by the harness
