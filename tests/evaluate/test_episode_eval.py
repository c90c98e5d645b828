"""pass@k over episodes, costs, caps and the eval / compare commands' input checks."""

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.evaluate.episode_eval import cost_summary, per_task_counts, success_under_caps, summarize_pass_at_k
from consequence.evaluate.run import default_samples
from consequence.records import ModelCall, Trajectory


def _episode(task, j, ok, outcome="finished", tools=2, tokens=10):
    call = ModelCall([1], list(range(tokens)), [0.0] * tokens, "stop")
    t = Trajectory(
        task_id=task,
        group_id=task,
        sample_id=j,
        seed=j,
        policy_version=0,
        calls=[call],
        outcome=outcome,
        verifier_score=1.0 if ok else 0.0,
    )
    t.n_tool_calls = tools
    return t


def test_pass_at_k_reference_and_naive_value():
    # one task with n = 10, c = 2: pass@3 = 1 - C(8,3)/C(10,3) = 1 - 56/120
    trajs = [_episode("p#0", j, j < 2) for j in range(10)] + [_episode("q#0", j, False) for j in range(10)]
    res = summarize_pass_at_k(per_task_counts(trajs), [1, 3])
    naive = 1 - (1 - 2 / 10) ** 3
    print(f"pass@3 unbiased {1 - 56 / 120:.4f}, naive {naive:.4f}")
    assert res["3"]["pass_at_k"] == pytest.approx((1 - 56 / 120) / 2)
    assert res["1"]["pass_at_k"] == pytest.approx(0.1)
    assert round(naive, 3) == 0.488


def test_env_errors_leave_n_and_tasks_short_of_k_are_excluded():
    trajs = [
        _episode("p#0", 0, True),
        _episode("p#0", 1, False, outcome="env_error"),
        _episode("q#0", 0, True),
        _episode("q#0", 1, False),
    ]
    counts = per_task_counts(trajs)
    assert [(d["n"], d["c"], d["env_errors"]) for d in counts] == [(1, 1, 1), (2, 1, 0)]
    res = summarize_pass_at_k(counts, [2])
    assert res["2"]["tasks"] == 1 and res["2"]["tasks_excluded"] == 1 and res["2"]["pass_at_k"] == 1.0


def test_costs_and_caps():
    trajs = [
        _episode("p#0", 0, True, tools=1, tokens=20),
        _episode("p#0", 1, True, tools=5, tokens=40),
        _episode("p#0", 2, False, tools=2, tokens=30),
    ]
    c = cost_summary(trajs)
    assert c["success"] == pytest.approx(2 / 3) and c["gen_tokens_per_success"] == 45.0
    assert success_under_caps(trajs, "n_tool_calls", [1, 4, 5]) == pytest.approx([1 / 3, 1 / 3, 2 / 3])


def test_default_samples_per_task():
    assert [default_samples(None, 0.0), default_samples(None, 0.7), default_samples(3, 0.0)] == [1, 10, 3]


def test_eval_rejects_bad_requests_before_work(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["eval", "-n", "2", "-k", "1,4", "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "between 1 and n = 2" in res.output
    res = runner.invoke(app, ["eval", "--tasks", "mbpp", "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "humaneval" in res.output
    res = runner.invoke(app, ["eval", "--model", str(tmp_path), "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "checkpoint folder" in res.output
    res = runner.invoke(app, ["compare", str(tmp_path), str(tmp_path), "--out", str(tmp_path / "c")])
    assert res.exit_code == 2
    res = runner.invoke(app, ["eval", "--temperature", "-1", "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "--temperature" in res.output
    res = runner.invoke(app, ["eval", "--temperature", "0", "-k", "1,4", "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "between 1 and n = 1" in res.output  # greedy: n defaults to 1, not 10
    res = runner.invoke(app, ["eval", "--problems", "-1", "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "--problems" in res.output
    res = runner.invoke(app, ["compare", str(tmp_path / "nope"), str(tmp_path), "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "A " in res.output and "no such folder" in res.output
    assert not (tmp_path / "e" / "eval.json").exists()
