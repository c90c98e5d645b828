"""Credit for one iteration's batch: its training rows, the KL reward penalty and the
advantages, over complete groups and before any mini- or micro-batching (docs/design.md §4).

Every advantage of a training run is computed here: the scalar estimators of
:mod:`consequence.credit.advantages` over groups built by identity, and per-token GAE with
a learned value head (:mod:`consequence.credit.returns`, :mod:`consequence.credit.value`).
Rewards may arrive at any turn: each call's reward sits on its last sampled token
(``TrainingRow.token_rewards``) and reaches earlier tokens through returns-to-go (GAE);
the scalar estimators use each trajectory's total reward.

One rule for every estimator (docs/cases.md, case 15): a trajectory in which the policy
generated no token (a budget or an error ended the episode before the first sampled
token, e.g. its first prompt did not fit ``max_total_tokens``) carries no action to
credit. Like an ``env_error`` it leaves its group and the batch (no group or batch
statistic, no advantage, no training row) and is counted (``no_target_trajectories``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from consequence.config import TrainConfig
from consequence.credit.advantages import group_advantages
from consequence.credit.dpo import dpo_advantages
from consequence.credit.kl import kl_estimate, reverse_kl_advantages
from consequence.credit.rejection import accept
from consequence.credit.returns import gae
from consequence.credit.value import ValueModel, row_values
from consequence.records import TrainingRow, Trajectory, credited, trajectory_to_rows

__all__ = [
    "Batch",
    "credited",
    "credit_rewards",
    "no_target_count",
    "training_rows",
    "assign_credit",
    "kl_reward_penalty",
]


@dataclass
class Batch:
    """Rows of one iteration with their advantages and per-token side inputs."""

    rows: list[TrainingRow]
    advantages: list[Any]  # float per row, or per-token list (GAE)
    sampler_logprobs: list[list[float]]
    ref_logprobs: list[list[float]] | None = None
    returns: list[list[float]] | None = None
    old_values: list[list[float]] | None = None
    trajectories: list[Trajectory] | None = None  # what rows[j].traj_index points into
    metrics: dict[str, float | None] = field(default_factory=dict)  # the credit box's own (teacher KL, ...)

    def describe_rows(self, rows: list[int]) -> str:
        """The trajectories of ``rows`` (indices into ``self.rows``), for error messages."""
        out = []
        for j in rows:
            i = self.rows[j].traj_index
            t = self.trajectories[i] if self.trajectories and i < len(self.trajectories) else None
            out.append(
                f"task {t.task_id} group {t.group_id} sample {t.sample_id} (trajectory {i})" if t else f"trajectory {i}"
            )
        return "; ".join(dict.fromkeys(out))  # a trajectory split into several rows is named once

    def select(self, keep: list[int]) -> Batch:
        """The batch restricted to rows ``keep`` (indices into ``self.rows``)."""

        def take(xs: list) -> list:
            return [xs[j] for j in keep]

        def pick(xs: list | None) -> list | None:  # an absent side input stays absent
            return None if xs is None else take(xs)

        return Batch(
            take(self.rows),
            take(self.advantages),
            take(self.sampler_logprobs),
            pick(self.ref_logprobs),
            pick(self.returns),
            pick(self.old_values),
            self.trajectories,
            dict(self.metrics),
        )


def credit_rewards(trajs: list[Trajectory]) -> list[float | None]:
    """Each trajectory's reward as the group statistics see it: ``None`` (left out) where
    :func:`credited` is false, so the empty ones leave every group and batch statistic
    (advantages, dynamic sampling's mixed groups, the mixed-group metrics)."""
    return [t.reward if credited(t) else None for t in trajs]


def no_target_count(trajs: list[Trajectory]) -> int:
    """Scored trajectories with no target token (the ``no_target_trajectories`` metric; an
    env_error is counted as one, not here)."""
    return sum(t.reward is not None and t.n_generated_tokens == 0 for t in trajs)


def training_rows(trajs: list[Trajectory]) -> tuple[list[TrainingRow], list[int]]:
    """The rows to train on and, per row, the index of its trajectory; a trajectory that is
    not :func:`credited` (an env_error, or no token generated) has none."""
    rows, owner = [], []
    for i, t in enumerate(trajs):
        if not credited(t):
            continue
        for r in trajectory_to_rows(t, i):
            rows.append(r)
            owner.append(i)
    return rows, owner


def assign_credit(
    trajs: list[Trajectory],
    rows: list[TrainingRow],
    owner: list[int],
    cfg: TrainConfig,
    *,
    ref_logprobs: list[list[float]] | None = None,
    critic: ValueModel | None = None,
    pad_id: int = 0,
    teacher_logprobs: list[list[float]] | None = None,
    policy_logprobs: list[list[float]] | None = None,
) -> Batch:
    """Advantages of ``rows`` (from :func:`training_rows`) by the recipe's estimator.

    Sets ``t.advantage`` (the trajectory's scalar advantage; for GAE the mean over its
    tokens; ``None`` for a trajectory that is not :func:`credited`, which also stays out of
    every group and batch statistic). ``batch.metrics["no_target_trajectories"]`` counts
    the scored trajectories left out for having no target token. With ``cfg.kl_mode == "reward"`` the KL penalty β·k(μ, π_ref) per target token
    is taken off the reward (off the total for scalar estimators; per token for GAE). With
    ``overlong_filter`` truncated trajectories leave the rows after entering the group
    statistics (DAPO §3.4).

    Args:
        ref_logprobs: per row, logπ_ref of every position (needed when ``cfg.kl_coef > 0``).
        critic: the value model (needed for ``cfg.advantage == "gae"``).
        teacher_logprobs: per row, log π_teacher of every position (``cfg.advantage ==
            "reverse_kl"``: per-token advantage log π_teacher − log μ on targets, plus
            ``cfg.task_reward_weight`` × the GRPO advantage of the trajectory's reward).
        policy_logprobs: per row, log π_θ of every position, for ``cfg.advantage == "dpo"`` on
            stored episodes (their ``old_logprobs`` are another sampler's); None: fresh samples.

    Raises:
        ValueError: GAE without a critic, a KL reward penalty without reference log-probs,
            or on-policy distillation without teacher log-probs.
    """
    batch = Batch(rows, [], [list(r.old_logprobs) for r in rows], ref_logprobs=ref_logprobs, trajectories=trajs)
    penalty = None
    if cfg.kl_mode == "reward" and cfg.kl_coef > 0 and rows:
        if ref_logprobs is None:
            raise ValueError("a KL reward penalty needs the reference policy's log-probs (ref_logprobs)")
        penalty = kl_reward_penalty(rows, batch.sampler_logprobs, ref_logprobs, cfg.kl_coef, cfg.kl_estimator)
    if cfg.advantage == "gae":
        if critic is None:
            raise ValueError("--advantage gae needs a value model (critic)")
        _gae_advantages(trajs, batch, owner, cfg, critic, pad_id, penalty)
    elif cfg.advantage == "reverse_kl":
        if teacher_logprobs is None:
            raise ValueError("--advantage reverse_kl needs the teacher's log-probs (teacher_logprobs)")
        _teacher_advantages(trajs, batch, owner, cfg, teacher_logprobs, penalty)
    elif cfg.advantage == "rejection":
        batch = _rejection_batch(trajs, batch, owner)
    elif cfg.advantage == "dpo":
        if ref_logprobs is None:
            raise ValueError("--advantage dpo needs the reference policy's log-probs (ref_logprobs)")
        _dpo_batch(trajs, batch, owner, cfg, ref_logprobs, policy_logprobs)
    else:  # one scalar per trajectory from its group: GRPO, RLOO, Dr.GRPO, REINFORCE(++)
        adv = group_advantages(
            _penalised_rewards(trajs, owner, penalty),
            [t.group_id for t in trajs],
            cfg.advantage,
            std_correction=_std_correction(cfg),
        )
        for t, a in zip(trajs, adv):
            t.advantage = a
        batch.advantages = [trajs[i].advantage for i in owner]
    if cfg.overlong_filter:
        batch = batch.select([j for j, i in enumerate(owner) if trajs[i].outcome != "truncated"])
    batch.metrics["no_target_trajectories"] = float(no_target_count(trajs))
    return batch


def _rejection_batch(trajs: list[Trajectory], batch: Batch, owner: list[int]) -> Batch:
    """Rejection sampling in the loop: advantage 1 on the rows of accepted episodes
    (:func:`consequence.credit.rejection.accept`: verified, finished, duplicates of a task's
    sampled tokens dropped), every other row leaves the batch. With the policy-gradient
    surrogate on fresh samples (ratio 1) and a token-mean reduction the step is SFT on the
    student's own successes (RFT, Yuan et al. 2023 §3)."""
    # An episode with no sampled token is no attempt of the student's (nothing was paid for it).
    kept, stats = accept([t for t in trajs if t.reward is None or credited(t)])
    ids = {id(t) for t in kept}
    for t in trajs:
        t.advantage = (1.0 if id(t) in ids else 0.0) if credited(t) else None
    batch.advantages = [trajs[i].advantage for i in owner]
    batch = batch.select([j for j, i in enumerate(owner) if id(trajs[i]) in ids])
    d = stats.as_dict()
    batch.metrics = {
        "rejection_attempts": float(d["attempts"]),
        "rejection_accepted": float(d["accepted"]),
        "rejection_duplicates": float(d["duplicates"]),
        "acceptance_rate": d["acceptance_rate"],
        "attempts_per_accepted": d["attempts_per_accepted"],
    }
    return batch


def _dpo_batch(trajs: list[Trajectory], batch: Batch, owner: list[int], cfg, ref_logprobs, policy_logprobs) -> None:
    """DPO in the loop (credit.dpo): each episode's advantage is its share of the DPO gradient
    over the group's (verified, unverified) pairs; an episode in no pair gets 0 (its rows are
    skipped by the update) and the pairs' metrics go to ``batch.metrics``."""
    adv, metrics = dpo_advantages(
        trajs, batch.rows, owner, ref_logprobs, cfg.dpo_beta, cfg.dpo_loss, cfg.dpo_label_smoothing, policy_logprobs
    )
    for i, t in enumerate(trajs):
        t.advantage = adv[i] if credited(t) else None
    batch.advantages = [adv[i] for i in owner]
    batch.metrics |= metrics


def _std_correction(cfg) -> int:
    """Degrees-of-freedom correction of GRPO's group std: 0 population, 1 sample (``--grpo-std``)."""
    return 1 if cfg.grpo_std == "sample" else 0


def _penalised_rewards(trajs, owner, penalty) -> list[float | None]:
    """Each trajectory's total reward (:func:`credit_rewards`), less the KL reward penalty of its rows."""
    rewards = credit_rewards(trajs)
    if penalty is not None:
        for j, i in enumerate(owner):
            rewards[i] -= sum(penalty[j])
    return rewards


def _teacher_advantages(trajs, batch: Batch, owner, cfg, teacher_logprobs, penalty) -> None:
    """On-policy distillation: A_t = log π_teacher(y_t) − log μ(y_t) on every target token
    (credit.kl.reverse_kl_advantages), plus w × the GRPO advantage of the (penalised) reward;
    each trajectory's scalar ``advantage`` is the mean over its target tokens."""
    ids, std_correction = [t.group_id for t in trajs], _std_correction(cfg)
    rewards = _penalised_rewards(trajs, owner, penalty)
    task = (
        group_advantages(rewards, ids, "grpo", std_correction=std_correction)
        if cfg.task_reward_weight
        else [0.0] * len(trajs)
    )
    batch.advantages, sums, counts, k1 = [], [0.0] * len(trajs), [0] * len(trajs), 0.0
    for j, (r, mu, lt) in enumerate(zip(batch.rows, batch.sampler_logprobs, teacher_logprobs)):
        i = owner[j]
        mask = torch.tensor(r.loss_mask)
        if not any(r.loss_mask):  # nothing sampled in this row: nothing to credit
            batch.advantages.append([0.0] * len(r.loss_mask))
            continue
        adv, m = reverse_kl_advantages(torch.tensor(mu), torch.tensor(lt), mask)
        k1 += m["reverse_kl"] * m["n_tokens"]
        adv = (adv + cfg.task_reward_weight * task[i] * mask).tolist()
        batch.advantages.append(adv)
        sums[i] += sum(a for a, m in zip(adv, r.loss_mask) if m)
        counts[i] += sum(r.loss_mask)
    for i, t in enumerate(trajs):
        t.advantage = sums[i] / counts[i] if counts[i] else None  # no target: no advantage
    n = sum(counts)
    batch.metrics = {
        "teacher_reverse_kl": k1 / n if n else None,  # mean k1 = log μ − log π_T, nats per target token
        "teacher_forward_tokens": float(sum(len(r.input_ids) for r in batch.rows)),
        "distill_targets": float(n),
    }


def kl_reward_penalty(
    rows: list[TrainingRow],
    sampler_logprobs: list[list[float]],
    ref_logprobs: list[list[float]],
    coef: float,
    estimator: str,
) -> list[list[float]]:
    """β·k(logμ, logπ_ref) per position of each row, 0 off target: KL as a reward penalty
    (Ouyang et al. 2022, eq. 2; estimator k1 / k2 / k3 of :func:`consequence.credit.kl.kl_estimate`)."""
    out = []
    for r, mu, ref in zip(rows, sampler_logprobs, ref_logprobs):
        m = torch.tensor(r.loss_mask, dtype=torch.bool)
        lp = torch.where(m, torch.tensor(mu), 0.0)
        rf = torch.where(m, torch.tensor(ref), 0.0)
        k = kl_estimate(lp, rf, estimator)
        out.append((coef * torch.where(m, k, 0.0)).tolist())
    return out


def _gae_advantages(trajs, batch: Batch, owner, cfg, critic: ValueModel, pad_id, penalty) -> None:
    """Per-token GAE (Schulman et al. 2016, eq. 16) over the generated tokens.

    V = 0 after a finished episode, the critic's value of the final state after a
    truncation; a row that is not its trajectory's last bootstraps from its own end.
    Advantages are whitened over the batch's target tokens (PPO practice).
    """
    values, final = row_values(critic, batch.rows, pad_id, cfg.micro_batch_size)
    last_row = {i: j for j, i in enumerate(owner)}
    call_totals = {i: sum(c.reward for c in trajs[i].calls) for i in set(owner)}
    advs, rets = [], []
    for j, (r, i) in enumerate(zip(batch.rows, owner)):
        is_last = last_row[i] == j
        rewards = list(r.token_rewards) if r.token_rewards is not None else [0.0] * len(r.input_ids)
        if is_last:  # the rest of the trajectory's reward (shaping, rescoring) on its last target token
            rewards[max(t for t, m in enumerate(r.loss_mask) if m)] += float(trajs[i].reward) - call_totals[i]
        if penalty is not None:
            rewards = [x - p for x, p in zip(rewards, penalty[j])]
        last_value = 0.0 if is_last and trajs[i].outcome == "finished" else final[j]
        a, ret = gae(rewards, values[j], r.loss_mask, cfg.gamma, cfg.gae_lambda, last_value)
        advs.append(a)
        rets.append(ret)
    flat = torch.tensor([a for r, adv in zip(batch.rows, advs) for a, m in zip(adv, r.loss_mask) if m])
    mean, std = (flat.mean().item(), flat.std(unbiased=False).item()) if flat.numel() else (0.0, 1.0)
    batch.advantages = [
        [(a - mean) / (std + 1e-6) if m else 0.0 for a, m in zip(adv, r.loss_mask)] for r, adv in zip(batch.rows, advs)
    ]
    batch.returns, batch.old_values = rets, values
    sums: dict[int, list[float]] = {}  # trajectory → [Σ advantage, n targets] over its rows
    for i, r, adv in zip(owner, batch.rows, batch.advantages):
        acc = sums.setdefault(i, [0.0, 0])
        for a, m in zip(adv, r.loss_mask):
            if m:
                acc[0] += a
                acc[1] += 1
    for i, t in enumerate(trajs):
        total, n = sums.get(i, (0.0, 0))
        t.advantage = total / n if n else None
