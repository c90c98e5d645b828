"""The repair environments' demonstrator (``Environment.demonstration``): its plans, its habits,
and that they are exactly the plans of the scripted teacher before it moved into envs/repair
(the bundled warm start was built from them)."""

import collections
import hashlib
import json
import random

import pytest

from consequence.distill.teacher import demonstration_plans
from consequence.envs.api import Environment, has_demonstrator
from consequence.envs.registry import load_environment
from consequence.envs.repair.demonstrator import TeacherHabits, habits_from, plan_actions, plan_episode
from consequence.envs.repair.problems import load_split, make_tasks

OTHER = {"p_diagnose_first": 0.2, "p_read_only": 0.6, "p_wrong_patch_first": 0.9, "p_verify_before_finish": 0.1}
# sha256 of json.dumps([[[name, arguments], ...] per task]) of the plans for the tasks
# env.sample("train", N, seed=d + 1) with one random.Random(d), computed with
# consequence.distill.teacher.plan_episode before it moved (commit 9d702a9).
GOLDEN = {
    ("repair", None, 0, 300): "73ba63df557520501da15cc5c8c42b70a40be8b42f3fe07877ad8e1c70573b19",
    ("repair", None, 1000, 300): "14c9302579f57b8bd0d255ae386da5d036292389adb0a0b855a6126aa380fb6c",
    ("repair", "other", 0, 300): "0485fb39c6df0927f82def22bbe5664cb67cbb6dea6c26a49488b7cb8aaacf20",
    ("repair", "other", 1000, 300): "3b2926f6306864565793f247b99b9fa4176f7efd3313e0ab976104094ea23f6e",
    ("humaneval-repair", None, 0, 100): "27ff256eacc2668dba9d077ed506c5e1bc713c40adc036386d76a69b604a6ef6",
}
FIRST = [  # the same, written out: the first four plans of the bundled warm start's draw (d = 0)
    (
        "count_neg.e1/init/L3/1#1-0",
        [("replace_line", {"line": 3, "code": "    c = 0"}), ("run_tests", {}), ("finish", {})],
    ),
    (
        "sum_neg.r/index/L5/2#1-1",
        [
            ("run_tests", {}),
            ("read_code", {}),
            ("replace_line", {"line": 5, "code": "        if seq[p] < 0:"}),
            ("run_tests", {}),
            ("finish", {}),
        ],
    ),
    (
        "find_min.r10/return_var/L7/0#1-2",
        [
            ("read_code", {}),
            ("replace_line", {"line": 7, "code": "    return small"}),
            ("run_tests", {}),
            ("finish", {}),
        ],
    ),
    (
        "argmax.r/comparison/L5/0#1-3",
        [("read_code", {}), ("replace_line", {"line": 5, "code": "        if items[i] > items[bi]:"}), ("finish", {})],
    ),
]


@pytest.fixture(scope="module")
def repair():
    return load_environment("repair", 0)


def _tasks(n=400):
    return make_tasks(load_split(0)["train"], n, seed=7)


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: f"{k[0]}-{k[1] or 'default'}-d{k[2]}")
def test_the_repair_plans_are_what_they_were(key, repair):
    """Same draw seed, same plans: the same rng consumption order as the old plan_episode, through
    the generic path (demonstration_plans → env.demonstration) the warm start takes."""
    name, habits, d, n = key
    env = repair if name == "repair" else load_environment(name, 0)
    tasks = env.sample("train", n, seed=d + 1)
    plans = demonstration_plans(env, tasks, random.Random(d), OTHER if habits else None)
    as_pairs = [[[a["name"], a["arguments"]] for a in p] for p in plans]
    assert hashlib.sha256(json.dumps(as_pairs).encode()).hexdigest() == GOLDEN[key]


def test_the_first_plans_of_the_warm_starts_draw(repair):
    tasks = repair.sample("train", 4, seed=1)
    rng = random.Random(0)
    got = [(t.task_id, [(a["name"], a["arguments"]) for a in repair.demonstration(t, rng)]) for t in tasks]
    assert got == FIRST


def test_habits_are_settable_by_keyword_or_attribute(repair):
    tasks = repair.sample("train", 50, seed=3)
    want = [plan_actions(t, r, TeacherHabits(**OTHER)) for r in [random.Random(5)] for t in tasks]
    by_keyword = [repair.demonstration(t, r, habits=OTHER) for r in [random.Random(5)] for t in tasks]
    env = load_environment("repair", 0)
    env.habits = TeacherHabits(**OTHER)
    by_attribute = [env.demonstration(t, r) for r in [random.Random(5)] for t in tasks]
    assert want == by_keyword == by_attribute
    assert want != [repair.demonstration(t, r) for r in [random.Random(5)] for t in tasks]  # the defaults differ
    with pytest.raises(ValueError, match="no habit p_blind"):
        habits_from({"p_blind": 0.5})
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        habits_from({"p_read_only": 1.5})


def test_every_plan_ends_with_the_fix_then_finish():
    rng = random.Random(0)
    for t in _tasks(200):
        plan = plan_episode(t, rng)
        assert plan[-1] == ("finish", {})
        last_patch = [a for n, a in plan if n == "replace_line"][-1]
        assert (last_patch["line"], last_patch["code"]) == t.patch
        # a wrong first patch is on the fixed line, so the fix overwrites it
        assert all(a["line"] == t.patch[0] for n, a in plan if n == "replace_line")


def test_habit_mix_matches_the_configured_probabilities():
    rng = random.Random(1)
    habits = TeacherHabits(p_diagnose_first=0.5, p_read_only=0.3, p_wrong_patch_first=0.25, p_verify_before_finish=0.5)
    first = collections.Counter(plan_episode(t, rng, habits)[0][0] for t in _tasks(400))
    # 400 draws: expected 200 / 120 / 80, binomial sd ≤ 10
    assert abs(first["run_tests"] - 200) < 40
    assert abs(first["read_code"] - 120) < 35
    assert abs(first["replace_line"] - 80) < 30


def test_find_task_re_creates_a_repair_instance_from_its_id(repair):
    for t in repair.sample("train", 5, seed=1001):
        assert repair.find_task(t.task_id) == ("train", t)  # the same renamed variables and tests
    held_out = repair.sample("validation", 1, seed=3)[0]
    assert repair.find_task(held_out.task_id) == ("validation", held_out)
    assert repair.find_task(held_out.problem_id) is None  # the instance is part of the task
    assert repair.find_task("no-such-problem#1-0") is None
    he = load_environment("humaneval-repair", 0)
    t = he.sample("train", 1, seed=4)[0]
    assert he.find_task(t.task_id) == ("train", t)


def test_which_environments_demonstrate():
    assert all(has_demonstrator(load_environment(n, 0).__class__) for n in ("repair", "humaneval-repair", "calculator"))
    humaneval = load_environment("humaneval", 0)
    assert not has_demonstrator(humaneval) and not has_demonstrator(Environment)
    with pytest.raises(NotImplementedError, match="no demonstrator"):
        humaneval.demonstration(humaneval.split["train"][0], random.Random(0))
