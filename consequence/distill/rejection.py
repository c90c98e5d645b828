"""Rejection-sampling SFT (distillation box): the student's own verified successes as hard targets.

The record's generator is the *current student* and the supervision one hard token per
position, the one it sampled (the seeds' two axes of distillation; RFT, Yuan et al. 2023,
"Scaling Relationship on Learning Mathematical Reasoning with Large Language Models" §3;
STaR, Zelikman et al. 2022, §3.1 without rationalisation). The student samples episodes in
any environment; an episode is *accepted* when the verifier scores it 1 (the environment's
first reward component, the one evaluation calls success) and it finished (not truncated,
no environment error); accepted episodes become training rows token for token
(``records.trajectory_to_rows``: the sampled ids are the targets, observations context),
and :func:`consequence.distill.sft.train_sft` fits them.

Counted for every round (:class:`RejectionStats`): attempts (valid episodes), accepted,
duplicates dropped, environment errors, tasks with an accepted episode, the acceptance
rate and attempts per accepted demonstration — the cost of a demonstration in samples.
"""

from __future__ import annotations

from collections.abc import Sequence

from consequence.credit.rejection import RejectionStats, accept
from consequence.evaluate.rollouts import sample_episodes
from consequence.records import TrainingRow, Trajectory, trajectory_to_rows

__all__ = ["RejectionStats", "accept", "accepted_rows", "rejection_sample"]


def accepted_rows(accepted: Sequence[Trajectory]) -> list[TrainingRow]:
    """Training rows of the accepted episodes: the sampled tokens are the targets (loss mask
    1), the prompt and observations are context; ``traj_index`` = position in ``accepted``."""
    return [row for i, t in enumerate(accepted) for row in trajectory_to_rows(t, i)]


def rejection_sample(
    model,
    renderer,
    env,
    tasks: Sequence,
    n: int,
    budgets,
    seed: int,
    temperature: float = 1.0,
    unique: bool = True,
    progress=None,
) -> tuple[list[Trajectory], list[Trajectory], RejectionStats]:
    """One round: ``n`` episodes of the student per task, scored, then :func:`accept`.

    Args:
        model, renderer: the student and its renderer.
        env: any environment (multi-turn included); tasks: its tasks to try.
        n: attempts per task; budgets: ``rollout.episodes.Budgets``.
        seed: seed of the episodes (``evaluate.rollouts.sample_episodes``'s rule).
        temperature: sampling temperature (> 0: at 0 the n attempts repeat one episode).
        unique, progress: as :func:`accept`; ``progress(n_done)`` after every model call.

    Returns:
        (all scored episodes, accepted episodes, stats).

    Raises:
        ValueError: ``temperature <= 0`` or ``n < 1``.
    """
    if temperature <= 0:
        raise ValueError(
            f"rejection sampling needs temperature > 0 (got {temperature}): greedy attempts of a "
            "task are one episode repeated"
        )
    trajs = sample_episodes(model, renderer, env, tasks, n, budgets, seed, temperature, progress=progress)
    kept, stats = accept(trajs, unique)
    return trajs, kept, stats
