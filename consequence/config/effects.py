"""Which settings each choice reads: a setting given for a box that does not read it is refused.

Every estimator, surrogate, reduction and optional phase of the loop reads some settings and
ignores others. Before this table, ``--advantage rloo --grpo-std sample`` trained exactly as
``--advantage rloo`` did, and the run's config.yaml said ``grpo_std: sample``. Now such a
setting is refused with the reason. "Given" means "differs from its default", never "named on
the command line": a run's config.yaml lists every field, and resume and reproduce re-read it.

Each :class:`Reads` row is the truth of the code that consumes the settings (grep
``cfg.<field>``); ``tests/config/test_config_effects.py`` checks each row both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Why an estimator other than GRPO has no use for the group std (the fix is always: drop it).
_NO_GROUP_STD = {
    "reinforce": "REINFORCE uses the raw reward, with no baseline",
    "batch_mean": "its baseline is the batch mean, with no std",
    "reinforce_pp": "REINFORCE++ normalises over the whole batch, not by each group's std",
    "rloo": "RLOO uses the leave-one-out mean only",
    "dr_grpo": "Dr.GRPO is GRPO without the std division",
    "gae": "GAE's advantages come from the value head",
    "rejection": "rejection sampling gives advantage 1 to accepted episodes",
    "reverse_kl": "with --task-reward-weight 0 the advantage is the teacher's log-ratio alone",
    "dpo": "DPO's advantages come from the log-ratio margins of its (verified, failed) pairs",
}


@dataclass(frozen=True)
class Reads:
    """``fields`` are read only when ``when(cfg)`` holds; ``why(cfg)`` says what the run does
    instead (it follows "--FIELD has no effect with ...: ")."""

    fields: tuple[str, ...]
    when: Callable[[Any], bool]
    why: Callable[[Any], str]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _divergence_alone(c: Any) -> bool:
    """--distill-loss with --task-reward-weight 0: the update multiplies its policy-gradient
    objective (surrogate, TIS weight, KL and entropy terms) by the weight, 0
    (``update.step._regularized``, ``pg_coef``), so only the divergence trains. At
    --distill-lambda 0 every batch is fixed data, which the update trains with weight 0
    whatever the setting (``loop.learner.update``, ``divergence_only``)."""
    return c.distill_loss != "none" and (c.task_reward_weight == 0 or c.distill_lambda == 0)


def _alone(c: Any) -> str:
    if c.distill_lambda == 0:
        return (
            f"--distill-loss {c.distill_loss} and --distill-lambda 0: every batch is drawn from --distill-data, "
            "which the student did not sample, so the divergence alone trains on it (the policy-gradient "
            "objective, its KL and entropy terms included, is weighted 0; --distill-lambda λ > 0 adds "
            "batches of the student's own samples)"
        )
    return (
        f"--distill-loss {c.distill_loss} and --task-reward-weight 0: the policy-gradient objective, "
        "its KL and entropy terms included, is weighted 0, so the divergence alone trains "
        "(--task-reward-weight w > 0 adds the rest back)"
    )


def _reward_unused(c: Any) -> str | None:
    """Why the (shaped, penalised) reward reaches no advantage of the update, or None when it does."""
    if c.advantage == "rejection":
        return "--advantage rejection: it keeps episodes by the verifier's score alone, each with advantage 1"
    if c.advantage == "dpo":
        return "--advantage dpo: it pairs episodes by the verifier's score alone (verified against failed)"
    if c.advantage == "reverse_kl" and c.task_reward_weight == 0:
        return "--advantage reverse_kl and --task-reward-weight 0: the advantage is the teacher's log-ratio alone"
    if _divergence_alone(c) and c.offpolicy_delta == 0:  # with it, the advantage's sign masks rows
        return _alone(c)
    return None


READS: tuple[Reads, ...] = (
    # First, so that a setting the divergence alone ignores is refused for that reason.
    Reads(
        (
            "surrogate",
            "clip_eps",
            "clip_eps_high",
            "dual_clip_c",
            "tis_cap",
            "kl_coef",
            "entropy_coef",
            "grpo_std",
            "task_reward_weight",
        ),
        lambda c: not _divergence_alone(c),
        _alone,
    ),
    Reads(  # the estimator still picks rows (rejection) or, by the advantage's sign, masks them
        ("advantage",),
        lambda c: not _divergence_alone(c) or c.advantage == "rejection" or c.offpolicy_delta > 0,
        lambda c: (
            _alone(c) + "; the advantage would still pick rows with --advantage rejection, or mask "
            "negative-advantage rows with --offpolicy-delta"
        ),
    ),
    Reads(
        ("grpo_std",),
        lambda c: c.advantage == "grpo" or (c.advantage == "reverse_kl" and c.task_reward_weight > 0),
        lambda c: f"--advantage {c.advantage}: {_NO_GROUP_STD[c.advantage]}",
    ),
    Reads(
        ("gamma", "gae_lambda", "value_learning_rate", "value_clip"),
        lambda c: c.advantage == "gae",
        lambda c: (
            f"--advantage {c.advantage}: it is read only by GAE (--advantage gae, the ppo recipe), "
            "which trains a value head"
        ),
    ),
    Reads(
        ("reward_model_weight",),
        lambda c: c.reward_model is not None,
        lambda c: "no --reward-model: there is no learned reward to weigh (--reward-model PATH adds one)",
    ),
    Reads(  # reward.judge.endpoint_of / judge_record / resolve_rubric: read only with a judge
        (
            "judge_model",
            "judge_rubric",
            "judge_weight",
            "judge_concurrency",
            "judge_retries",
            "judge_timeout",
            "judge_api_key_env",
        ),
        lambda c: c.judge_url is not None,
        lambda c: "no --judge-url: there is no judge to configure (--judge-url URL adds one)",
    ),
    Reads(
        ("dpo_beta", "dpo_loss", "dpo_label_smoothing"),
        lambda c: c.advantage == "dpo",
        lambda c: f"--advantage {c.advantage}: it is read only by --advantage dpo (the dpo recipe)",
    ),
    Reads(  # credit.dpo.pair_loss: the IPO loss has no smoothing term
        ("dpo_label_smoothing",),
        lambda c: c.dpo_loss == "sigmoid",
        lambda c: f"--dpo-loss {c.dpo_loss}: label smoothing is a term of the sigmoid loss only",
    ),
    Reads(  # a truncated episode is a failed one, the rejected side of its pairs (credit.rejection.verified)
        ("overlong_filter",),
        lambda c: c.advantage != "dpo",
        lambda c: (
            "--advantage dpo: a truncated episode is the rejected side of its pairs, and leaving its rows out would change the loss"
        ),
    ),
    Reads(
        ("kl_estimator", "kl_mode"),
        lambda c: c.kl_coef > 0,
        lambda c: "--kl-coef 0: there is no KL term (--kl-coef β > 0 adds one)",
    ),
    Reads(  # loop.learner.refresh_due: π_ref exists for a KL term or for DPO's log-ratios
        ("ref_refresh_every",),
        lambda c: c.kl_coef > 0 or c.advantage == "dpo",
        lambda c: "--kl-coef 0: there is no KL term and no reference policy (--kl-coef β > 0 adds one)",
    ),
    Reads(
        ("clip_eps", "clip_eps_high"),
        lambda c: c.surrogate != "pg",
        lambda c: "--surrogate pg: the plain policy gradient has no ratio to clip",
    ),
    Reads(
        ("dual_clip_c",),
        lambda c: c.surrogate == "dual_clip",
        lambda c: (
            f"--surrogate {c.surrogate}: the bound c·A of negative advantages is applied only by --surrogate dual_clip"
        ),
    ),
    Reads(
        ("norm_const",),
        lambda c: c.reduction == "seq_mean_token_sum_norm",
        lambda c: f"--reduction {c.reduction}: L_const divides only --reduction seq_mean_token_sum_norm (Dr.GRPO)",
    ),
    Reads(
        ("dynamic_sampling_max_rounds",),
        lambda c: c.dynamic_sampling,
        lambda c: "dynamic sampling off: every iteration rolls out one round (--dynamic-sampling turns it on)",
    ),
    Reads(
        ("val_episodes",),
        lambda c: c.eval_every > 0,
        lambda c: "--eval-every 0: there is no periodic validation (--eval-every K adds one)",
    ),
    Reads(
        ("eval_seed",),
        lambda c: c.final_eval_episodes > 0 or (c.eval_every > 0 and c.val_episodes > 0),
        lambda c: "--final-eval-episodes 0 and no periodic validation: no episode is evaluated",
    ),
    Reads(
        ("final_eval_splits", "final_eval_decoding"),
        lambda c: c.final_eval_episodes > 0,
        lambda c: "--final-eval-episodes 0: there is no final evaluation",
    ),
    Reads(
        ("warmstart_demos", "warmstart_epochs"),
        lambda c: c.model is None,
        lambda c: f"--model {c.model}: they build the bundled tiny warm start, which is used only without --model",
    ),
    Reads(
        (
            "cold_start_epochs",
            "cold_start_learning_rate",
            "cold_start_rows_per_step",
            "cold_start_micro_batch_size",
            "cold_start_seed",
        ),
        lambda c: c.cold_start_demos > 0,
        lambda c: "--cold-start-demos 0: there is no cold start (--cold-start-demos N adds one)",
    ),
    Reads(  # update.schedule.lr_factor: the constant schedule has no floor to decay to
        ("min_lr",),
        lambda c: c.lr_schedule != "constant",
        lambda c: (
            "--lr-schedule constant: the learning rate stays at --learning-rate after the warm-up "
            "(--lr-schedule linear|cosine decays it to --min-lr)"
        ),
    ),
    Reads(  # loop.learner.logprob_fn: the policy's passes; the teacher's divergence (update.distill_chunks) is padded
        ("packing",),
        lambda c: c.distill_loss == "none",
        lambda c: (
            f"--distill-loss {c.distill_loss}: the teacher's per-token divergence runs on the padded batch "
            "(update/distill_chunks.py), so the step would be only partly packed"
        ),
    ),
    Reads(  # loop.learner.make_learner: a DataParallelUpdate, with its strategy, only for N > 1
        ("update_strategy",),
        lambda c: c.update_ranks > 1,
        lambda c: (
            "--update-ranks 1: the update runs in this one process, with nothing to replicate or shard "
            "(--update-ranks N > 1 runs it over N ranks, as ddp replicas or fsdp shards)"
        ),
    ),
    Reads(  # rollout.collect.roll_out_round: the discount per attempt (rollout.attempts)
        ("attempt_discount", "attempt_feedback"),
        lambda c: c.attempts > 1,
        lambda c: (
            "--attempts 1: one answer ends each episode, so there is no later attempt to discount or give feedback "
            "for (--attempts k > 1)"
        ),
    ),
    Reads(  # rollout.collect.roll_out_round: the shaping discount
        ("shaping_gamma",),
        lambda c: c.shaping == "potential",
        lambda c: "--shaping none: there is no potential-based shaping (--shaping potential adds it)",
    ),
    # Where the reward, or a negative advantage, never reaches the update (after the rows above, whose
    # reasons are more direct).
    Reads(
        ("overlong_buffer", "reward_model", "judge_url", "shaping"),
        lambda c: _reward_unused(c) is None,
        lambda c: f"{_reward_unused(c)}, so no reward reaches the update and its shaping changes nothing",
    ),
    Reads(
        ("kl_coef",),
        lambda c: c.kl_mode != "reward" or _reward_unused(c) is None,
        lambda c: (
            f"{_reward_unused(c)}, so no reward reaches the update and --kl-mode reward's penalty on it "
            "changes nothing (--kl-mode loss applies β as a loss term)"
        ),
    ),
    Reads(  # credit.rejection.verified: outcome "finished"
        ("overlong_filter",),
        lambda c: c.advantage != "rejection",
        lambda c: "--advantage rejection: it keeps only finished episodes, so no truncated one is left to drop",
    ),
    Reads(  # both act only on negative advantages (update.surrogates, update.regularizers)
        ("offpolicy_delta", "dual_clip_c"),
        lambda c: c.advantage != "rejection",
        lambda c: "--advantage rejection: every kept row's advantage is 1, and it acts only on negative advantages",
    ),
    Reads(  # the dual clip's bound c·A applies only where A < 0 (update.surrogates)
        ("surrogate",),
        lambda c: not (c.advantage == "rejection" and c.surrogate == "dual_clip"),
        lambda c: (
            "--advantage rejection: --surrogate dual_clip differs from ppo_clip only on negative advantages, "
            "and every kept row's advantage is 1, so it trains as --surrogate ppo_clip (give that, or pg)"
        ),
    ),
    Reads(  # for A > 0 only ε_high bounds ρ (update.surrogates._clip); CISPO clamps both ways
        ("clip_eps",),
        lambda c: not (c.advantage == "rejection" and c.clip_eps_high > 0 and c.surrogate not in ("pg", "cispo")),
        lambda c: (
            f"--advantage rejection, --surrogate {c.surrogate} and --clip-eps-high: ε_low bounds the ratio "
            "only for negative advantages, and rejection sampling's are all 1 (--clip-eps-high bounds them)"
        ),
    ),
)


def unread_settings(cfg: Any) -> list[str]:
    """One message per setting that differs from its default while nothing in this run reads it.

    Args:
        cfg: a ``TrainConfig`` (any object with its fields and ``model_fields``).

    Returns:
        messages of the form "--grpo-std has no effect with --advantage rloo: RLOO uses the
        leave-one-out mean only; drop --grpo-std", in the order of :data:`READS`; a setting
        two rows refuse is named once, with the first row's reason.
    """
    out, named = [], set()
    for row in READS:
        if row.when(cfg):
            continue
        for name in row.fields:
            if name not in named and getattr(cfg, name) != type(cfg).model_fields[name].default:
                named.add(name)  # one reason per setting: the first row that refuses it
                out.append(f"{_flag(name)} has no effect with {row.why(cfg)}; drop {_flag(name)}")
    return out
