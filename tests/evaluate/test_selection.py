"""Final-selection success, outcome shares (case 04) and the split ledger, by hand."""

import json

import pytest
from typer.testing import CliRunner

from consequence.evaluate.episode_eval import outcome_shares, per_task_counts, prompt_too_long, summarize_pass_at_k
from consequence.evaluate.selection import pick, summarize_selection, task_selection_success
from consequence.evaluate.splits import read_ledger, record_touch, reuse_warning
from consequence.records import ModelCall, Trajectory


def _ep(task, j, outcome="finished", ok=False, code="A", reason=None, calls=1):
    t = Trajectory(
        task_id=task,
        group_id=task,
        sample_id=j,
        seed=j,
        policy_version=0,
        calls=[ModelCall([1], [2], [0.0], "stop")] * calls,
        outcome=outcome,
        truncation_reason=reason,
        verifier_score=(1.0 if ok else 0.0) if outcome == "finished" else None,
        final_code=code,
    )
    return t


# One task, n = 4, in sample order: a wrong submission "A", a correct "B", an episode that
# never submitted (its code "B" must not count), a second correct "B".
EPISODES = [
    _ep("p#0", 0, code="A"),
    _ep("p#0", 1, ok=True, code="B"),
    _ep("p#0", 2, outcome="truncated", reason="max_turns", code="B"),
    _ep("p#0", 3, ok=True, code="B  "),
]
VISIBLE = {"A": 1, "B": 2}  # visible tests passed by each program


def _visible(t):
    return VISIBLE[t.final_code.strip()]


@pytest.mark.parametrize(
    "k, rule, expected",
    [
        # k = 1: blocks [0] [1] [2] [3] -> 0, 1, 0 (no submission), 1 -> 1/2 for every rule (= c/n)
        (1, "first", 0.5),
        (1, "majority", 0.5),
        (1, "visible", 0.5),
        # k = 2: blocks [0,1] [2,3]; first picks 0 then 3; majority ties A/B in block 1 -> earliest (0);
        # visible picks 1 (2 visible tests beat 1) then 3
        (2, "first", 0.5),
        (2, "majority", 0.5),
        (2, "visible", 1.0),
        # k = 3: one block [0,1,2] (episode 3 left over): first 0; majority tie -> 0; visible -> 1
        (3, "first", 0.0),
        (3, "majority", 0.0),
        (3, "visible", 1.0),
        # k = 4: one block; majority: "B" twice (trailing spaces stripped) beats "A" once -> episode 1
        (4, "first", 0.0),
        (4, "majority", 1.0),
        (4, "visible", 1.0),
    ],
)
def test_selection_by_hand(k, rule, expected):
    assert task_selection_success(EPISODES, k, rule, _visible) == expected


def test_selection_is_apart_from_pass_at_k():
    # pass@2 = 1 - C(2,2)/C(4,2) = 5/6: a correct candidate exists, but "first" submits it half the time
    pak = summarize_pass_at_k(per_task_counts(EPISODES), [2])["2"]["pass_at_k"]
    sel = summarize_selection(EPISODES, [2], ["first"], _visible)["first"]["2"]["success"]
    assert pak == pytest.approx(5 / 6) and sel == 0.5


def test_env_errors_are_not_candidates_and_short_tasks_are_excluded():
    eps = [_ep("p#0", 0, outcome="env_error"), *EPISODES[1:]]
    # valid: 1, 2, 3 -> k = 2 gives one block [1, 2]: first submission is 1 (correct)
    assert task_selection_success(eps, 2, "first") == 1.0
    assert task_selection_success(eps, 4, "first") is None
    res = summarize_selection(eps, [4], ["first"])["first"]["4"]
    assert res["tasks"] == 0 and res["tasks_excluded"] == 1


def test_problems_are_averaged_before_the_mean():
    # problem p has two tasks (1.0 and 0.0 at k = 1 with first) -> 0.5; problem q one task at 1.0
    eps = [_ep("p#0", 0, ok=True), _ep("p#1", 0), _ep("q#0", 0, ok=True)]
    res = summarize_selection(eps, [1], ["first"])["first"]["1"]
    assert res["success"] == pytest.approx((0.5 + 1.0) / 2) and res["problems"] == 2 and res["tasks"] == 3


def test_pick_rejects_unknown_rules_and_visible_without_tests():
    with pytest.raises(ValueError, match="valid rules are first, majority, visible"):
        pick(EPISODES, "best")
    with pytest.raises(ValueError, match="visible_score"):
        pick(EPISODES, "visible")
    assert pick([EPISODES[2]], "first") is None


def test_case_04_prompt_too_long_stays_in_the_denominator():
    # docs/cases.md (case 04): 100 tasks, one sample each; 20 prompts did not fit; 40 of the other 80 passed.
    eps = [_ep(f"t{i}#0", 0, outcome="truncated", reason="total_tokens", calls=0) for i in range(20)]
    eps += [_ep(f"t{i}#0", 0, ok=i < 60) for i in range(20, 100)]
    assert sum(map(prompt_too_long, eps)) == 20
    res = summarize_pass_at_k(per_task_counts(eps), [1])["1"]
    assert res["pass_at_k"] == pytest.approx(0.40)  # not 40 / 80 = 0.50
    shares = outcome_shares(eps)["shares"]
    assert shares == {"prompt_too_long": 0.20, "solved": 0.40, "submitted_wrong": 0.40}


def test_a_real_prompt_that_does_not_fit_is_truncated_before_any_call(renderer):
    from consequence.envs.repair.env import RepairEnv
    from consequence.envs.repair.problems import load_split, make_tasks
    from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

    task = make_tasks(load_split(0)["validation"], 1, seed=0)[0]

    def never(*_):
        raise AssertionError("the policy must not be called")

    [t] = run_episodes(
        never,
        renderer,
        [EpisodeSpec(RepairEnv(task), task.task_id, task.task_id, 0, 0)],
        Budgets(max_total_tokens=40),
        "You fix Python functions.",
    )
    assert prompt_too_long(t) and t.outcome == "truncated" and t.calls == []


def test_ledger_warns_on_test_reuse_by_other_policies(tmp_path):
    path = tmp_path / "ledger.jsonl"
    assert reuse_warning("repair", 0, ["A"], path) is None  # nothing on record
    record_touch("repair", 0, "validation", "consequence eval", ["B"], path)
    assert reuse_warning("repair", 0, ["A"], path) is None  # validation may be reused freely
    record_touch("repair", 0, "test", "consequence eval", ["A"], path)
    assert reuse_warning("repair", 0, ["A"], path) is None  # the same policy again
    w = reuse_warning("repair", 0, ["C"], path)
    from pathlib import Path

    assert w is not None and f"1 other policy ({Path('A').resolve()};" in w and "optimistic" in w
    assert reuse_warning("repair", 1, ["C"], path) is None  # another split seed: other problems
    assert reuse_warning("humaneval-repair", 0, ["C"], path) is None
    assert [e["split"] for e in read_ledger(path)] == ["validation", "test"]


def test_unwritable_ledger_does_not_stop_the_evaluation(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    entry = record_touch("repair", 0, "test", "consequence eval", ["A"], blocker / "ledger.jsonl")
    assert entry["ledger"] is None and entry["split"] == "test"


@pytest.mark.slow
def test_eval_cli_records_the_touch_and_warns_on_test_reuse(tmp_path):
    from consequence.cli import app
    from consequence.distill.warmstart import BUNDLED
    from policy_copies import other_policy

    runner = CliRunner()
    args = [
        "eval",
        "--split",
        "test",
        "--problems",
        "1",
        "-n",
        "2",
        "-k",
        "1,2",
        "--no-recovery",
        "--selection",
        "first,majority",
    ]
    first = runner.invoke(app, args + ["--out", str(tmp_path / "e1")])
    assert first.exit_code == 0, first.output
    other = other_policy(tmp_path / "other-policy")  # made after the bundled model's test result existed
    second = runner.invoke(app, args + ["--model", str(other), "--out", str(tmp_path / "e2")])
    assert second.exit_code == 0, second.output
    r1 = json.loads((tmp_path / "e1" / "eval.json").read_text())
    r2 = json.loads((tmp_path / "e2" / "eval.json").read_text())
    assert r1["warnings"] == [] and len(r2["warnings"]) == 1 and str(BUNDLED) in r2["warnings"][0]
    assert [t["split"] for t in r2["splits_touched"]] == ["test"]
    assert set(r2["final_selection"]) == {"first", "majority"} and "recovery" not in r2
    assert "**Warning:**" in (tmp_path / "e2" / "report.md").read_text()
    from consequence.evaluate.shortcuts import SHORTCUT_METRICS

    assert list(r1["shortcuts"]) == [k for k, _ in SHORTCUT_METRICS]  # evaluate/shortcuts.py, in eval.json
    assert "## Shortcut diagnostics" in (tmp_path / "e1" / "report.md").read_text()
    bad = runner.invoke(app, ["eval", "--selection", "best", "--out", str(tmp_path / "e3")])
    assert bad.exit_code == 2 and "give one or more of first, majority, visible" in bad.output


@pytest.mark.slow
def test_compare_cli_pairs_success_and_recovery(tmp_path):
    from consequence.cli import app
    from consequence.distill.warmstart import BUNDLED
    from policy_copies import other_policy

    same = other_policy(tmp_path / "pad-row-moved")  # other weights, the same behaviour
    res = CliRunner().invoke(
        app, ["compare", str(BUNDLED), str(same), "--problems", "2", "-n", "2", "--out", str(tmp_path / "c")]
    )
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "c" / "compare.json").read_text())
    # the same behaviour, identical seeds: every episode pair is identical
    for key in ("paired", "paired_recovery"):
        c = out[key]
        assert c["diff"] == 0.0 and c["a_mean"] == c["b_mean"] and c["episodes"] == 4 and c["ties"] == 2
    md = (tmp_path / "c" / "compare.md").read_text()
    assert "| recovery after the same wrong first patch |" in md and "# Policy B" in md


def test_ledger_knows_a_policy_by_its_weights(tmp_path, monkeypatch):
    import os
    import shutil

    from consequence.distill.warmstart import BUNDLED

    path = tmp_path / "ledger.jsonl"
    model = tmp_path / "m"
    shutil.copytree(BUNDLED, model)
    record_touch("repair", 0, "test", "consequence eval", [str(model)], path)
    monkeypatch.chdir(tmp_path)
    assert reuse_warning("repair", 0, ["m"], path) is None  # the same folder, named relatively
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched, same bytes
    assert reuse_warning("repair", 0, ["m"], path) is None
    assert reuse_warning("repair", 0, [str(BUNDLED)], path) is None  # identical weights elsewhere
    shutil.rmtree(model)
    from policy_copies import other_policy

    other_policy(model)  # retrained in place after the test result: other weights
    w = reuse_warning("repair", 0, ["m"], path)
    assert w is not None and str(model) in w


def test_bad_eval_and_compare_requests_fail_before_any_touch(tmp_path):
    import os

    from consequence.cli import app

    runner = CliRunner()
    ledger = tmp_path / "split-ledger.jsonl"
    assert os.environ["CONSEQUENCE_LEDGER"] == str(ledger)
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    blocker = tmp_path / "afile"
    blocker.write_text("")
    cases = [
        (["eval", "-k", "", "--out", str(tmp_path / "e")], "-k ''"),
        (["eval", "--selection", "", "--out", str(tmp_path / "e")], "--selection ''"),
        (["eval", "--model", str(half), "--out", str(tmp_path / "e")], "missing tokenizer.json"),
        (["eval", "--out", str(blocker)], "--out"),
        (["compare", str(half), str(half), "--out", str(tmp_path / "c")], "A "),
        (
            [
                "compare",
                "consequence/assets/tiny-repair",
                "consequence/assets/tiny-repair",
                "--problems",
                "1",
                "--out",
                str(tmp_path / "c"),
            ],
            "at least 2 problems",
        ),
    ]
    for args, needle in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and needle in res.output, (args, res.output)
    assert not ledger.exists()


@pytest.mark.slow
def test_a_first_comparison_on_test_does_not_warn_about_its_own_arms(tmp_path):
    from consequence.cli import app
    from consequence.distill.warmstart import BUNDLED
    from policy_copies import other_policy

    other = other_policy(tmp_path / "b")
    for out in ("c", "c-again"):  # the same comparison again: still only its own two arms
        res = CliRunner().invoke(
            app,
            [
                "compare",
                str(BUNDLED),
                str(other),
                "--split",
                "test",
                "--problems",
                "2",
                "-n",
                "1",
                "--no-recovery",
                "--out",
                str(tmp_path / out),
            ],
        )
        assert res.exit_code == 0, res.output
        result = json.loads((tmp_path / out / "compare.json").read_text())
        assert result["a"]["warnings"] == [] and result["b"]["warnings"] == [] and "warning" not in res.output
