"""Tests for consequence.envs.repair.problems (generator of code-repair problems)."""

import contextlib
import random

import pytest

from consequence.envs.repair.bugs import BUG_KINDS
from consequence.envs.repair.problems import (
    RepairTask,
    TestCase,
    build_problems,
    load_split,
    make_instance,
    make_tasks,
    split_problems,
)
from consequence.sandbox.sandbox import run_tests


def _apply(code: str, patch) -> str:
    lines = code.split("\n")
    lines[patch[0] - 1] = patch[1]
    return "\n".join(lines)


def _n_pass(code: str, tests) -> int:
    """In-process judge with the sandbox's rule: repr(result) == expected."""
    ns: dict = {}
    exec(compile(code, "solution.py", "exec"), ns)
    ok = 0
    for t in tests:
        with contextlib.suppress(Exception):  # a call that raises passes no test
            ok += repr(eval(t.call, ns)) == t.expected
    return ok


@pytest.fixture(scope="module")
def problems():
    return build_problems(0)


def test_many_distinct_problems_and_bug_kinds(problems):
    ids = [p.problem_id for p in problems]
    assert len(set(ids)) == len(ids) >= 300
    kinds = {p.bug_kind for p in problems}
    assert kinds == set(BUG_KINDS) and len(kinds) >= 8
    assert len({p.family for p in problems}) >= 12


@pytest.mark.slow
def test_sample_of_instances_is_consistent(problems):
    rng = random.Random(1)
    tasks = make_tasks(rng.sample(problems, 200), 200, seed=3)
    for t in tasks:
        h, v = t.hidden_tests, t.visible_tests
        assert len(h) >= 5 and len(v) >= 3 and set(v) <= set(h)
        assert len(t.buggy_code.split("\n")) <= 10
        assert t.task_id == f"{t.problem_id}#3-{tasks.index(t)}"
        assert _n_pass(t.reference_code, h) == len(h), t.task_id
        assert _n_pass(t.buggy_code, v) < len(v), t.task_id  # bug visible to the policy
        assert _n_pass(t.buggy_code, h) < len(h), t.task_id
        assert _apply(t.buggy_code, t.patch) == t.reference_code
        assert _n_pass(_apply(t.buggy_code, t.patch), h) == len(h)
        assert 1 <= len(t.decoy_patches) <= 3
        for d in t.decoy_patches:
            assert _n_pass(_apply(t.buggy_code, d), h) < len(h), (t.task_id, d)
        # single line replacement
        diff = [a != b for a, b in zip(t.buggy_code.split("\n"), t.reference_code.split("\n"))]
        assert sum(diff) == 1 and diff.index(True) == t.patch[0] - 1


def test_real_sandbox_agrees_on_a_few_instances(problems):
    for t in make_tasks(problems, 4, seed=11):
        assert run_tests(t.reference_code, t.hidden_tests).all_passed
        bug = run_tests(t.buggy_code, t.visible_tests)
        assert bug.status in ("ok", "crash") and bug.passed < bug.total
        assert run_tests(_apply(t.buggy_code, t.patch), t.hidden_tests).all_passed
        assert not run_tests(_apply(t.buggy_code, t.decoy_patches[0]), t.hidden_tests).all_passed


def test_split_disjoint_deterministic(problems):
    a, b = load_split(0), split_problems(build_problems(0), seed=0)
    ids = {k: [p.problem_id for p in v] for k, v in a.items()}
    assert ids == {k: [p.problem_id for p in v] for k, v in b.items()}
    tr, va, te = set(ids["train"]), set(ids["validation"]), set(ids["test"])
    assert not (tr & va or tr & te or va & te)
    assert len(tr) + len(va) + len(te) == len(problems)
    assert abs(len(va) - 0.1 * len(problems)) <= 1
    other = split_problems(problems, seed=1)
    assert {p.problem_id for p in other["test"]} != te  # the seed matters
    with pytest.raises(ValueError):
        split_problems(problems, fractions=(0.5, 0.5, 0.5))


def test_instances_rename_but_keep_structure(problems):
    p = problems[0]
    a, b = make_instance(p, "x"), make_instance(p, "x")
    assert a == b  # deterministic
    many = {make_instance(p, str(k)).buggy_code for k in range(20)}
    assert len(many) > 1  # renamed variables
    assert all(c.startswith(f"def {p.variant.func}(") for c in many)
    assert make_tasks(problems, 5, seed=2) == make_tasks(problems, 5, seed=2)


def test_seed_example_find_max_init(problems):
    """The seed's example: find_max, bug 'init' (best = 0), fails on an all-negative list."""
    cands = [p for p in problems if p.family == "find_max" and p.bug_kind == "init" and p.bug_text.endswith("= 0")]
    assert cands
    t = make_instance(cands[0], "demo")
    assert isinstance(t, RepairTask) and t.func_name == "find_max"
    ns: dict = {}
    exec(t.buggy_code, ns)
    assert ns["find_max"]([-2, -5, -8]) == 0
    exec(t.reference_code, ns)
    assert ns["find_max"]([-2, -5, -8]) == -2
    test = TestCase("find_max([-2, -5, -8])", "-2")
    assert run_tests(t.buggy_code, [test]).messages == ["find_max([-2, -5, -8]) returned 0, expected -2"]
    assert t.docstring == "Return the largest element of a non-empty list."
