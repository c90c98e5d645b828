"""SFT on the environment demonstrator's demonstrations as a run (issue 32's "more SFT" arm):
``consequence demos`` writes them in the student's tokens, and ``--recipe rejection_sft
--distill-lambda 0 --distill-data FILE`` trains the SFT loss on them."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.credit.batch import assign_credit, training_rows
from consequence.distill.demos import write_demonstrations
from consequence.distill.fixed_data import load_fixed_data
from consequence.distill.sft import sft_step_gradients
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.loop.learner import logprob_fn, make_learner
from consequence.policy.tiny import BUNDLED, load_policy
from consequence.recipes import load_recipe
from consequence.records import read_trajectories
from consequence.update.step import accumulate_gradients

N = 6


@pytest.fixture(scope="module")
def demos_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("demos") / "demos.parquet"
    record = write_demonstrations(BUNDLED, out, N, log=lambda _: None)
    assert record["verified"] == len(read_trajectories(out))
    return out


def _sft_settings(data) -> dict:
    return {"distill_lambda": 0.0, "distill_data": str(data)}


def test_demos_are_verified_train_episodes_in_the_students_own_tokens(demos_file):
    env = load_environment("repair", 0)
    demos = read_trajectories(demos_file)
    assert len(load_fixed_data(demos_file, env.split)) == len(demos) == N  # all verified, all train problems
    _, tok = load_policy(BUNDLED)
    renderer = Renderer(tok, env.tools)
    for t in demos:
        assert t.outcome == "finished" and t.verifier_score == 1.0 and t.reward_components["hidden_tests"] == 1.0
        first = t.messages[2]["tool_calls"][0]["function"]
        assert t.calls[0].context_ids == renderer.prompt_ids(t.messages[:2])
        assert t.calls[0].output_ids == renderer.encode(renderer.format_call(first["name"], first["arguments"])) + [
            renderer.eot_id
        ]
        assert t.calls[0].sample_logprobs == [0.0] * len(t.calls[0].output_ids)  # the teacher is not a sampler


def test_the_default_draw_is_not_the_warm_starts_own_demonstrations(tmp_path, demos_file):
    """Draw seed 1000 (default) gives other task instances than the warm start's (draw seed = split seed)."""
    own = tmp_path / "own.parquet"
    write_demonstrations(BUNDLED, own, N, draw_seed=0, log=lambda _: None)
    ours = {t.task_id for t in read_trajectories(demos_file)}
    assert ours.isdisjoint(t.task_id for t in read_trajectories(own))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"advantage": "grpo"}, "cannot train with --advantage grpo"),
        ({"advantage": "rejection", "surrogate": "ppo_clip"}, "--advantage rejection --surrogate pg"),
        ({"advantage": "rejection", "surrogate": "pg", "tis_cap": 2.0}, "cannot train with --tis-cap 2"),
    ],
)
def test_fixed_data_without_a_teacher_is_sft_or_refused(kw, match, demos_file):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**_sft_settings(demos_file), **kw)
    cfg = load_recipe("rejection_sft").train_config(**_sft_settings(demos_file))
    assert (cfg.advantage, cfg.surrogate, cfg.reduction, cfg.distill_loss) == ("rejection", "pg", "token_mean", "none")


def test_the_update_on_demonstrations_is_the_sft_gradient(demos_file):
    """advantage 1 on every verified episode, the ratio-free surrogate, a token mean over the
    step = −(1/T)·Σ log π(y_t), the gradient of ``distill.sft`` (the warm start's SFT)."""
    cfg = load_recipe("rejection_sft").train_config(**_sft_settings(demos_file))
    demos = read_trajectories(demos_file)
    model, tok = load_policy(BUNDLED)
    direct = copy.deepcopy(model)
    learner = make_learner(cfg, model)
    rows, owner = training_rows(demos)
    batch = assign_credit(demos, rows, owner, cfg, pad_id=tok.pad_token_id)
    assert batch.advantages == [1.0] * len(rows)
    accumulate_gradients(
        model, batch.rows, batch.advantages, learner.update_cfg, tok.pad_token_id, logprob_fn(cfg),
        sampler_logprobs=batch.sampler_logprobs,
    )  # fmt: skip
    sft_step_gradients(direct, rows, tok.pad_token_id, micro_batch_size=2)
    g_loop = torch.cat([p.grad.flatten() for p in model.parameters()])
    g_sft = torch.cat([p.grad.flatten() for p in direct.parameters()])
    # Float32 sums of ~T target terms in two orders: each differs by at most ~T·eps·max|term|.
    n_targets = sum(sum(r.loss_mask[1:]) for r in rows)
    bound = n_targets * torch.finfo(torch.float32).eps * g_sft.abs().max()
    assert (g_loop - g_sft).abs().max() <= bound


@pytest.mark.slow
def test_an_sft_run_on_demonstrations_trains_on_the_file_only(tmp_path, demos_file):
    from consequence.loop.train import train

    run = tmp_path / "run"
    cfg = load_recipe("rejection_sft").train_config(
        run_dir=str(run), iterations=2, tasks_per_iteration=2, group_size=2, eval_every=0, final_eval_episodes=0,
        **_sft_settings(demos_file),
    )  # fmt: skip
    train(cfg, Console(quiet=True))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:  # 4 of the 6 demonstrations per iteration, each accepted; no ratio against log-prob 0
        assert m["fixed_data_batch"] == 1.0 and m["gen_tokens_total"] == 0 and m["rejection_accepted"] == 4
        assert m["success"] is None and not {"ratio_mean", "first_step_ratio_min", "clip_frac_low"} & set(m)


def test_demos_cli_refuses_an_environment_without_a_demonstrator(tmp_path):
    res = CliRunner().invoke(
        app, ["demos", "--out", str(tmp_path / "d.parquet"), "--env", "humaneval", "-n", "2"], env={"COLUMNS": "400"}
    )
    assert res.exit_code == 2 and "no demonstrator" in res.output and "--demos-file" in res.output
    assert not (tmp_path / "d.parquet").exists()
