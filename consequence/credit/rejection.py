"""Rejection sampling's acceptance rule (credit box): which episodes are kept as hard targets.

An episode is *accepted* when the verifier scores it 1 (the environment's first reward
component, the one evaluation calls success) and it finished (not truncated, no
environment error); an accepted episode whose sampled tokens repeat an earlier accepted
one of the same task is a duplicate and dropped. Used by ``--advantage rejection`` (each
kept episode's sampled tokens get advantage 1, every other episode leaves the batch: the
policy-gradient surrogate is then SFT on the student's own successes) and by
:mod:`consequence.distill.rejection` (rejection-sampling SFT as a library; RFT, Yuan et al.
2023 §3; STaR, Zelikman et al. 2022 §3.1 without rationalisation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from consequence.records import Trajectory, verified

__all__ = ["RejectionStats", "accept"]


@dataclass(frozen=True)
class RejectionStats:
    """What one round of rejection sampling cost and kept.

    Attributes:
        attempts: episodes that count as tries (every episode except environment errors).
        accepted: kept demonstrations (after dropping duplicates).
        duplicates: verified episodes dropped because the same task already had one with
            identical sampled tokens (a repeat would only up-weight it).
        env_errors: episodes the environment failed (not the student's fault; not attempts).
        tasks: distinct tasks tried; tasks_accepted: tasks with at least one kept episode.
    """

    attempts: int
    accepted: int
    duplicates: int
    env_errors: int
    tasks: int
    tasks_accepted: int

    @property
    def acceptance_rate(self) -> float:
        """accepted / attempts (NaN without attempts)."""
        return self.accepted / self.attempts if self.attempts else math.nan

    @property
    def attempts_per_accepted(self) -> float:
        """attempts / accepted: samples paid per kept demonstration (inf when none was kept)."""
        return self.attempts / self.accepted if self.accepted else math.inf

    def as_dict(self) -> dict:
        """The counts plus the two ratios (None where undefined), for JSON."""
        d = asdict(self)
        d["acceptance_rate"] = None if not self.attempts else self.acceptance_rate
        d["attempts_per_accepted"] = None if not self.accepted else self.attempts_per_accepted
        return d


def _sampled_tokens(t: Trajectory) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(c.output_ids) for c in t.calls)


def accept(trajectories: Sequence[Trajectory], unique: bool = True) -> tuple[list[Trajectory], RejectionStats]:
    """Keep the verified episodes of ``trajectories`` (module doc), in their order.

    Args:
        trajectories: scored episodes (``verifier_score`` set by the reward box).
        unique: drop an accepted episode whose sampled tokens (every call's output ids)
            repeat an earlier accepted one of the same task.

    Returns:
        (accepted trajectories, :class:`RejectionStats`).

    Raises:
        ValueError: an episode that is not an environment error has no reward (it was never
            scored, so it can neither be accepted nor rejected).
    """
    kept: list[Trajectory] = []
    seen: set[tuple[str, tuple]] = set()
    attempts = dup = errors = 0
    tasks: set[str] = set()
    for t in trajectories:
        tasks.add(t.task_id)
        if t.outcome == "env_error":
            errors += 1
            continue
        if t.reward is None:
            raise ValueError(
                f"rejection sampling: episode {t.task_id} #{t.sample_id} was never scored; "
                "score the trajectories (reward box) before accepting them"
            )
        attempts += 1
        if not verified(t):
            continue
        key = (t.task_id, _sampled_tokens(t))
        if unique and key in seen:
            dup += 1
            continue
        seen.add(key)
        kept.append(t)
    stats = RejectionStats(attempts, len(kept), dup, errors, len(tasks), len({t.task_id for t in kept}))
    return kept, stats
