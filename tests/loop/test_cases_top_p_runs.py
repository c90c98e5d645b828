"""Case 14 on the command line: top-p runs whose weights move between sampling and the update.

Each run is the reported input made small (2 iterations × 2 tasks × 4 rollouts, short
budgets, a larger learning rate so that the weights move within a few steps). Before the
keep-sampling mask was stored, each stopped with "logprobs is not finite" or "kl_ref is
not finite": the trainer recomputed the top-p support from the moved logits and a sampled
token fell outside it.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.distill.warmstart import BUNDLED
from reward_signal import ODD_SAMPLES_WIN

SMALL = [
    "--env",
    ODD_SAMPLES_WIN,  # mixed groups in every iteration, so that every step trains and the weights move
    "--iterations",
    "2",
    "--tasks-per-iteration",
    "2",
    "--group-size",
    "4",
    "--max-turns",
    "3",
    "--max-new-tokens",
    "40",
    "--final-eval-episodes",
    "0",
    "--eval-every",
    "0",
    "--learning-rate",
    "3e-3",
]
CASES = {
    "epochs-and-mini-batches": ["--top-p", "0.9", "--epochs-per-batch", "2", "--mini-batches", "2"],
    "kl-to-reference": ["--top-p", "0.9", "--kl-coef", "0.05"],  # π_ref stays behind the sampler
    "gae": ["--top-p", "0.9", "--advantage", "gae", "--epochs-per-batch", "2", "--mini-batches", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_case_14_top_p_run_finishes_with_ratio_one_on_the_first_step(case, tmp_path):
    run = tmp_path / "run"
    res = CliRunner().invoke(
        app, ["train", "--model", str(BUNDLED), "--run-dir", str(run), *SMALL, *CASES[case]], env={"COLUMNS": "250"}
    )
    assert res.exit_code == 0, res.output
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        m = json.loads(line)
        assert m["optimizer_steps_taken"] == m["n_updates"] > 0
        assert 1 - 1e-4 < m["first_step_ratio_min"] <= m["first_step_ratio_max"] < 1 + 1e-4
        assert 0 < m["ratio_min"] <= m["ratio_max"] and math.isfinite(m["ratio_max"])
        if case == "kl-to-reference":
            assert math.isfinite(m["kl_ref"]) and m["kl_ref"] >= 0
    last = json.loads(lines[-1])
    if case == "kl-to-reference":  # one step per iteration: the policy has moved away from π_ref
        assert last["kl_ref"] > 1e-6
    else:  # later steps of an iteration: the ratio moved away from 1 with the weights
        assert last["ratio_min"] < 1 - 1e-3 or last["ratio_max"] > 1 + 1e-3
