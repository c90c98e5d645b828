"""Recipes: each loads, explains itself, and trains on the default task with one command."""

import json
import math
import os

import pytest
from rich.console import Console
from typer.testing import CliRunner

import consequence.rollout.collect as collect_module
from consequence.cli import app
from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.recipes import differences, load_recipe, recipe_names
from consequence.records import ModelCall, Trajectory
from consequence.report.explain import render_difference, render_recipe
from consequence.rollout.collect import collect
from reward_signal import ODD_SAMPLES_VERIFIED, ODD_SAMPLES_WIN

ALL = [
    "cispo",
    "cross_stage_distill",
    "dapo",
    "dpo",
    "dr_grpo",
    "gkd",
    "grpo",
    "gspo",
    "on_policy_distill",
    "ppo",
    "reinforce",
    "rejection_sft",
    "rloo",
]
DISTILL = ("cross_stage_distill", "gkd", "on_policy_distill")


def test_the_thirteen_recipes_are_bundled_and_valid():
    assert recipe_names() == ALL
    for name in ALL:
        r = load_recipe(name)
        cfg = r.train_config()
        assert cfg.recipe == name and cfg.run_dir == os.path.abspath(f"runs/repair-{name}")  # stored absolute


def test_recipes_name_their_papers_choices():
    assert differences(load_recipe("grpo"), load_recipe("dr_grpo")) == {
        "credit": {"advantage": ("grpo", "dr_grpo")},
        "update": {
            "kl_coef": (0.04, 0.0),
            "norm_const": (0, 384),
            "reduction": ("seq_mean_token_mean", "seq_mean_token_sum_norm"),
        },
    }
    dapo = load_recipe("dapo").train_config()
    assert (dapo.clip_eps, dapo.clip_eps_high, dapo.dynamic_sampling, dapo.reduction) == (0.2, 0.28, True, "token_mean")
    assert differences(load_recipe("reinforce"), load_recipe("rloo")) == {
        "credit": {"advantage": ("reinforce", "rloo")}
    }


def test_explain_marks_changed_boxes_and_cites_sections():
    console = Console(record=True, width=200)
    render_recipe(load_recipe("dapo"), console)
    text = console.export_text()
    assert "4 of 7 boxes" in text and "§3.2 dynamic sampling" in text and "● rollout" in text
    console = Console(record=True, width=200)
    render_difference(load_recipe("reinforce"), load_recipe("reinforce"), console)
    assert "same settings in every box" in console.export_text()


def test_bad_recipes_are_reported(tmp_path):
    with pytest.raises(ValueError, match="unknown recipe 'trpo'.*cispo, cross_stage_distill, dapo"):
        load_recipe("trpo")
    bad = tmp_path / "mine.yaml"
    bad.write_text("name: mine\ntitle: M\nsummary: s\npaper: p\nconfig: {advantage: grpo, clip: 0.1}\n")
    with pytest.raises(ValueError, match="unknown config key.*clip"):
        load_recipe(bad)
    bad.write_text("name: mine\ntitle: M\nsummary: s\npaper: p\nconfig: {advantage: gpro}\n")
    with pytest.raises(ValueError, match="advantage"):
        load_recipe(bad)
    bad.write_text("name: mine\ntitle: M\nconfig: {}\n")
    with pytest.raises(ValueError, match="lacks summary, paper"):
        load_recipe(bad)


def test_cli_recipe_errors_exit_before_work(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--recipe", "trpo", "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "unknown recipe" in res.output
    assert not (tmp_path / "r" / "config.yaml").exists()
    res = runner.invoke(app, ["explain", "grpo", "dapo"])
    assert res.exit_code == 0 and "clip_eps_high" in res.output


def _fake_group(gid: str, rewards):
    """Scored episodes of one sampled token each (an episode with none leaves its group: case 15)."""
    return [
        Trajectory(
            task_id=gid,
            group_id=gid,
            sample_id=i,
            seed=i,
            policy_version=0,
            reward=r,
            reward_components={"hidden_tests": r},
            calls=[ModelCall([1], [2], [-0.5], "length")],
        )
        for i, r in enumerate(rewards)
    ]


class _Split:
    reward_components = ("hidden_tests",)


def test_dynamic_sampling_keeps_mixed_groups_and_reports_counts(monkeypatch):
    rounds = [
        [_fake_group("a", [1, 1]), _fake_group("b", [0, 1]), _fake_group("c", [0, 0])],
        [_fake_group("d", [1, 0]), _fake_group("e", [1, 0]), _fake_group("f", [1, 1])],
    ]
    monkeypatch.setattr(collect_module, "roll_out_round", lambda it, r, *a: (rounds[r], {}))
    cfg = TrainConfig(tasks_per_iteration=3, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    trajs, stats = collect(0, cfg, None, _Split(), None)
    assert [t.group_id for t in trajs] == ["b", "b", "d", "d", "e", "e"]
    assert stats == {"groups_generated": 6, "groups_kept": 3, "groups_dropped": 3, "gen_tokens_total": 12}
    cfg = TrainConfig(tasks_per_iteration=3, dynamic_sampling=True, dynamic_sampling_max_rounds=1)
    trajs, stats = collect(0, cfg, None, _Split(), None)  # the limit: train on what was kept
    assert stats == {"groups_generated": 3, "groups_kept": 1, "groups_dropped": 2, "gen_tokens_total": 6}


def test_dynamic_sampling_reads_accuracy_not_the_shaped_total(monkeypatch):
    """DAPO §3.2 keeps a group when 0 < #correct < G. Group a: both right, one with an
    overlong penalty (totals 1.0 and 0.6): the totals differ, the accuracy does not -- dropped.
    Group b: one right (1.0 - 0.4) and one wrong (0.0) -- kept. Group c: both wrong, one
    penalised (0.0 and -1.0) -- dropped. On the shaped total all three were kept."""

    def shaped(gid, accuracy, overlong):
        group = _fake_group(gid, accuracy)
        for t, a, o in zip(group, accuracy, overlong):
            t.reward, t.reward_components = a + o, {"hidden_tests": a, "overlong": o}
        return group

    rounds = [
        [
            shaped("a", [1.0, 1.0], [0.0, -0.4]),
            shaped("b", [1.0, 0.0], [-0.4, 0.0]),
            shaped("c", [0.0, 0.0], [0.0, -1.0]),
        ]
    ]
    monkeypatch.setattr(collect_module, "roll_out_round", lambda it, r, *a: (rounds[r], {}))
    cfg = TrainConfig(tasks_per_iteration=3, dynamic_sampling=True, dynamic_sampling_max_rounds=1)
    trajs, stats = collect(0, cfg, None, _Split(), None)
    assert [t.group_id for t in trajs] == ["b", "b"]
    assert stats["groups_kept"] == 1 and stats["groups_dropped"] == 2


@pytest.mark.parametrize("name", ALL)
@pytest.mark.slow
def test_every_recipe_trains_one_iteration(name, teacher_dir, tmp_path):
    from consequence.loop.train import train

    cfg = load_recipe(name).train_config(
        run_dir=str(tmp_path),
        model=str(BUNDLED),
        # The warm start rarely succeeds in 8 tiny rollouts; odd sample ids win instead. For rejection
        # sampling the stand-in reward also decides verification: it keeps verified episodes.
        env=ODD_SAMPLES_VERIFIED if name in ("rejection_sft", "dpo") else ODD_SAMPLES_WIN,
        iterations=1,
        tasks_per_iteration=2,
        group_size=4,
        eval_every=0,
        final_eval_episodes=0,
        **({"dynamic_sampling_max_rounds": 1} if name == "dapo" else {}),  # read only with dynamic sampling
        **({"teacher": str(teacher_dir)} if name in DISTILL else {}),
    )
    train(cfg, Console(quiet=True))
    m = json.loads((tmp_path / "metrics.jsonl").read_text())
    if name == "gkd":
        assert m["distill_divergence"] > 0 and m["teacher_forward_tokens"] > 0
    if name == "rejection_sft":  # odd sample ids win: half of the 8 episodes kept (distinct samples)
        assert m["rejection_attempts"] == 8.0 and m["n_rows"] == m["rejection_accepted"] + 0.0
        assert m["rejection_accepted"] + m["rejection_duplicates"] == 4.0
        assert m["acceptance_rate"] == m["rejection_accepted"] / 8 and m["rows_skipped_zero_advantage"] == 0.0
    if name == "dpo":  # per group of 4, the 2 odd (verified) samples against the 2 even ones: 2 × 4 pairs
        # π_θ = π_ref before the step, so h = 0 up to the sampler–trainer gap (≤ 1e-4 per token, the
        # pre-step check's bound, over ≤ 100 targets per episode: |h| ≤ 2e-2, |Δℓ| ≤ β|h|/2 = 1e-3)
        assert m["dpo_pairs"] == 8.0 and m["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3)
        assert m["dpo_reward_margin"] == pytest.approx(0.0, abs=2e-3) and m["n_rows_trained"] == 8.0
    if name in ("on_policy_distill", "cross_stage_distill"):
        assert m["teacher_reverse_kl"] is not None and m["teacher_forward_tokens"] > 0
    assert m["n_updates"] == cfg.epochs_per_batch * cfg.mini_batches
    assert m["grad_norm"] > 0 and m["ratio_min"] > 0
    if m["n_updates"] == 1:  # one step on fresh samples: the ratio is 1 up to float error
        assert m["ratio_min"] > 0.999 and m["ratio_max"] < 1.001
    if name == "ppo":
        assert m["value_loss"] > 0
    if name == "grpo":
        assert m["kl_ref"] >= 0  # k3 ≥ 0; the first step starts at the reference


def test_a_folder_named_like_a_bundled_recipe_does_not_shadow_it(tmp_path, monkeypatch):
    """Break-test: a `grpo/` folder in the working directory made `--recipe grpo` (and every
    listing that reads all bundled recipes) fail; a bundled name means the bundled recipe."""
    from consequence.recipes import _bundled_knobs

    monkeypatch.chdir(tmp_path)
    for name in ALL:
        (tmp_path / name).mkdir()
    _bundled_knobs.cache_clear()
    assert [load_recipe(n).name for n in ALL] == ALL
    assert "clip_eps_high" in _bundled_knobs()
    res = CliRunner().invoke(app, ["explain", "grpo", "dapo"])
    assert res.exit_code == 0 and "clip_eps_high" in res.output
    (tmp_path / "mine").mkdir()  # a folder that is not a bundled name is still refused clearly
    with pytest.raises(ValueError, match="mine is a directory, not a recipe name"):
        load_recipe("mine")
