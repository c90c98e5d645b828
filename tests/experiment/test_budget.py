"""The budget arithmetic (consequence.experiment.budget, ``consequence plan``): the seeds' worked
numbers, each mode's formula by hand, and a real run's spend read back from its files."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.experiment.budget import attempts_for, plan_lines, read_spent, spent_lines, trajectories_of


def _values(lines) -> dict[str, float]:
    return {x.quantity: x.value for x in lines}


def test_the_seeds_worked_numbers():
    """B = 32, G = 4, K = 100 → 12,800 trajectories; at 2,000 tokens each → 25.6 M tokens;
    1,000 demonstrations at a 25 % acceptance rate → 4,000 attempts (seeds, "turning tasks into
    a rollout budget")."""
    assert trajectories_of(32, 4, 100) == 12_800
    assert attempts_for(1_000, 0.25) == 4_000
    cfg = TrainConfig(tasks_per_iteration=32, group_size=4, iterations=100)
    got = _values(plan_lines(cfg, 2_000, demonstrations=1_000, demo_acceptance_rate=0.25))
    assert got["trajectories trained on"] == 12_800
    assert got["generated tokens"] == 25_600_000
    assert got["demonstration attempts"] == 4_000
    assert got["demonstrator tokens"] == 4_000 * 2_000


def test_each_mode_by_hand():
    base = {"tasks_per_iteration": 8, "group_size": 4, "iterations": 10, "eval_every": 4, "val_episodes": 16}
    # dynamic sampling keeps mixed groups: K·B·G/α, at most K·B·G·rounds
    ds = TrainConfig(**base, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    assert _values(plan_lines(ds, 100, acceptance_rate=0.5))["rollouts generated"] == 320 / 0.5
    assert _values(plan_lines(ds, 100, acceptance_rate=0.2))["rollouts generated"] == 320 * 3  # capped
    # what is trained on: at most B groups per iteration, and what 3 rounds find at α
    assert _values(plan_lines(ds, 100, acceptance_rate=0.5))["trajectories trained on"] == 320
    assert _values(plan_lines(ds, 100, acceptance_rate=0.2))["trajectories trained on"] == pytest.approx(320 * 3 * 0.2)
    assert _values(plan_lines(ds, 100, acceptance_rate=0.0))["trajectories trained on"] == 0  # no mixed group found
    assert _values(plan_lines(ds, 100, acceptance_rate=0.5))["generated tokens"] == 640 * 100
    # rejection sampling keeps verified episodes: rollouts·α
    rs = TrainConfig(**base, advantage="rejection", surrogate="pg")
    assert _values(plan_lines(rs, 100, acceptance_rate=0.25))["accepted episodes"] == 80
    # on-policy distillation: the teacher scores every sampled token once
    opd = TrainConfig(**base, advantage="reverse_kl", teacher="/models/t")
    assert _values(plan_lines(opd, 100))["teacher-scored tokens"] == 320 * 100
    # a distillation loss: once per epoch, over every trained token (fixed-data batches too)
    gkd = TrainConfig(**base, distill_loss="reverse", teacher="/models/t", epochs_per_batch=2, distill_lambda=0.5,
                      distill_data="/data/t.parquet")  # fmt: skip
    got = _values(plan_lines(gkd, 100))
    assert got["teacher-scored tokens"] == 2 * 320 * 100
    assert got["trajectories of the student"] == 160 and got["generated tokens"] == 160 * 100
    # validation after iterations 4, 8 and the last (10): ⌈10/4⌉ = 3; the final evaluation runs two
    # policies on 2 splits × 2 decodings
    got = _values(plan_lines(TrainConfig(**base, final_eval_episodes=50), 100))
    assert got["validation episodes"] == 3 * 16
    assert got["final evaluation episodes"] == 2 * 2 * 2 * 50


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: attempts_for(10, 0.0), r"acceptance rate must be in \(0, 1\]"),
        (lambda: attempts_for(10, 1.5), r"acceptance rate must be in \(0, 1\]"),
        (lambda: attempts_for(-1, 0.5), "must be >= 0"),
        (lambda: trajectories_of(0, 4, 10), "tasks_per_iteration must be >= 1"),
        (lambda: plan_lines(TrainConfig(), -5), "must be >= 0"),
        (lambda: spent_lines(TrainConfig(), [{}], []), "1 metrics lines but 0 trajectory files"),
    ],
)
def test_bad_numbers_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.slow  # ~10 s: a two-iteration run of the bundled model
def test_a_run_spends_what_its_plan_says(tmp_path):
    """Planned from the run's settings with its measured L̄, every quantity equals what the run's
    files say it spent, and those equal a direct count over the files."""
    from rich.console import Console

    from consequence.loop.train import train

    run = tmp_path / "run"
    cfg = TrainConfig(run_dir=str(run), iterations=2, tasks_per_iteration=2, group_size=2, eval_every=1,
                      val_episodes=2, final_eval_episodes=2)  # fmt: skip
    train(cfg, Console(quiet=True))
    saved, spent = read_spent(run)
    got = _values(spent)
    trajs = [pq.read_table(f) for f in sorted((run / "trajectories").glob("iter_*.parquet"))]
    assert got["trajectories trained on"] == sum(t.num_rows for t in trajs) == 2 * 2 * 2
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert got["generated tokens"] == sum(m["gen_tokens_total"] for m in metrics)
    assert got["validation episodes"] == 2 * 2
    assert got["final evaluation episodes"] == 2 * 2 * 2 * 2
    planned = _values(plan_lines(saved, got["L̄, measured"]))
    for quantity in ("trajectories trained on", "validation episodes", "final evaluation episodes"):
        assert planned[quantity] == got[quantity], quantity
    assert planned["generated tokens"] == pytest.approx(got["generated tokens"], rel=1e-12)

    r = CliRunner().invoke(app, ["plan", "--run", str(run), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["mean_tokens_from"] == "measured"
    assert {x["quantity"]: x["value"] for x in out["spent"]} == got  # the CLI prints the files' numbers


def test_the_cli_prints_the_seeds_numbers_and_refuses_bad_input(tmp_path):
    runner = CliRunner()
    args = ["plan", "--tasks-per-iteration", "32", "--group-size", "4", "--iterations", "100", "--mean-tokens", "2000"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    got = {x["quantity"]: x["value"] for x in json.loads(r.output)["planned"]}
    assert got["trajectories trained on"] == 12_800 and got["generated tokens"] == 25_600_000
    r = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "12,800" in r.output and "25,600,000" in r.output
    # without --mean-tokens: the episode's generation budget, said so
    r = runner.invoke(app, ["plan", "--json"])
    assert (
        json.loads(r.output)["mean_tokens"] == min(8 * 48, 768) and json.loads(r.output)["mean_tokens_from"] == "L_max"
    )
    r = runner.invoke(app, [*args, "--json"])
    assert "above the episode's generation budget L_max" in json.loads(r.output)["warnings"][0]  # 2000 > 384
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1, "gen')
    for bad, said in (
        (["plan", "--run", str(tmp_path)], "no config.yaml"),
        (["plan", "--run", str(tmp_path / "nope")], "no such folder"),
        (["plan", "--run", str(tmp_path / "run" / "config.yaml")], "is a file, not a run folder"),
        (["plan", "--run", str(tmp_path / "run")], "metrics.jsonl line 2 is not JSON (cut short?)"),
        (["plan", "--run", str(tmp_path), "--iterations", "3"], "drop --iterations"),
        (["plan", "--run", str(tmp_path), "--mean-tokens", "50"], "drop --mean-tokens"),
        (["plan", "--acceptance-rate", "0.5"], "--acceptance-rate has no effect without --dynamic-sampling"),
        (["plan", "--demo-acceptance-rate", "0.5"], "--demo-acceptance-rate has no effect without --demonstrations"),
        (["plan", "--advantage", "rloo", "--grpo-std", "sample"], "--grpo-std has no effect"),
    ):
        r = runner.invoke(app, bad, env={"COLUMNS": "200"})
        assert r.exit_code == 2 and said in " ".join(r.output.split()) and "Traceback" not in r.output, r.output


def test_plan_refuses_environment_options_that_train_refuses():
    """A plan with --env-option makes the environment as train does: the calculator's held-out
    shift has no train split, an unknown option is named; a good option plans (negative control)."""
    runner = CliRunner()
    for bad, said in (
        (
            ["--env-option", "shift=true"],
            "option shift=true is the held-out shift, for evaluation only: it has no train split",
        ),  # fmt: skip
        (["--env-option", "colour=red"], "--env calculator: unknown option 'colour'"),
    ):
        r = runner.invoke(app, ["plan", "--env", "calculator", *bad], env={"COLUMNS": "400"})
        assert r.exit_code == 2 and said in " ".join(r.output.split()) and "Traceback" not in r.output, r.output
    r = runner.invoke(app, ["plan", "--env", "calculator", "--env-option", "max_calls=2", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["planned"], r.output
