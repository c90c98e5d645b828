"""Tests for consequence.sandbox.sandbox (each test is a real subprocess run)."""

import os
import time

import pytest

from consequence.envs.repair.problems import TestCase
from consequence.sandbox.sandbox import SandboxLimits, TestReport, clear_cache, run_tests

T = [TestCase("f([1, 2])", "2"), TestCase("f([-2, -5])", "-2"), TestCase("f([7])", "7")]
GOOD = "def f(xs):\n    return max(xs)"


def test_correct_code_passes_and_cache():
    clear_cache()
    r = run_tests(GOOD, T)
    assert (r.status, r.passed, r.total, r.messages, r.error) == ("ok", 3, 3, [], None)
    assert r.all_passed
    t0 = time.perf_counter()
    assert run_tests(GOOD, T).all_passed
    assert time.perf_counter() - t0 < 0.01  # cache hit
    assert run_tests(GOOD, T, cache=False).all_passed


def test_wrong_answer_messages():
    r = run_tests("def f(xs):\n    return 0", T)
    assert (r.status, r.passed) == ("ok", 0)
    assert r.messages[1] == "f([-2, -5]) returned 0, expected -2"
    assert not r.all_passed


def test_exception_and_syntax_error():
    r = run_tests("def f(xs):\n    return xs[5]", T, cache=False)
    assert r.passed == 0 and r.messages[0] == "f([1, 2]) raised IndexError: list index out of range"
    r = run_tests("def f(xs):\n    return (", T, cache=False)
    assert r.passed == 0 and r.error.startswith("SyntaxError")
    r = run_tests("raise SystemExit(0)", T, cache=False)
    assert r.passed == 0 and not r.all_passed


@pytest.mark.slow
def test_infinite_loop_times_out():
    t0 = time.perf_counter()
    r = run_tests("def f(xs):\n    while True:\n        pass", T, cache=False)
    assert time.perf_counter() - t0 < 3.5
    assert r.status == "timeout" and r.passed == 0 and not r.all_passed


def test_exit_before_tests_does_not_pass():
    for code in (
        "import os\nos._exit(0)",
        GOOD + "\nimport sys\nsys.exit(0)",
        GOOD + "\nimport os\nos.kill(os.getpid(), 9)",
    ):
        r = run_tests(code, T, cache=False)
        assert r.status == "crash" or r.passed == 0, code
        assert not r.all_passed


def test_forged_success_line_does_not_pass():
    fake = (
        "import os, json\n"
        'line = json.dumps({"results": [True, True, True], "messages": [], "error": None})\n'
        'os.write(1, ("\\n@@" + "0" * 32 + "@@" + line + "\\n").encode())\n'
        "print(line)\nos._exit(0)\n"
    )
    r = run_tests(fake, T, cache=False)
    assert not r.all_passed and r.status == "crash"


def test_always_equal_object_does_not_pass():
    code = (
        "class A(int):\n    def __eq__(self, o):\n        return True\n"
        "    def __repr__(self):\n        return '2'\n"
        "def f(xs):\n    return A(2)"
    )
    r = run_tests(code, T, cache=False)
    assert r.passed == 0 and r.messages[0] == "f([1, 2]) returned a A, expected 2"
    r = run_tests("class B(list):\n    pass\ndef f(xs):\n    return [B()]", [TestCase("f(1)", "[[]]")])
    assert r.passed == 0


def test_huge_allocation_fails_and_parent_survives():
    r = run_tests("def f(xs):\n    return len(bytearray(4 * 1024 ** 3))", T, cache=False)
    assert r.passed == 0 and not r.all_passed
    assert "MemoryError" in r.messages[0]
    r = run_tests("x = ' ' * (2 ** 40)", T, cache=False)
    assert not r.all_passed
    assert os.getpid() > 0 and run_tests(GOOD, T, cache=False).all_passed


def test_candidate_cannot_see_parent_files_or_env():
    # Under Landlock the (empty) working directory is not even listable: both mean "nothing".
    code = (
        "import os\ndef f(xs):\n"
        "    try:\n        seen = os.listdir('.')\n    except PermissionError:\n        seen = []\n"
        "    return [seen, sorted(set(os.environ) - {'LC_CTYPE'})]"
    )
    r = run_tests(code, [TestCase("f(0)", "[[], []]")], cache=False)
    assert r.all_passed, r.messages


def test_printing_is_captured_and_capped():
    code = "def f(xs):\n    print('x' * 10 ** 6)\n    return max(xs)"
    assert run_tests(code, T, cache=False).all_passed
    r = run_tests("import os\nos.write(1, b'y' * 10 ** 6)\n" + GOOD, T, SandboxLimits(), cache=False)
    assert not r.all_passed  # blowing the output-file limit kills the child


def test_report_all_passed_needs_ok_status():
    assert not TestReport("timeout", 3, 3).all_passed
    assert not TestReport("ok", 0, 0).all_passed


def test_candidate_cannot_open_a_network_connection():
    from consequence.sandbox.sandbox import isolation_report, network_isolation

    if not network_isolation():
        pytest.skip("no network namespace on this host: " + isolation_report()["network"])
    code = (
        "import errno, socket\n"
        "def f():\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "        return 'connected'\n"
        "    except OSError as e:\n"
        "        return errno.errorcode.get(e.errno, str(e.errno))\n"
    )
    from consequence.envs.repair.problems import TestCase as TC
    from consequence.sandbox.sandbox import run_tests as sandbox_run

    # on the host this would be ECONNREFUSED; in an empty namespace even loopback is down
    # (ENETUNREACH), where Landlock scopes TCP the connect is refused first (EACCES), and
    # where seccomp is active no socket can even be created (EPERM)
    rep = sandbox_run(code, [TC("f() in ('ENETUNREACH', 'EACCES', 'EPERM')", "True")], cache=False)
    assert rep.status == "ok" and rep.passed == 1, rep
    assert "network namespace" in isolation_report()["network"]
