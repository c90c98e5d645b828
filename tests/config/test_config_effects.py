"""A setting that nothing in the run reads is refused with the reason (config.effects): each
row of the table both ways, the message, and the CLI's exit without a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.config.effects import READS, unread_settings

# --distill-loss with --task-reward-weight 0 trains the divergence alone; with a weight > 0, KD + RL
ALONE = {"distill_loss": "jsd", "teacher": "/models/t"}
KD_RL = {**ALONE, "task_reward_weight": 0.5}
OPD = {"advantage": "reverse_kl", "teacher": "/models/t"}  # on-policy distillation (recipe on_policy_distill)
JUDGE = {"judge_url": "http://127.0.0.1:1/v1", "judge_model": "m"}  # an LLM judge as the reward
FIXED_ONLY = {**ALONE, "distill_lambda": 0.0, "distill_data": "/data/teacher.parquet"}  # no rollout at all

# (setting, a value ≠ its default, settings where nothing reads it, settings where it is read)
CASES = [
    ("grpo_std", "sample", {"advantage": "rloo"}, {"advantage": "grpo"}),
    ("grpo_std", "sample", {"advantage": "dr_grpo"}, {"advantage": "grpo"}),
    ("gamma", 0.9, {}, {"advantage": "gae"}),
    ("gae_lambda", 0.5, {"advantage": "grpo"}, {"advantage": "gae"}),
    ("value_learning_rate", 1e-4, {}, {"advantage": "gae"}),
    ("value_clip", 0.0, {}, {"advantage": "gae"}),
    ("kl_estimator", "k1", {}, {"kl_coef": 0.05}),
    ("kl_mode", "reward", {"kl_coef": 0.0}, {"kl_coef": 0.05}),
    ("clip_eps", 0.3, {"surrogate": "pg"}, {"surrogate": "ppo_clip"}),
    ("clip_eps_high", 0.28, {"surrogate": "pg"}, {"surrogate": "cispo"}),
    ("dual_clip_c", 2.0, {"surrogate": "ppo_clip"}, {"surrogate": "dual_clip"}),
    ("norm_const", 256, {}, {"reduction": "seq_mean_token_sum_norm"}),
    ("dynamic_sampling_max_rounds", 5, {}, {"dynamic_sampling": True}),
    ("val_episodes", 4, {"eval_every": 0}, {"eval_every": 2}),
    ("final_eval_splits", ["test"], {"final_eval_episodes": 0}, {"final_eval_episodes": 10}),
    ("eval_seed", 3, {"final_eval_episodes": 0, "eval_every": 0}, {"final_eval_episodes": 0}),
    ("final_eval_decoding", ["greedy"], {"final_eval_episodes": 0}, {"final_eval_episodes": 10}),
    ("warmstart_demos", 100, {"model": "/models/m"}, {}),
    ("warmstart_epochs", 2.0, {"model": "/models/m"}, {}),
    ("cold_start_epochs", 2.0, {}, {"cold_start_demos": 8}),
    ("cold_start_learning_rate", 1e-4, {}, {"cold_start_demos": 8}),
    ("cold_start_rows_per_step", 4, {}, {"cold_start_demos": 8}),
    ("cold_start_micro_batch_size", 4, {}, {"cold_start_demos": 8}),
    ("cold_start_seed", 1, {}, {"cold_start_demos": 8}),
    ("min_lr", 1e-5, {}, {"lr_schedule": "cosine"}),
    ("judge_model", "m", {}, {"judge_url": "http://127.0.0.1:1/v1"}),
    ("judge_weight", 0.5, {}, JUDGE),
    ("judge_concurrency", 2, {}, JUDGE),
    ("judge_retries", 0, {}, JUDGE),
    ("judge_timeout", 5.0, {}, JUDGE),
    ("judge_api_key_env", "MY_KEY", {}, JUDGE),
    ("judge_url", "http://127.0.0.1:1/v1", {"advantage": "rejection", "judge_model": "m"}, {"judge_model": "m"}),
    ("update_strategy", "fsdp", {}, {"update_ranks": 2}),
    ("shaping_gamma", 0.9, {}, {"shaping": "potential"}),
    ("attempt_discount", 0.5, {}, {"attempts": 2}),
    ("attempt_feedback", "self-refine", {}, {"attempts": 2}),
    ("shaping", "potential", {"advantage": "rejection"}, {"advantage": "grpo"}),
    ("shaping", "potential", {**OPD, "task_reward_weight": 0.0}, {**OPD, "task_reward_weight": 0.5}),
    ("packing", True, KD_RL, {}),
    ("surrogate", "pg", ALONE, KD_RL),
    ("clip_eps", 0.3, ALONE, KD_RL),
    ("clip_eps_high", 0.28, ALONE, KD_RL),
    ("dual_clip_c", 2.0, {**ALONE, "surrogate": "dual_clip"}, {**KD_RL, "surrogate": "dual_clip"}),
    ("tis_cap", 2.0, ALONE, KD_RL),
    ("kl_coef", 0.04, ALONE, KD_RL),
    ("entropy_coef", 0.01, ALONE, KD_RL),
    ("grpo_std", "sample", ALONE, KD_RL),
    ("advantage", "rloo", ALONE, KD_RL),
    ("advantage", "rloo", ALONE, {**ALONE, "offpolicy_delta": 0.5}),  # its sign masks rows
    ("overlong_buffer", 64, ALONE, {**ALONE, "offpolicy_delta": 0.5}),
    # on-policy distillation alone: the advantage is the teacher's log-ratio, no reward in it
    ("overlong_buffer", 64, {**OPD, "task_reward_weight": 0.0}, {**OPD, "task_reward_weight": 0.5}),
    ("kl_coef", 0.04, {**OPD, "kl_mode": "reward"}, {**OPD, "kl_mode": "reward", "task_reward_weight": 0.5}),
    ("kl_coef", 0.04, {**OPD, "kl_mode": "reward"}, OPD),  # as a loss term it is read
    # rejection sampling: kept by the verifier's score, every kept row's advantage is 1
    ("overlong_buffer", 64, {"advantage": "rejection"}, {"advantage": "grpo"}),
    ("offpolicy_delta", 0.5, {"advantage": "rejection"}, {"advantage": "grpo"}),
    ("overlong_filter", True, {"advantage": "rejection"}, {"advantage": "grpo"}),
    ("dual_clip_c", 2.0, {"advantage": "rejection", "surrogate": "dual_clip"}, {"surrogate": "dual_clip"}),
    ("surrogate", "dual_clip", {"advantage": "rejection"}, {"advantage": "grpo"}),  # at the default c
    # --distill-lambda 0: every batch is fixed data, trained on the divergence alone
    ("task_reward_weight", 0.5, FIXED_ONLY, {**FIXED_ONLY, "distill_lambda": 0.5}),
    ("kl_coef", 0.04, FIXED_ONLY, {**FIXED_ONLY, "distill_lambda": 0.5, "task_reward_weight": 0.5}),
    ("kl_coef", 0.04, {"advantage": "rejection", "kl_mode": "reward"}, {"advantage": "rejection"}),
    ("clip_eps", 0.3, {"advantage": "rejection", "clip_eps_high": 0.28}, {"advantage": "rejection"}),
    ("clip_eps", 0.3, {"advantage": "rejection", "clip_eps_high": 0.28}, {"advantage": "grpo", "clip_eps_high": 0.28}),
    (
        "clip_eps",
        0.3,
        {"advantage": "rejection", "clip_eps_high": 0.28},
        {"advantage": "rejection", "clip_eps_high": 0.28, "surrogate": "cispo"},
    ),
]


@pytest.mark.parametrize("name,value,unread,read", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_setting_is_refused_where_nothing_reads_it_and_accepted_where_something_does(name, value, unread, read):
    assert TrainConfig.model_fields[name].default != value  # the case gives the setting
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} has no effect with .*; drop {flag}"):
        TrainConfig(**unread, **{name: value})
    assert getattr(TrainConfig(**read, **{name: value}), name) == value


def test_the_message_names_the_estimator_and_its_reason():
    with pytest.raises(ValueError) as e:
        TrainConfig(advantage="rloo", grpo_std="sample")
    assert (
        "--grpo-std has no effect with --advantage rloo: RLOO uses the leave-one-out mean only; drop --grpo-std"
        in str(e.value)
    )


def test_the_divergence_alone_names_why_and_each_setting_once():
    with pytest.raises(ValueError) as e:
        TrainConfig(**ALONE, kl_coef=0.04, advantage="rloo", grpo_std="sample")
    said = str(e.value)
    assert (
        "--kl-coef has no effect with --distill-loss jsd and --task-reward-weight 0: the policy-gradient "
        "objective, its KL and entropy terms included, is weighted 0, so the divergence alone trains "
        "(--task-reward-weight w > 0 adds the rest back); drop --kl-coef" in said
    )
    # grpo_std is also unread by rloo; it is named once, for the first reason
    assert said.count("--grpo-std has no effect") == 1 and "RLOO uses" not in said
    assert "--advantage has no effect" in said and "--advantage rejection" in said
    assert unread_settings(TrainConfig(**ALONE)) == []  # the gkd recipe's settings
    assert TrainConfig(**ALONE, advantage="rejection").advantage == "rejection"  # it picks the rows


def test_dynamic_sampling_with_groups_of_one_is_refused():
    """A group of one never has differing accuracies, so dynamic sampling would drop every group."""
    with pytest.raises(ValueError, match="--dynamic-sampling with --group-size 1 drops every group"):
        TrainConfig(**ALONE, group_size=1, dynamic_sampling=True)
    assert TrainConfig(**ALONE, group_size=1).group_size == 1
    assert TrainConfig(**ALONE, group_size=2, dynamic_sampling=True).dynamic_sampling


def test_every_unread_setting_is_named_at_once():
    cfg = TrainConfig(advantage="gae", gamma=0.9)  # read here
    cfg_fields = {k: getattr(cfg, k) for k in TrainConfig.model_fields}
    cfg_fields |= {"advantage": "grpo", "kl_estimator": "k1", "dual_clip_c": 2.0}
    with pytest.raises(ValueError) as e:
        TrainConfig(**cfg_fields)
    said = str(e.value)
    assert all(f"--{k} has no effect" in said for k in ("gamma", "kl-estimator", "dual-clip-c"))


def test_defaults_and_every_row_at_its_default_are_accepted():
    assert unread_settings(TrainConfig()) == []
    # a row's fields at their defaults never count as given, whatever the choices
    cfg = TrainConfig(advantage="rloo", surrogate="pg", eval_every=0, final_eval_episodes=0, model="/models/m")
    assert unread_settings(cfg) == []
    named = {f for row in READS for f in row.fields}
    assert named <= set(TrainConfig.model_fields)


def test_the_cli_refuses_without_a_traceback(tmp_path):
    r = CliRunner().invoke(
        app,
        ["train", "--advantage", "rloo", "--grpo-std", "sample", "--run-dir", str(tmp_path / "r")],
        env={"COLUMNS": "200"},
    )
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "Traceback" not in out
    assert "--grpo-std has no effect with --advantage rloo: RLOO uses the leave-one-out mean only" in out
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("surrogate", ["ppo_clip", "dual_clip", "gspo", "gspo_token", "cispo"])
def test_with_rejections_advantage_of_1_eps_low_and_c_change_nothing_but_cispos_eps_low_does(surrogate):
    """The rejection rows are the truth of update.surrogates: with every advantage 1 (what
    --advantage rejection gives the kept rows) ε_low and the dual-clip c leave the objective
    and its gradient unchanged, except CISPO's ε_low, which clamps the weight both ways (read)."""
    import torch

    from consequence.update.regularizers import offpolicy_sequence_mask
    from consequence.update.surrogates import surrogate_objective

    torch.manual_seed(0)
    old = torch.randn(3, 5).log_softmax(-1)
    lp0 = old + torch.linspace(-1.5, 1.5, 15).reshape(3, 5)  # ratios from e^-1.5 to e^1.5: every clip acts
    mask, adv = torch.ones(3, 5), torch.ones(3)
    outs = []
    for eps_low, c in ((0.1, 3.0), (0.9, 1.5)):
        lp = lp0.clone().requires_grad_(True)
        obj, _, _ = surrogate_objective(surrogate, lp, old, adv, mask, eps_low=eps_low, eps_high=0.28, dual_clip_c=c)
        obj.sum().backward()
        outs.append((obj.detach(), lp.grad))
    same = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert same == (surrogate != "cispo")
    assert not offpolicy_sequence_mask(lp0, old, adv, mask, 1e-6).any()  # it drops negative-advantage rows only


@pytest.mark.slow  # ~4 s: 14 steps of the bundled model with a teacher
def test_the_divergence_alone_rows_are_the_truth_of_the_update():
    """At --task-reward-weight 0 (pg_coef 0) the settings of the "divergence alone" row leave the
    step's loss and gradient as they are; at a weight of 0.3 each of them changes it (the control)."""
    import copy

    import torch

    from consequence.policy.tiny import BUNDLED, load_policy
    from consequence.records import TrainingRow
    from consequence.update.step import UpdateConfig, accumulate_gradients

    student, _ = load_policy(BUNDLED)
    teacher = copy.deepcopy(student).eval().requires_grad_(False)
    with torch.no_grad():
        teacher.lm_head.weight.add_(
            0.1 * torch.randn(teacher.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        )
    ids, masks = ([5, 6, 7, 8, 9], [5, 10, 11, 12]), ([0, 0, 1, 1, 1], [0, 1, 1, 0])
    # π_old below the student's own log-probs: ratios e^0.1 (A > 0: inside ε 0.2, clipped at ε 0.05)
    # and e^3 (A < 0: past the dual clip's c 1.5), so that each clip acts on the surrogate
    rows = []
    for j, (x, m, shift) in enumerate(zip(ids, masks, (0.1, 3.0))):
        with torch.no_grad():
            lp = student(input_ids=torch.tensor([x])).logits[0, :-1].log_softmax(-1)
        own = [0.0] + [float(lp[t, x[t + 1]]) for t in range(len(x) - 1)]
        rows.append(TrainingRow(x, m, [v - shift if k else 0.0 for v, k in zip(own, m)], j))
    ref = [[x - 0.3 for x in r.old_logprobs] for r in rows]  # a reference the KL term sees
    sampler = [[x + 0.4 for x in r.old_logprobs] for r in rows]  # a sampler the TIS weight sees
    variants = {
        "surrogate": {"surrogate": "pg"},
        "dual_clip_c": {"surrogate": "dual_clip", "dual_clip_c": 1.5},
        "clip_eps": {"clip_eps_low": 0.05, "clip_eps_high": 0.05},
        "tis_cap": {"tis_cap": 1.2},
        "kl_coef": {"kl_coef": 0.5},
        "entropy_coef": {"entropy_coef": 0.1},
    }

    def step(pg_coef, **kw):
        model = copy.deepcopy(student)
        cfg = UpdateConfig(distill_loss="reverse", pg_coef=pg_coef, **kw)
        m = accumulate_gradients(
            model, rows, [1.0, -0.5], cfg, 0, None, ref_logprobs=ref, sampler_logprobs=sampler, teacher=teacher
        )
        return m["loss"], torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    for pg_coef, same in ((0.0, True), (0.3, False)):
        loss0, grad0 = step(pg_coef)
        for name, kw in variants.items():
            loss, grad = step(pg_coef, **kw)
            assert (loss == loss0 and torch.equal(grad, grad0)) == same, (pg_coef, name)


def test_a_validation_of_no_episode_is_refused():
    """It would record val_success 0.0 every --eval-every iterations, a number nothing measured."""
    with pytest.raises(ValueError, match="--val-episodes 0 with --eval-every 6 validates on no episode"):
        TrainConfig(val_episodes=0)
    assert TrainConfig(val_episodes=1).val_episodes == 1
    with pytest.raises(ValueError, match="--val-episodes has no effect with --eval-every 0"):
        TrainConfig(val_episodes=0, eval_every=0)  # 0 differs from the default, and nothing reads it
