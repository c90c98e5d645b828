"""An experiment's arms over training seeds (consequence.experiment.aggregate): hand-made run
folders (2 arms × 2 seeds × 3 problems × 2 episodes, chosen outcomes), every statistic by hand
or by a direct call of evaluate.seeds on the same table."""

from __future__ import annotations

import json
import re

import pytest

from consequence.evaluate import seeds
from consequence.experiment.aggregate import aggregate, per_problem_success, write_report
from consequence.experiment.budget import BudgetLine
from consequence.records import Trajectory, write_trajectories

# Episodes per problem: (task id, sample id). p1's two episodes are two instances of one problem.
EPISODES = {"p0": [("p0#0", 0), ("p0#0", 1)], "p1": [("p1#0", 0), ("p1#1", 0)], "p2": [("p2#0", 0), ("p2#0", 1)]}
E = None  # an episode whose environment failed
# problem → each episode's success (1, 0, or E), per run; per-problem success in the comments
A1 = {"p0": [1, 1], "p1": [1, 0], "p2": [0, 0]}  # 1, 0.5, 0 → seed mean 0.5
A2 = {"p0": [1, 0], "p1": [1, 1], "p2": [1, E]}  # 0.5, 1, 1 (the env error is out of p2's denominator) → 5/6
B1 = {"p0": [0, 0], "p1": [1, 0], "p2": [0, 0]}  # 0, 0.5, 0 → 1/6
B2 = {"p0": [1, 1], "p1": [1, 0], "p2": [0, E]}  # 1, 0.5, 0 → 0.5
WARM = {"p0": [1, 0], "p1": [0, 0], "p2": [0, 0]}  # 0.5, 0, 0 → 1/6, the same starting policy in every run


def _episodes(outcomes, shift=0):
    out = []
    for problem, results in outcomes.items():
        for (task, sample), ok in zip(EPISODES[problem], results):
            if ok is None:
                out.append(Trajectory(task, task, sample + shift, 0, 0, outcome="env_error"))
            else:
                out.append(Trajectory(task, task, sample + shift, 0, 0, outcome="finished", verifier_score=float(ok)))
    return out


def _run(root, name, rl, warm=WARM, shift=0):
    """A run folder with the files aggregate reads: report.json and eval/test-sampled-{rl,warmstart}.parquet."""
    run = root / name
    files = []
    for policy, outcomes in (("warmstart", warm), ("rl", rl)):
        write_trajectories(run / "eval" / f"test-sampled-{policy}.parquet", _episodes(outcomes, shift))
        files.append(f"eval/test-sampled-{policy}.parquet")
    (run / "report.json").write_text(json.dumps({"results": [], "evaluation_files": files, "episodes_per_split": 6}))
    return run


@pytest.fixture
def runs(tmp_path):
    return {
        "A": [_run(tmp_path, "A-seed0", A1), _run(tmp_path, "A-seed1", A2)],
        "B": [_run(tmp_path, "B-seed0", B1), _run(tmp_path, "B-seed1", B2)],
    }


def test_per_problem_success_by_hand(runs):
    assert per_problem_success(runs["A"][1], "test", "sampled", "rl") == {"p0": 0.5, "p1": 1.0, "p2": 1.0}
    assert per_problem_success(runs["B"][0], "test", "sampled", "rl") == {"p0": 0.0, "p1": 0.5, "p2": 0.0}
    assert per_problem_success(runs["B"][0], "test", "sampled", "warmstart") == {"p0": 0.5, "p1": 0.0, "p2": 0.0}


def test_a_missing_evaluation_file_or_unknown_policy_is_named(runs):
    with pytest.raises(ValueError, match=re.escape(str(runs["A"][0] / "eval" / "train-greedy-rl.parquet"))):
        per_problem_success(runs["A"][0], "train", "greedy", "rl")
    with pytest.raises(ValueError, match="policy 'trained'"):
        per_problem_success(runs["A"][0], "test", "sampled", "trained")


def test_aggregate_by_hand_and_by_direct_computation(runs):
    result = aggregate(runs)
    # the (split, decoding) pairs default to those of the first run's report.json
    assert [(r["split"], r["decoding"]) for r in result["results"]] == [("test", "sampled")]
    res = result["results"][0]
    a, b = res["arms"]["A"], res["arms"]["B"]
    # per-seed success: the mean over problems of per-problem success
    assert a["per_seed"] == pytest.approx([0.5, 5 / 6], abs=1e-15)  # three terms in [0, 1]: a few ulps at most
    assert b["per_seed"] == pytest.approx([1 / 6, 0.5], abs=1e-15)
    profile = dict(zip(a["performance_profile"]["thresholds"], a["performance_profile"]["share_above"]))
    assert (profile[0.45], profile[0.5], profile[0.8], profile[0.85]) == (1.0, 0.5, 0.5, 0.0)  # seeds 0.5 and 5/6
    tables = {"A": [[1.0, 0.5, 0.0], [0.5, 1.0, 1.0]], "B": [[0.0, 0.5, 0.0], [1.0, 0.5, 0.0]]}
    for name, arm in (("A", a), ("B", b)):
        assert arm["per_problem"] == [dict(zip(("p0", "p1", "p2"), row)) for row in tables[name]]
        assert arm["mean"] == sum(arm["per_seed"]) / 2  # the estimate is the mean of the per-seed means
        assert (arm["mean"], arm["low"], arm["high"]) == seeds.two_level_bootstrap(tables[name], 0.95, 10_000, 0)
        assert arm["iqm"] == seeds.iqm(arm["per_seed"])
        assert arm["policy"] == "rl"
        assert (arm["n_seeds"], arm["n_problems"], arm["n_episodes"], arm["env_errors"]) == (2, 3, 6, 1)
    assert a["low"] < a["mean"] < a["high"]  # the interval is not degenerate on this table
    # probability of improvement over the 2 × 2 seed pairs: A's (0.5, 5/6) against B's (1/6, 0.5):
    # 0.5 > 1/6, 0.5 = 0.5 (half), 5/6 > both → 3.5 / 4
    assert res["probability_of_improvement"] == {"A": {"B": 0.875}, "B": {"A": 0.125}}
    # A − B: the difference of means (2/3 − 1/3) with the crossed bootstrap of the same tables
    ab = res["differences_between_arms"]["A"]["B"]
    direct = seeds.arm_difference(tables["A"], tables["B"], 0.95, 10_000, 0)
    assert (ab["mean"], ab["low"], ab["high"], ab["n_problems"]) == (*direct, 3)
    assert ab["mean"] == pytest.approx(1 / 3, abs=1e-15)
    ba = res["differences_between_arms"]["B"]["A"]  # the mirror of the same bootstrap: the matrix is antisymmetric
    assert (ba["mean"], ba["low"], ba["high"], ba["n_problems"]) == (-ab["mean"], -ab["high"], -ab["low"], 3)
    assert "A" not in res["differences_between_arms"]["A"]  # no arm minus itself


def test_a_no_training_arm_reads_the_warm_start_files(runs):
    arms = {"start": runs["A"], "B": runs["B"]}
    res = aggregate(arms, ["test"], ["sampled"], no_training={"start"})["results"][0]
    start = res["arms"]["start"]
    assert start["policy"] == "warmstart"
    assert start["per_seed"] == [0.5 / 3, 0.5 / 3]  # WARM: 0.5, 0, 0 in both runs
    # B's (1/6, 0.5) against the start's (1/6, 1/6): two ties (half each), two wins → (2·0.5 + 2) / 4
    assert res["probability_of_improvement"]["B"]["start"] == 0.75
    trained = aggregate(arms, ["test"], ["sampled"])["results"][0]["arms"]["start"]  # the same runs, read as trained
    assert trained["per_seed"] == pytest.approx([0.5, 5 / 6], abs=1e-15)


def test_runs_on_different_episodes_are_refused_with_both_names(runs, tmp_path):
    other = _run(tmp_path, "B-seed2", B1, shift=1)  # the same problems, other sample ids
    with pytest.raises(ValueError, match="not evaluated on the same episodes") as e:
        aggregate({"A": runs["A"], "B": [*runs["B"], other]})
    assert str(runs["A"][0]) in str(e.value) and str(other) in str(e.value)


def test_bad_arms_are_refused(runs):
    with pytest.raises(ValueError, match="no_training names C"):
        aggregate(runs, no_training={"C"})
    with pytest.raises(ValueError, match="arm 'B' has no run folder"):
        aggregate({"A": runs["A"], "B": []})


def test_the_report_holds_the_numbers_and_their_seeds(runs, tmp_path):
    result = aggregate(runs, no_training=set())
    spent = {
        "A": [
            [BudgetLine("generated tokens", "Σ", 100.0, "tokens")],
            [BudgetLine("generated tokens", "Σ", 300.0, "tokens")],
        ],
        "B": [
            [BudgetLine("generated tokens", "Σ", 50.0, "tokens")],
            [BudgetLine("generated tokens", "Σ", 70.0, "tokens")],
        ],
    }
    paths = write_report(tmp_path / "out", result, spent)
    assert [p.name for p in paths] == ["experiment.json", "experiment.md", "experiment.png"]
    saved = json.loads(paths[0].read_text())
    assert saved["results"] == result["results"]  # exact numbers: JSON floats round-trip
    assert [r["mean_per_seed"] for r in saved["spent"]["A"]] == [200.0]
    md = paths[1].read_text()
    for name, arm in saved["results"][0]["arms"].items():
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} | {100 * arm['mean']:.1f} "))
        assert f"({arm['n_seeds']} seeds)" in row
        assert f"[{100 * arm['low']:.1f}, {100 * arm['high']:.1f}]" in row
        assert f"| {100 * arm['iqm']:.1f} | 2 | 3 | 6 |" in row
    assert "| A | — | 0.875 (2×2 seeds) |" in md and "| B | 0.125 (2×2 seeds) | — |" in md
    assert "| A | generated tokens | tokens | 200 | 400 | 2 |" in md
    ab = saved["results"][0]["differences_between_arms"]["A"]["B"]
    assert f"| A (2 seeds) | — | {100 * ab['mean']:+.1f} [{100 * ab['low']:+.1f}, {100 * ab['high']:+.1f}]" in md
    assert "Differences whose CI excludes 0: " in md
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_paired_difference_is_the_two_level_bootstrap_of_per_problem_differences():
    from consequence.evaluate.seeds import two_level_bootstrap
    from consequence.experiment.aggregate import paired_difference

    arm = [{"p": 1.0, "q": 0.5, "r": 0.0}, {"p": 1.0, "q": 1.0, "r": 0.5}]
    start = [{"p": 0.5, "q": 0.5, "r": 0.5}, {"p": 0.5, "q": 0.5, "r": 0.5}]
    d = paired_difference(arm, start)
    table = [[0.5, 0.0, -0.5], [0.5, 0.5, 0.0]]  # by hand
    assert d["per_seed"] == [0.0, pytest.approx(1 / 3)]
    assert (d["mean"], d["low"], d["high"]) == two_level_bootstrap(table)
    with pytest.raises(ValueError, match="2 seeds against a baseline of 1"):
        paired_difference(arm, start[:1])
    with pytest.raises(ValueError, match="seed 0: no problem scored by both"):
        paired_difference([{"x": 1.0}], [{"y": 0.0}])


def test_the_report_tables_a_sweep_and_draws_the_curves_and_the_scale_figure(runs, tmp_path):
    result = aggregate(runs, ["test"], ["sampled"])
    curve = {"episodes": [8, 16], "mean": [0.1, 0.2], "low": [0.0, 0.1], "high": [0.2, 0.3], "n_seeds": [2, 2]}
    swept = {"train_problems": {"arms": {"A": 625, "B": 16}}}
    paths = write_report(tmp_path, result, None, {"A": {"success": curve}, "B": {}}, swept)
    names = [p.name for p in paths]
    assert names == [
        "experiment.json",
        "experiment.md",
        "experiment.png",
        "experiment_curves.png",
        "experiment_scale.png",
    ]
    md = paths[1].read_text()
    a, b = (result["results"][0]["arms"][n] for n in ("A", "B"))
    lines = [line for line in md.splitlines() if line.startswith(("| 16 |", "| 625 |"))]
    assert lines == [  # sorted by the swept value
        f"| 16 | B | {100 * b['mean']:.1f} (2 seeds) [{100 * b['low']:.1f}, {100 * b['high']:.1f}] |",
        f"| 625 | A | {100 * a['mean']:.1f} (2 seeds) [{100 * a['low']:.1f}, {100 * a['high']:.1f}] |",
    ]
    assert "![experiment_scale.png](experiment_scale.png)" in md
    saved = json.loads(paths[0].read_text())
    assert saved["sweeps"] == swept and saved["curves"]["A"]["success"] == curve
    assert paths[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in write_report(tmp_path / "plain", result)][2:] == ["experiment.png"]  # nothing to draw
