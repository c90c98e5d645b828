"""Preferences from a verifier (reward box): which episode of a task is preferred to which.

A verifier's pass / fail orders the episodes of one task: every verified episode (the
verifier scored it 1 and it finished, :func:`consequence.records.verified`) is preferred to
every failed one of the same group (a wrong answer, or cut by a budget). DPO
(:mod:`consequence.credit.dpo`) trains on these pairs directly; a reward model
(:mod:`consequence.reward.reward_model`) learns a score from them.
"""

from __future__ import annotations

from collections.abc import Sequence

from consequence.records import Trajectory, verified

__all__ = ["preference_pairs"]


def preference_pairs(trajs: Sequence[Trajectory], credited: Sequence[bool]) -> list[tuple[int, int]]:
    """(chosen, rejected) trajectory indices: each verified episode against each credited,
    unverified one of the same group, in index order. ``credited[i]``: episode i has rows."""
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        if credited[i]:
            groups.setdefault(t.group_id, []).append(i)
    pairs = []
    for members in groups.values():
        won = [i for i in members if verified(trajs[i])]
        lost = [i for i in members if not verified(trajs[i])]
        pairs += [(w, r) for w in won for r in lost]
    return pairs
