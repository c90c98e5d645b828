"""The pilot (``consequence experiment --pilot N``): its measures by hand, the α each arm uses,
and a real pilot whose budget follows from its own eval.json."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.experiment.pilot import acceptance_of, pilot_measures

RESULT = {  # 4 tasks of G = 4: c = 0, 1, 4, 2 successes; one task lost an episode to an env error
    "per_task": [{"n": 4, "c": 0}, {"n": 4, "c": 1}, {"n": 4, "c": 4}, {"n": 3, "c": 2}],
    "outcomes": {"shares": {"finished": 0.75, "truncated_max_turns": 0.125, "truncated_max_new_tokens": 0.0625}},
    "cost": {"gen_tokens_per_episode": 90.5},
}


def test_pilot_measures_by_hand():
    m = pilot_measures(RESULT)
    assert m == {
        "tasks": 4.0,
        "mixed_group_fraction": 2 / 4,  # c = 1 of 4 and c = 2 of 3
        "verified_share": 7 / 15,
        "truncated": 0.1875,
        "mean_tokens": 90.5,
    }
    assert acceptance_of(TrainConfig(dynamic_sampling=True), m) == 0.5
    assert acceptance_of(TrainConfig(advantage="rejection", surrogate="pg"), m) == 7 / 15
    assert acceptance_of(TrainConfig(), m) == 1.0
    with pytest.raises(ValueError, match="no task with a valid episode"):
        pilot_measures({**RESULT, "per_task": [{"n": 0, "c": 0}]})


@pytest.mark.slow  # ~12 s: 8 tasks × 4 samples of the bundled model, once for three arms
def test_a_pilot_plans_each_arm_with_what_it_measured(tmp_path):
    base = {"iterations": 2, "tasks_per_iteration": 2, "group_size": 4, "eval_every": 0, "final_eval_episodes": 2}
    plan = {
        "base": base,
        "seeds": [0],
        "budget": {"allow_unequal": True},
        "arms": {"grpo": {}, "dapo": {"recipe": "dapo", "group_size": 4, "tasks_per_iteration": 2}},
    }
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["experiment", str(tmp_path / "plan.yaml"), "--out", str(out), "--pilot", "8"])
    assert r.exit_code == 0, r.output
    got = json.loads((out / "pilot.json").read_text())
    assert got["grpo"]["pilot"] == got["dapo"]["pilot"]  # one shared pilot (same model, budgets, G, T)
    result = json.loads((tmp_path / got["grpo"]["pilot"] / "eval.json").read_text())
    measured = pilot_measures(result)
    assert len(result["per_task"]) == 8 and all(t["n"] + t["env_errors"] == 4 for t in result["per_task"])
    assert got["grpo"]["measured"] == got["dapo"]["measured"] == pytest.approx(measured)
    assert got["dapo"]["acceptance_rate"] == pytest.approx(measured["mixed_group_fraction"])
    lines = {x["quantity"]: x["value"] for x in got["dapo"]["planned"]}
    a = measured["mixed_group_fraction"]
    assert lines["rollouts generated"] == pytest.approx(min(16 / a, 16 * 3) if a else 48)
    assert lines["generated tokens"] == pytest.approx(lines["rollouts generated"] * measured["mean_tokens"])
    assert not (out / "runs").exists()  # a pilot trains nothing
