"""GKD's λ: a share of update batches from fixed data instead of the student's own samples.

Generalized Knowledge Distillation (Agarwal et al. 2024, §3.2 and Algorithm 1) trains the
divergence to the teacher on sequences that are, with probability λ, sampled by the student
(on-policy) and otherwise drawn from a fixed dataset (e.g. the teacher's own samples, or
ground-truth outputs). Here each iteration draws a seeded u ~ U[0, 1): u < λ rolls out as
usual; u ≥ λ trains on B × G trajectories drawn from ``--distill-data``. On such rows only the
divergence is trained: their log-probs are the data's sampler's, not the student's, so a
policy-gradient ratio against them would mean nothing (``pg_coef`` 0 for that update).

The data is a trajectories parquet file written with the student's tokenizer and chat
template (``consequence eval --model TEACHER --split train --out DIR`` writes
``DIR/episodes.parquet``). Only train-split problems may appear: a validation or test problem
in it would leak into training and is refused, naming it.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from consequence.records import Trajectory, credited, read_trajectories, verified
from consequence.seeding import seed_of

__all__ = ["uses_fixed_data", "first_student_iteration", "load_fixed_data", "check_token_ids", "draw_fixed_batch"]


def uses_fixed_data(distill_lambda: float, seed: int, it: int) -> bool:
    """Whether iteration ``it`` trains on fixed data: a seeded u ≥ λ (GKD Algorithm 1, line 3).

    Deterministic in (seed, it), so a resumed or reproduced run draws the same sources.
    """
    if distill_lambda >= 1:
        return False
    return random.Random(seed_of(seed, it, "distill-lambda")).random() >= distill_lambda


def first_student_iteration(distill_lambda: float, seed: int, iterations: int) -> int | None:
    """The first iteration that rolls out the student (where the pre-step checks run); None if none does."""
    return next((it for it in range(iterations) if not uses_fixed_data(distill_lambda, seed, it)), None)


def _ids(item: Any) -> set[str]:
    """The ids a pool item is known by: its task id and its problem id, where it has them."""
    return {str(v) for v in (getattr(item, "task_id", None), getattr(item, "problem_id", None)) if v is not None}


def _problem_of(task_id: str) -> str:
    return task_id.split("#", 1)[0]  # Environment.sample appends '#seed-k' to the pool's task id


def load_fixed_data(path: str | Path, splits: Mapping[str, Sequence[Any]]) -> list[Trajectory]:
    """The trainable trajectories of ``path``, checked against the environment's splits.

    Args:
        path: a trajectories parquet file (``records.write_trajectories``).
        splits: the environment's split → its pool of tasks or problems (``Environment.split``);
            a trajectory belongs to the pool item whose ``task_id`` or ``problem_id`` equals its
            task id up to ``#`` (``Environment.sample`` appends ``#seed-k``).

    Returns:
        the trajectories with a reward and at least one model call (env errors and empty
        episodes dropped), in file order. Their token ids are checked against the student's
        vocabulary by :func:`check_token_ids` once the student is loaded.

    Raises:
        ValueError: the file is missing or unreadable, holds no trainable trajectory, or holds
            a problem of the validation or test split or of no split (another environment or
            split seed).
    """
    p = Path(path)
    if p.is_dir():
        hint = f"; did you mean {p / 'episodes.parquet'}?" if (p / "episodes.parquet").is_file() else ""
        raise ValueError(f"--distill-data {p} is a folder: give a trajectories parquet file{hint}")
    if not p.is_file():
        raise ValueError(
            f"--distill-data {p}: no such file; write one with `consequence eval --model TEACHER "
            "--split train --out DIR` (DIR/episodes.parquet) or `consequence demos --out FILE` (the "
            "scripted teacher's demonstrations)"
        )
    try:
        trajs = read_trajectories(p)
    except Exception as e:  # pyarrow's own message says what is wrong with the file
        raise ValueError(f"--distill-data {p}: not a trajectories parquet file ({type(e).__name__}: {e})") from None
    usable = [t for t in trajs if t.reward is not None and t.calls]
    if not usable:
        raise ValueError(f"--distill-data {p}: none of its {len(trajs)} trajectories has a reward and a model call")
    where = {key: s for s, pool in splits.items() for item in pool for key in _ids(item)}
    for t in usable:
        split = where.get(_problem_of(t.task_id))
        if split != "train":
            why = (
                f"is a {split}-split problem"
                if split
                else "is in no split of this environment (another env or --split-seed?)"
            )
            raise ValueError(
                f"--distill-data {p}: task {t.task_id!r} {why}; fixed data may hold train-split "
                "problems only: the file was written for another split (another --split-seed or "
                "environment than this run's, or --split other than train); write it again with this "
                "run's --split-seed (`consequence eval --split train` or `consequence demos`)"
            )
    return usable


def check_token_ids(trajs: Sequence[Trajectory], vocab_size: int, option: str) -> None:
    """Every token id of ``trajs`` is below ``vocab_size`` (the data was tokenised by the student's tokenizer).

    Raises:
        ValueError: names the first task with an id outside the vocabulary.
    """
    for t in trajs:
        top = max((max(c.context_ids + c.output_ids, default=0) for c in t.calls), default=0)
        if top >= vocab_size:
            raise ValueError(
                f"{option}: task {t.task_id!r} holds token id {top}, outside the student's vocabulary "
                f"of {vocab_size}; the data must be tokenised with the student's tokenizer"
            )


def draw_fixed_batch(pool: Sequence[Trajectory], n: int, seed: int, it: int) -> list[Trajectory]:
    """``n`` trajectories of ``pool`` for iteration ``it``: a seeded draw without replacement
    (cycled through the pool when ``n`` exceeds it), relabelled as one group of this iteration
    (its advantages are not trained on) with ``policy_version`` −1: not the student's samples."""
    order = list(range(len(pool)))
    random.Random(seed_of(seed, it, "distill-data")).shuffle(order)
    out = []
    for k in range(n):
        t = pool[order[k % len(order)]]
        out.append(dataclasses.replace(t, group_id=f"{it}/fixed", policy_version=-1))
    return out


def draw_fixed_pairs(pool: Sequence[Trajectory], n_tasks: int, seed: int, it: int) -> list[Trajectory]:
    """Every stored episode of ``n_tasks`` tasks of ``pool`` for iteration ``it``, for DPO
    (``--advantage dpo`` on ``--distill-data``): only tasks (same ``task_id``: the same
    prompt) with a verified and a failed episode give a pair, so only those are drawn; a
    seeded draw without replacement, cycled when ``n_tasks`` exceeds them. Each task's
    episodes become one group of this iteration (``policy_version`` −1).

    Raises:
        ValueError: no task of the data has both a verified and a failed episode.
    """
    by_task: dict[str, list[Trajectory]] = {}
    for t in pool:
        if credited(t):
            by_task.setdefault(t.task_id, []).append(t)
    tasks = [k for k, ts in by_task.items() if any(map(verified, ts)) and not all(map(verified, ts))]
    if not tasks:
        raise ValueError(
            f"--distill-data holds no task with both a verified and a failed episode ({len(by_task)} tasks), "
            "so DPO has no pair to train on: give episodes of a run that both solved and failed its tasks "
            "(e.g. its trajectories/ folder)"
        )
    order = sorted(tasks)
    random.Random(seed_of(seed, it, "distill-data")).shuffle(order)
    out = []
    for k in range(n_tasks):
        task = order[k % len(order)]
        group = f"{it}/fixed/{k}"  # one group per draw: a task drawn twice is two groups
        out += [dataclasses.replace(t, group_id=group, policy_version=-1) for t in by_task[task]]
    return out
