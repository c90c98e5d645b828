"""Outcome-reward advantages for groups of rollouts (credit box, docs/design.md §4).

Every estimator maps one scalar reward per trajectory to one scalar advantage per
trajectory; the update box gives that advantage to every generated token of the
trajectory. Groups are formed by ``group_id`` (task id + iteration), never by position in
the batch (docs/cases.md, case 02). A reward of ``None`` marks a
trajectory that leaves its group: an ``env_error`` (docs/cases.md, case 03), or one in
which the policy generated no token (the credit box passes ``None`` for it,
:func:`consequence.credit.batch.credit_rewards`; docs/cases.md, case 15). It is
excluded from every statistic and its advantage is ``None``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

ESTIMATORS: tuple[str, ...] = ("reinforce", "batch_mean", "reinforce_pp", "rloo", "grpo", "dr_grpo")


def _check_inputs(rewards: Sequence[float | None], group_ids: Sequence[str]) -> None:
    if len(rewards) != len(group_ids):
        raise ValueError(
            f"got {len(rewards)} rewards but {len(group_ids)} group ids; each trajectory needs exactly one group id"
        )
    for i, r in enumerate(rewards):
        if r is None:
            continue
        try:
            ok = math.isfinite(float(r))
        except (TypeError, ValueError):
            raise ValueError(f"reward {i} is {r!r}, not a number (use None for env_error)") from None
        if not ok:
            raise ValueError(
                f"reward {i} is {r!r}, not finite; a reward that is not a finite number is an "
                "env_error (None), never a score (docs/cases.md, case 11)"
            )


def _groups(rewards: Sequence[float | None], group_ids: Sequence[str]) -> dict[str, list[int]]:
    """Indices of the valid (non-None) rewards of each group, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, (r, g) in enumerate(zip(rewards, group_ids)):
        members = groups.setdefault(g, [])
        if r is not None:
            members.append(i)
    return groups


def _sizes(group_ids: Sequence[str]) -> dict[str, int]:
    """Members of each group, valid or not (the G that was sampled)."""
    sizes: dict[str, int] = {}
    for g in group_ids:
        sizes[g] = sizes.get(g, 0) + 1
    return sizes


def group_advantages(
    rewards: Sequence[float | None],
    group_ids: Sequence[str],
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_correction: int = 0,
) -> list[float | None]:
    """Advantage of each trajectory from its outcome reward and its group.

    Estimators (R_i reward of trajectory i, g its group, statistics over the valid
    members of g only):

    - ``"reinforce"``: A_i = R_i (no baseline; Williams 1992).
    - ``"batch_mean"``: A_i = R_i − mean of all valid rewards in the batch.
    - ``"reinforce_pp"``: A_i = (R_i − mean_B) / (std_B + eps) over all valid rewards of
      the batch (REINFORCE++, Hu et al. 2025, §3.2, global advantage normalisation;
      population std).
    - ``"rloo"``: A_i = R_i − (1/(G−1)) Σ_{j≠i} R_j, leave-one-out baseline (Ahmadian et
      al. 2024, "Back to Basics", §3.2); unbiased, unlike a self-including mean, which
      shrinks the expected gradient by (G−1)/G.
    - ``"grpo"``: A_i = (R_i − mean_g) / (std_g + eps) (Shao et al. 2024, DeepSeekMath
      §4.1.2, outcome supervision). ``std_g`` is the population std
      (``std_correction=0``); pass ``std_correction=1`` for the sample std.
    - ``"dr_grpo"``: A_i = R_i − mean_g, no std division (Liu et al. 2025,
      "Understanding R1-Zero-Like Training", §3).

    A trajectory whose reward is ``None`` leaves its group (and the batch): with G
    sampled and k left, every statistic is that of the G − k others, as if only they
    had been sampled.

    Args:
        rewards: one reward per trajectory, length N; ``None`` = left out (env_error, or
            no generated token).
        group_ids: one group id per trajectory, length N (groups by identity, not position).
        estimator: one of :data:`ESTIMATORS`.
        eps: added to the std in ``"grpo"`` and ``"reinforce_pp"``.
        std_correction: degrees-of-freedom correction of the group std in ``"grpo"``.

    Returns:
        list of length N: float advantages, ``None`` where the reward is ``None``.

    Warns:
        UserWarning: ``"grpo"`` / ``"dr_grpo"`` with a group of exactly one valid member,
        and ``"rloo"`` with a group reduced to one valid member by members left out
        (advantage 0.0: one member gives no comparison; docs/cases.md, case 12).

    Raises:
        ValueError: unknown estimator; lengths differ; a reward is not a finite number;
            ``"rloo"`` with a group that has one member in all (G = 1 sampled: no
            leave-one-out baseline exists, a configuration error).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    _check_inputs(rewards, group_ids)
    out: list[float | None] = [None] * len(rewards)
    valid = [i for i, r in enumerate(rewards) if r is not None]

    if estimator == "reinforce":
        for i in valid:
            out[i] = float(rewards[i])  # type: ignore[arg-type]
        return out
    if estimator in ("batch_mean", "reinforce_pp"):
        if valid:
            vals = [float(rewards[i]) for i in valid]  # type: ignore[arg-type]
            m = math.fsum(vals) / len(vals)
            scale = 1.0
            if estimator == "reinforce_pp":
                scale = math.sqrt(math.fsum((v - m) ** 2 for v in vals) / len(vals)) + eps
            for i, v in zip(valid, vals):
                out[i] = (v - m) / scale
        return out

    sampled = _sizes(group_ids)
    for g, members in _groups(rewards, group_ids).items():
        G = len(members)
        if G == 0:
            continue  # every member left: nothing to compare
        vals = [float(rewards[i]) for i in members]  # type: ignore[arg-type]
        if G == 1:
            # G = 1 sampled is a setting RLOO cannot run; a group reduced to one by an
            # env_error or an empty episode is an event of the run, which must not stop it.
            if estimator == "rloo" and sampled[g] == 1:
                raise ValueError(
                    f"RLOO needs at least 2 valid rollouts per group; group {g!r} has 1 "
                    "(the leave-one-out baseline of a single rollout is undefined). "
                    "Sample G >= 2 per task or use another estimator."
                )
            warnings.warn(
                f"group {g!r} has a single valid rollout: G = 1 gives no comparison, so its {estimator} advantage is 0",
                UserWarning,
                stacklevel=2,
            )
            out[members[0]] = 0.0
            continue
        total = math.fsum(vals)
        mean = total / G
        if estimator == "rloo":
            for i, r in zip(members, vals):
                out[i] = r - (total - r) / (G - 1)
        elif estimator == "dr_grpo":
            for i, r in zip(members, vals):
                out[i] = r - mean
        else:  # grpo
            dof = G - std_correction
            if dof <= 0:
                raise ValueError(f"std_correction={std_correction} too large for group {g!r} of {G}")
            std = math.sqrt(math.fsum((r - mean) ** 2 for r in vals) / dof)
            for i, r in zip(members, vals):
                out[i] = (r - mean) / (std + eps)
    return out


def mixed_group_fraction(rewards: Sequence[float | None], group_ids: Sequence[str]) -> float:
    """Fraction of groups whose valid rewards are not all equal.

    Only mixed groups carry a group-relative learning signal; for a binary reward with
    success probability p the expected fraction is 1 − p^G − (1−p)^G (docs/design.md §8).
    Groups with no valid reward (all env_error) are left out of the denominator.

    Returns:
        float in [0, 1]; 0.0 when there is no group with a valid reward.

    Raises:
        ValueError: lengths differ or a reward is not a finite number.
    """
    _check_inputs(rewards, group_ids)
    n_groups = 0
    n_mixed = 0
    for members in _groups(rewards, group_ids).values():
        if not members:
            continue
        n_groups += 1
        vals = {float(rewards[i]) for i in members}  # type: ignore[arg-type]
        n_mixed += len(vals) > 1
    return n_mixed / n_groups if n_groups else 0.0
